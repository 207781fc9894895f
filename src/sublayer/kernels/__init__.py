"""``sublayer.kernels``: fused CPU kernels (a C++ extension compiled at first use, cached).

The extension is built with ``torch.utils.cpp_extension.load`` the first time a fast path asks for it, into a cache
folder keyed by torch version and CPU flags (``$SUBLAYER_KERNELS_CACHE`` or ``~/.cache/sublayer/kernels``), so the
next process only loads the shared library. If it cannot be built (no compiler, no ninja, a compile error) ONE
warning is emitted and the modules use the pure-PyTorch reference path of :mod:`sublayer.functional`.

Switches: ``SUBLAYER_KERNELS=0`` in the environment, or :func:`set_enabled` (``False`` forces the reference path).
This package imports nothing else from sublayer.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["available", "enabled", "set_enabled", "ops", "status", "build_error", "cache_dir", "native_bf16_gemm"]

# Every csrc/*.cpp is one translation unit of the extension: kernels.cpp holds TORCH_LIBRARY(sublayer_kernels),
# the other files add their ops with TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m).
_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_NAME = "sublayer_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict = {"tried": False, "ok": False, "error": None, "warned": False}


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


def cache_dir() -> Path:
    """Where the extension is built and cached."""
    root = os.environ.get("SUBLAYER_KERNELS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sublayer", "kernels")
    tag = f"torch{torch.__version__.split('+')[0]}-{_cpu_tag()}"
    return Path(root) / tag


def _build() -> None:
    """Compile (or load the cached) extension; registers ``torch.ops.sublayer_kernels``. Raises on failure."""
    from torch.utils import cpp_extension

    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=_NAME,
        sources=[str(p) for p in _SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=str(d),
        is_python_module=False,
        verbose=os.environ.get("SUBLAYER_KERNELS_VERBOSE", "0") == "1",
    )


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
            except Exception as e:  # no compiler, no ninja, compile error, ...
                _state["ok"] = False
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""]
                first_error = next((ln for ln in lines if "error" in ln.lower()), lines[-1])
                _state["error"] = f"{type(e).__name__}: {first_error[:300]}"
                if not _state["warned"]:
                    _state["warned"] = True
                    warnings.warn(
                        f"sublayer: fast CPU kernels unavailable ({_state['error']}); "
                        "using the pure-PyTorch reference path",
                        RuntimeWarning,
                        stacklevel=3,
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
