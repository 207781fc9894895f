"""``sublayer.kernels``: fused CPU kernels (a C++ extension compiled at first use, cached).

The first process that needs the extension compiles it with ``torch.utils.cpp_extension`` (one line on stderr says
so: "compiling sublayer's fused CPU kernels (once, ~N s)…") and stores the shared library in a cache folder
(``$SUBLAYER_KERNELS_CACHE`` or ``~/.cache/sublayer/kernels``) named by a hash of everything that changes the
binary: the C++ sources, the compiler flags, the torch and Python versions, the CPU's flags and the compiler's
version — never paths, so another virtual environment with the same torch reuses it. Later processes load that
library directly (no ninja, no compiler run). ``python -m sublayer.kernels`` builds it ahead of time (e.g. in a
Dockerfile after ``pip install``).

Concurrent first uses wait on an OS file lock (``flock``) held by the builder; the OS drops it when the builder dies,
so a build killed midway never blocks later processes (its half-built folder is removed and the build restarts).
A builder still alive after ``$SUBLAYER_KERNELS_LOCK_TIMEOUT`` seconds (default 600) is given up on.

If the extension cannot be built (no compiler, no ninja, a compile error, the lock timeout) ONE warning names the
cause and the modules use the pure-PyTorch reference path of :mod:`sublayer.functional`.

Switches: ``SUBLAYER_KERNELS=0`` in the environment, or :func:`set_enabled` (``False`` forces the reference path).
This package imports nothing else from sublayer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

__all__ = ["available", "enabled", "set_enabled", "ops", "status", "build_error", "cache_dir", "native_bf16_gemm"]

# Every csrc/*.cpp is one translation unit of the extension: kernels.cpp holds TORCH_LIBRARY(sublayer_kernels),
# the other files add their ops with TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m).
_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
_NAME = "sublayer_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict = {"tried": False, "ok": False, "error": None, "warned": False}
_key: dict = {}
# First build measured on this project's 2-core machine (see the README); the "compiling" line shows it until
# this machine has built once (then the last build's time).
_BUILD_SECONDS_ESTIMATE = 50


def _env_enabled(environ=os.environ) -> bool:
    """``SUBLAYER_KERNELS`` = 0/false/off/no switches the kernels off (read once, at import)."""
    return environ.get("SUBLAYER_KERNELS", "1").strip().lower() not in ("0", "false", "off", "no")


_enabled = _env_enabled()


def set_enabled(flag: bool) -> None:
    """Turn the fast kernels on (default) or off (every module then runs the reference path)."""
    global _enabled
    _enabled = bool(flag)


def enabled() -> bool:
    """True when the fast path is switched on AND the extension is built (builds it on first call)."""
    return _enabled and available()


_native_bf16: bool | None = None


def native_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX-BF16; non-x86: assumed yes).

    Without it, oneDNN's bf16 GEMM is ~8x slower than fp32 here (AVX2): the fused FFN then multiplies bf16
    operands in fp32 and rounds the result to bf16 — the numbers of a bf16 GEMM with fp32 accumulation.
    ``SUBLAYER_BF16_GEMM=native`` / ``=fp32`` overrides the detection.
    """
    global _native_bf16
    if _native_bf16 is None:
        force = os.environ.get("SUBLAYER_BF16_GEMM", "").strip().lower()
        if force in ("native", "fp32"):
            _native_bf16 = force == "native"
        elif platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
            _native_bf16 = True
        else:
            try:
                text = Path("/proc/cpuinfo").read_text()
                flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split()
                _native_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
            except OSError:
                _native_bf16 = True
    return _native_bf16


def _cpu_tag() -> str:
    # -march=native code must not be reused on another CPU: key the cache on the CPU's flags.
    info = platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
        model = next((ln for ln in text.splitlines() if ln.startswith("model name")), "")
        info += flags + model
    except OSError:
        pass
    return hashlib.sha1(info.encode()).hexdigest()[:10]


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


def _key_inputs() -> dict:
    """What changes the binary (and nothing else: no venv or torch install paths), memoised per process."""
    if not _key:
        h = hashlib.sha256()
        for p in _SOURCES + _HEADERS:
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
        cxx, version = _compiler()
        _key.update(
            sources=h.hexdigest(),
            cflags=list(CFLAGS),
            ldflags=list(LDFLAGS),
            torch=torch.__version__,
            torch_git=getattr(torch.version, "git_version", ""),
            cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
            python=sys.implementation.cache_tag,
            cpu=_cpu_tag(),
            compiler=version if version is not None else f"{cxx} (not found)",
        )
    return _key


