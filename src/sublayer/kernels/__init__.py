"""``sublayer.kernels``: fused CPU kernels (a C++ extension compiled at first use, cached).

The first process that needs the extension compiles it with ``torch.utils.cpp_extension`` (one line on stderr says
so: "compiling sublayer's fused CPU kernels (once, ~N s)…") and stores the shared library in a cache folder
(``$SUBLAYER_KERNELS_CACHE`` or ``~/.cache/sublayer/kernels``) named by a hash of everything that changes the
binary: the C++ sources, the compiler flags, the torch and Python versions, the CPU's flags and the compiler's
version — never paths, so another virtual environment with the same torch reuses it. Later processes load that
library directly (no ninja, no compiler run). ``python -m sublayer.kernels`` builds it ahead of time (e.g. in a
Dockerfile after ``pip install``).

A manifest written with the library records its size and sha256; a cached library that does not match it (a
truncated or damaged file) or does not load is discarded and rebuilt, never loaded.

Concurrent first uses wait on an OS file lock (``flock``) held by the builder; the OS drops it when the builder dies,
so a build killed midway never blocks later processes (its half-built folder is removed and the build restarts).
A builder still alive after ``$SUBLAYER_KERNELS_LOCK_TIMEOUT`` seconds (default 600) is given up on.

If the extension cannot be built (no compiler, no ninja, a compile error, the lock timeout) ONE warning names the
cause and the modules use the pure-PyTorch reference path of :mod:`sublayer.functional`.

Switches: ``SUBLAYER_KERNELS=0`` in the environment, or :func:`set_enabled` (``False`` forces the reference path).
Switched off, nothing is built or loaded: :func:`available` is False, ``impl="fused"`` raises.
This package imports nothing from sublayer but :mod:`sublayer.settings`; :mod:`sublayer.kernels.cpu` reads the
CPU's features for every module.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch

from .. import settings
from . import _loader, cpu, onednn
from ._loader import cache_dir
from .cpu import native_bf16_gemm

__all__ = ["available", "enabled", "set_enabled", "ops", "status", "build_error", "cache_dir", "native_bf16_gemm"]

# Every csrc/*.cpp is one translation unit of the extension: add_norm.cpp holds TORCH_LIBRARY(sublayer_kernels),
# the other files add their ops with TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m). (_loader reads these names.)
_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
_NAME = "sublayer_kernels"
LDFLAGS = ["-fopenmp"]


def cflags() -> list[str]:
    """The compiler flags. ``SUBLAYER_ISA=avx2`` compiles the code of an AVX2 + FMA CPU (x86-64-v3) on any x86 CPU,
    so its paths can be measured anywhere (read at the call: a bad value raises there, not at import)."""
    march = "-march=x86-64-v3" if settings.isa() == "avx2" else "-march=native"
    return ["-O3", march, "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17"]


_lock = threading.Lock()
_state: dict = {"tried": False, "ok": False, "error": None}
_build = _loader.build  # a name of its own: tests replace it to simulate a failed build
_enabled: bool | None = None  # SUBLAYER_KERNELS, read at the first call (a bad value raises there, not at import)


def set_enabled(flag: bool) -> None:
    """Turn the fast kernels on (default) or off (every module then runs the reference path)."""
    global _enabled
    _enabled = bool(flag)


def switched_on() -> bool:
    """Whether the fast path is switched on (``SUBLAYER_KERNELS``, :func:`set_enabled`), built or not."""
    if _enabled is None:
        set_enabled(settings.kernels_enabled())
    return _enabled


def use_onednn(t: torch.Tensor, n: int | None = None) -> bool:
    """Whether products on ``t`` go through oneDNN (:mod:`sublayer.kernels.onednn`): ``t`` float32 on the CPU, the
    kernels switched on, on a CPU where torch's BLAS runs a generic path (:func:`cpu.onednn_fp32_gemm`), and given
    ``n``, ``t`` (..., K) @ (K, ``n``) has :data:`onednn.MIN_MACS` multiply-adds or more."""
    if n is not None and t.numel() * n < onednn.MIN_MACS:
        return False
    return t.dtype == torch.float32 and t.device.type == "cpu" and switched_on() and cpu.onednn_fp32_gemm()


def enabled() -> bool:
    """True when the fast path is switched on AND the extension is built (builds it on first call): :func:`available`."""
    return available()


def _registered() -> bool:
    try:
        getattr(torch.ops, _NAME).act_fwd  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def available() -> bool:
    """Whether the kernels can run: switched on (:func:`switched_on`) and the extension built/loaded, once per
    process (False, with one warning, if that fails). Switched off: False, and nothing is built or loaded."""
    if not switched_on():
        return False
    if _state["tried"]:
        return _state["ok"]
    limit_mb = settings.buffer_cache_mb()  # a bad value is the user's to fix, not a failed build
    with _lock:
        if not _state["tried"]:
            try:
                if not _registered():
                    _build()
                if not _registered():
                    raise RuntimeError("the extension loaded but registered no ops")
                if limit_mb is not None:
                    ops().buffer_cache(int(limit_mb * 2**20))
                _state["ok"] = True
            except Exception as e:  # no compiler, no ninja, compile error, lock timeout, ...: one warning (tried once)
                _state["error"] = _loader.cause(e)
                warnings.warn(
                    f"sublayer: fast CPU kernels unavailable ({_state['error']}); "
                    "using the pure-PyTorch reference path (same results, slower; SUBLAYER_KERNELS=0 hides this)",
                    RuntimeWarning,
                    stacklevel=_loader.user_stacklevel(),
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
    if not switched_on():
        return "off (SUBLAYER_KERNELS=0 or set_enabled(False)): reference path"
    if available():
        gemm = "native" if native_bf16_gemm() else "via fp32 (no AVX512_BF16/AMX)"
        return f"active (C++/OpenMP, {' '.join(cflags()[:2])}; bf16 GEMMs {gemm}; cache {cache_dir()})"
    return f"unavailable, reference path in use ({_state['error']})"


def _reset_for_tests() -> None:
    """Forget the load attempt (tests simulate a missing compiler with it)."""
    _state.update(tried=False, ok=False, error=None)
    _loader._key.clear()
