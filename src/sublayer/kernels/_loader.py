"""Building, caching and loading the fused kernels' extension (used by :mod:`sublayer.kernels`).

The cache folder is named by a hash of what changes the binary (:func:`key_inputs`); a cached library is loaded
with ``torch.ops.load_library`` once its size and sha256 match its manifest (:func:`entry_problem`); a missing or
damaged one is compiled under an OS file lock in a fresh temporary folder and moved into place atomically, then its
manifest. See the package docstring for the user-facing behaviour.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import settings
from . import cpu

_key: dict = {}  # key_inputs(), computed once per process
# What the "compiling" line announces until this machine has built once (then the last build's time): a rough
# figure for a small machine.
_BUILD_SECONDS_ESTIMATE = 50


def _pkg():
    """The package :mod:`sublayer.kernels`: it names what is built (``_SOURCES``, ``_HEADERS``, ``_NAME``,
    ``cflags()``, ``LDFLAGS``); read at call time, so a test can change them."""
    return sys.modules[__package__]


def _compiler() -> tuple[str, str | None]:
    """The C++ compiler torch's build uses (``$CXX`` or ``c++``) and its version line (None: not runnable)."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return cxx, None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx, None
    return cxx, (out.strip().splitlines() or [""])[0]


def key_inputs() -> dict:
    """What changes the binary (and nothing else: no venv or torch install paths), memoised per process."""
    if not _key:
        h = hashlib.sha256()
        pkg = _pkg()
        for p in pkg._SOURCES + pkg._HEADERS:
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
        cxx, version = _compiler()
        _key.update(
            sources=h.hexdigest(),
            cflags=pkg.cflags(),
            ldflags=list(pkg.LDFLAGS),
            torch=torch.__version__,
            torch_git=getattr(torch.version, "git_version", ""),
            cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
            python=sys.implementation.cache_tag,
            cpu=cpu.tag(),
            compiler=version if version is not None else f"{cxx} (not found)",
        )
    return _key


def cache_dir() -> Path:
    """Where this build of the extension is cached: one folder per hash of :func:`key_inputs`."""
    root = settings.kernels_cache_root()
    digest = hashlib.sha256(json.dumps(key_inputs(), sort_keys=True).encode()).hexdigest()[:16]
    return root / f"torch{torch.__version__.split('+')[0]}-{digest}"


@contextlib.contextmanager
def _build_lock(path: Path, timeout: float):
    """Hold an exclusive ``flock`` on ``path`` (the OS releases it if this process dies); TimeoutError after
    ``timeout`` s of a live holder. The file records the holder ("pid@host") for the waiting message.
    Yields whether the lock is exclusive (False without ``fcntl`` or on a file system without locks: each
    builder still uses its own folder)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return

    def try_lock() -> bool | None:  # True: ours; False: held by a live process; None: no locks on this fs
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError:  # ENOLCK
            return None

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        got = try_lock()
        if got is None:
            yield False
            return
        if not got:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            print(f"sublayer: waiting for another process ({owner}) compiling the fused CPU kernels…", file=sys.stderr, flush=True)
            deadline = time.monotonic() + timeout
            while not try_lock():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process ({owner}) has held {path} for over {timeout:g} s (SUBLAYER_KERNELS_LOCK_TIMEOUT)"
                    )
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}@{socket.gethostname()}\n".encode(), 0)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _check_toolchain() -> None:
    """Raise with the plain cause when the build cannot start (before torch prints a long command line)."""
    from torch.utils import cpp_extension

    cxx, version = _compiler()
    if version is None:
        raise RuntimeError(f"{cxx}: not found (install a C++ compiler such as g++, or set CXX)")
    with _ninja_on_path():
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja: not found (pip install ninja)")


@contextlib.contextmanager
def _ninja_on_path():
    """Put the ``ninja`` package's binary on PATH while building when PATH has none (a venv used without being
    activated: ``.venv/bin/python`` finds no ``ninja`` although the dependency is installed)."""
    old = os.environ.get("PATH")
    if shutil.which("ninja") is None:
        try:
            import ninja

            extra = getattr(ninja, "BIN_DIR", None) or os.path.dirname(sys.executable)
        except ImportError:
            extra = os.path.dirname(sys.executable)
        os.environ["PATH"] = os.pathsep.join([extra, old]) if old else extra
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def _compile(build_dir: Path) -> Path:
    """Compile the extension in ``build_dir`` with torch's JIT builder (this also loads it); return the library."""
    from torch.utils import cpp_extension

    pkg = _pkg()
    cpp_extension.load(
        name=pkg._NAME,
        sources=[str(p) for p in pkg._SOURCES],
        extra_cflags=pkg.cflags(),  # copies: torch appends to these lists (library paths of this venv)
        extra_ldflags=list(pkg.LDFLAGS),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=settings.kernels_verbose(),
    )
    return build_dir / f"{pkg._NAME}.so"


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))