def cache_dir() -> Path:
    """Where this build of the extension is cached: one folder per hash of :func:`_key_inputs`."""
    root = os.environ.get("SUBLAYER_KERNELS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sublayer", "kernels")
    digest = hashlib.sha256(json.dumps(_key_inputs(), sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / f"torch{torch.__version__.split('+')[0]}-{digest}"


def _lock_timeout() -> float:
    try:
        return float(os.environ.get("SUBLAYER_KERNELS_LOCK_TIMEOUT", "600"))
    except ValueError:
        return 600.0


@contextlib.contextmanager
def _build_lock(path: Path, timeout: float):
    """Hold an exclusive ``flock`` on ``path`` (the OS releases it if this process dies); TimeoutError after
    ``timeout`` s of a live holder. The file records the holder ("pid@host") for the waiting message.
    Yields whether the lock is exclusive (False without ``fcntl``: each builder still uses its own folder)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            print(f"sublayer: waiting for another process ({owner}) compiling the fused CPU kernels…", file=sys.stderr, flush=True)
            deadline = time.monotonic() + timeout
            while True:
                time.sleep(0.1)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"another process ({owner}) has held {path} for over {timeout:g} s "
                            "(SUBLAYER_KERNELS_LOCK_TIMEOUT)"
                        ) from None
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

    cpp_extension.load(
        name=_NAME,
        sources=[str(p) for p in _SOURCES],
        extra_cflags=list(CFLAGS),  # copies: torch appends to these lists (library paths of this venv)
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=os.environ.get("SUBLAYER_KERNELS_VERBOSE", "0") == "1",
    )
    return build_dir / f"{_NAME}.so"


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))


def _build() -> None:
    """Load the cached library, or compile it once; registers ``torch.ops.sublayer_kernels``. Raises on failure."""
    d = cache_dir()
    lib = d / f"{_NAME}.so"
    if lib.is_file():
        _load_library(lib)
        return
    d.mkdir(parents=True, exist_ok=True)
    with _build_lock(d / "build.lock", _lock_timeout()) as exclusive:
        if lib.is_file():  # another process built it while we waited
            _load_library(lib)
            return
        # We hold the lock, so any build-* folder is left by a build that was killed midway: start afresh.
        stale = sorted(d.glob("build-*")) if exclusive else []
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        _check_toolchain()
        note = " (an interrupted earlier build was discarded)" if stale else ""
        print(
            f"sublayer: compiling sublayer's fused CPU kernels (once, ~{_build_estimate(d.parent)} s){note}…",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix="build-", dir=d))
        try:
            with _ninja_on_path():
                built = _compile(tmp)
            (d / "key.json").write_text(json.dumps(_key_inputs(), indent=1, sort_keys=True))
            os.replace(built, lib)  # atomic: a library in the cache is always a complete one
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        seconds = time.perf_counter() - t0
        with contextlib.suppress(OSError):
            (d.parent / "last_build_seconds").write_text(f"{seconds:.0f}\n")
        print(f"sublayer: compiled in {seconds:.0f} s, cached in {d}", file=sys.stderr, flush=True)


def _build_estimate(root: Path) -> int:
    """Seconds the last build under ``root`` took on this machine (the measured default before any)."""
    try:
        return max(1, round(float((root / "last_build_seconds").read_text())))
    except (OSError, ValueError):
        return _BUILD_SECONDS_ESTIMATE


def _cause(e: BaseException) -> str:
    """The line that says why the build failed — a compiler diagnostic, not the (long) command line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    command = re.compile(r"^(\[\d+/\d+\]|FAILED:|\S*(c\+\+|g\+\+|gcc|clang\+?\+?|cc)\s)|\s-o\s|\s-c\s")
    diagnostics = [ln for ln in lines if not command.search(ln) and not ln.startswith("Error building extension")]
    first = next((ln for ln in diagnostics if re.search(r"error|not found|no such file", ln, re.I)), None)
    first = first or (diagnostics or lines or [""])[0]
    if len(first) > 500:
        first = first[:500] + "…"
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _user_stacklevel() -> int:
    """``warnings.warn`` stacklevel that points at the first frame outside sublayer and torch (the user's line),
    for a warn() called in the function that calls this one."""
    internal = tuple(str(Path(m.__file__).resolve().parent) + os.sep for m in (sys.modules[__name__.split(".")[0]], torch))

    def is_internal(name: str) -> bool:
        return name.startswith("<frozen ") or os.path.realpath(name).startswith(internal)

    frame, level = sys._getframe(1), 1
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _registered() -> bool:
    try:
        getattr(torch.ops, _NAME).act_fwd  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def available() -> bool:
    """Build/load the extension once per process; False (with one warning) if that fails."""
    if _state["tried"]:
        return _state["ok"]
    with _lock:
        if not _state["tried"]:
            try:
                if not _registered():
                    _build()
                if not _registered():
                    raise RuntimeError("the extension loaded but registered no ops")
                _state["ok"] = True
            except Exception as e:  # no compiler, no ninja, compile error, lock timeout, ...
                _state["ok"] = False
                _state["error"] = _cause(e)
                if not _state["warned"]:
                    _state["warned"] = True
                    warnings.warn(
                        f"sublayer: fast CPU kernels unavailable ({_state['error']}); "
                        "using the pure-PyTorch reference path (same results, slower; SUBLAYER_KERNELS=0 hides this)",
                        RuntimeWarning,
                        stacklevel=_user_stacklevel(),
                    )
            _state["tried"] = True
    return _state["ok"]


def build_error() -> str | None:
    """Why the extension is unavailable (None if it loaded or was not tried yet)."""
    return _state["error"]


def ops():
    """The registered ops namespace ``torch.ops.sublayer_kernels`` (call :func:`available` first)."""
    return getattr(torch.ops, _NAME)


def status() -> str:
    """One line for ``sublayer info``."""
    if not _enabled:
        return "off (SUBLAYER_KERNELS=0 or set_enabled(False)): reference path"
    if available():
        gemm = "native" if native_bf16_gemm() else "via fp32 (no AVX512_BF16/AMX)"
        return f"active (C++/OpenMP, {' '.join(CFLAGS[:2])}; bf16 GEMMs {gemm}; cache {cache_dir()})"
    return f"unavailable, reference path in use ({_state['error']})"


def _reset_for_tests() -> None:
    """Forget the load attempt (tests simulate a missing compiler with it)."""
    _state.update(tried=False, ok=False, error=None, warned=False)
    _key.clear()