MANIFEST = "manifest.json"  # next to the library: its size and sha256, written after it at build time


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file in its folder, then a rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def entry_problem(lib: Path) -> str | None:
    """Why the cached library ``lib`` must not be loaded (None: it is the file its manifest recorded at build time).

    Loading a truncated library maps pages past its end (SIGBUS at first use), so the size and sha256 recorded
    when it was built are checked before it is loaded."""
    try:
        man = json.loads((lib.parent / MANIFEST).read_text())
        size, digest = int(man["size"]), str(man["sha256"])
    except FileNotFoundError:
        return "no manifest"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest: {type(e).__name__}"
    try:
        actual = lib.stat().st_size
        if actual != size:
            return f"{actual} bytes, {size} recorded at build"
        if _sha256(lib) != digest:
            return "its sha256 differs from the one recorded at build"
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    return None


def _load_cached(lib: Path) -> str | None:
    """Load the cached library ``lib`` once its manifest vouches for it (:func:`entry_problem`); None when it is
    loaded, else why not (the manifest's problem, or the loader's error: "it does not load: ...")."""
    if (problem := entry_problem(lib)) is not None:
        return problem
    try:
        _load_library(lib)
        return None
    except OSError as e:
        return f"it does not load: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def build() -> None:
    """Load the cached library, or compile it once; registers ``torch.ops.sublayer_kernels``. Raises on failure.

    A cached library that fails its manifest's check (truncated, damaged, interrupted between the two writes) or does
    not load is discarded and rebuilt; if the rebuild fails too, the error names the file."""
    d = cache_dir()
    lib = d / f"{_pkg()._NAME}.so"
    problem = None
    if lib.exists() and (problem := _load_cached(lib)) is None:
        return
    d.mkdir(parents=True, exist_ok=True)
    with _build_lock(d / "build.lock", settings.kernels_lock_timeout()) as exclusive:
        if lib.exists() and not (problem or "").startswith("it does not load"):
            problem = _load_cached(lib)  # another process may have built (or rebuilt) it while we waited
            if problem is None:
                return
        if problem is not None:
            for p in (lib, d / MANIFEST):
                p.unlink(missing_ok=True)
            print(f"sublayer: discarded the damaged cached library {lib} ({problem})", file=sys.stderr, flush=True)
        try:
            _compile_into(d, lib, exclusive)
        except Exception as e:
            if problem is None:
                raise
            raise RuntimeError(f"the cached library {lib} was damaged ({problem}) and rebuilding it failed: {cause(e)}") from e


def _compile_into(d: Path, lib: Path, exclusive: bool) -> None:
    """Compile the library (we hold the build lock) and publish it: the library, then its manifest, each atomically."""
    # We hold the lock, so any build-* folder is left by a build that was killed midway: start afresh.
    stale = sorted(d.glob("build-*")) if exclusive else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    _check_toolchain()
    note = " (an interrupted earlier build was discarded)" if stale else ""
    try:  # the seconds the last build took on this machine (the default estimate before any)
        estimate = max(1, round(float((d.parent / "last_build_seconds").read_text())))
    except (OSError, ValueError):
        estimate = _BUILD_SECONDS_ESTIMATE
    print(f"sublayer: compiling sublayer's fused CPU kernels (once, ~{estimate} s){note}…", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=d))
    try:
        with _ninja_on_path():
            built = _compile(tmp)
        manifest = json.dumps({"file": lib.name, "size": built.stat().st_size, "sha256": _sha256(built)}, indent=1)
        _write_atomic(d / "key.json", json.dumps(key_inputs(), indent=1, sort_keys=True))
        os.replace(built, lib)  # atomic: a library in the cache is always a complete one...
        _write_atomic(d / MANIFEST, manifest)  # ...and is loaded only once its manifest vouches for it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - t0
    with contextlib.suppress(OSError):
        _write_atomic(d.parent / "last_build_seconds", f"{seconds:.0f}\n")
    print(f"sublayer: compiled in {seconds:.0f} s, cached in {d}", file=sys.stderr, flush=True)


def cause(e: BaseException) -> str:
    """The line that says why the build failed — a compiler diagnostic, not the (long) command line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    command = re.compile(r"^(\[\d+/\d+\]|FAILED:|\S*(c\+\+|g\+\+|gcc|clang\+?\+?|cc)\s)|\s-o\s|\s-c\s")
    diagnostics = [ln for ln in lines if not command.search(ln) and not ln.startswith("Error building extension")]
    first = next((ln for ln in diagnostics if re.search(r"error|not found|no such file", ln, re.I)), None)
    first = first or (diagnostics or lines or [""])[0]
    if len(first) > 500:
        first = first[:500] + "…"
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def user_stacklevel() -> int:
    """``warnings.warn`` stacklevel that points at the first frame outside sublayer and torch (the user's line),
    for a warn() called in the function that calls this one."""
    internal = tuple(str(Path(m.__file__).resolve().parent) + os.sep for m in (sys.modules[__name__.split(".")[0]], torch))

    def is_internal(name: str) -> bool:
        return name.startswith("<frozen ") or os.path.realpath(name).startswith(internal)

    frame, level = sys._getframe(1), 1
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2
