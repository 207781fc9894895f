"""Allocator settings: glibc memory reuse for the whole process, and the fused Add & Norm's buffer cache.

Memory-bound ops (norms, dropout, residual adds) on multi-MB tensors can spend more time in page faults than in
arithmetic: under glibc's default ``malloc`` a big block freed at the end of a training step is often handed back to
the kernel (``munmap`` above the mmap threshold, or heap trimming), and the next step's block of the same size then
faults on every 4 KiB page it touches (filling a freshly mapped tensor costs several times what refilling a
recycled one does).

* :func:`set_memory_reuse` makes glibc keep freed memory for reuse, process-wide: every op (torch's own included)
  stops page-faulting on recycled sizes. Cost: the process keeps its peak heap (resident memory does not shrink
  after a big step). The ``sublayer`` command line turns it on for every command.
* The fused Add & Norm kernels keep their own big buffers (output, saved state, input gradients) in a bounded
  cache whatever the allocator (:func:`buffer_cache`; ``$SUBLAYER_BUFFER_CACHE_MB``, default 256 MiB), so their
  speed does not depend on this setting.

This module imports no torch at import time.
"""

from __future__ import annotations

import numbers
import os
import platform

__all__ = ["set_memory_reuse", "memory_reuse_active", "allocator_setting", "env_allocator", "buffer_cache"]

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_state = {"reuse": False}


def set_memory_reuse() -> bool:
    """Make glibc keep freed memory for reuse, for the whole process (idempotent; cannot be undone).

    Calls ``mallopt(M_MMAP_MAX, 0)`` (big blocks come from the heap, not from fresh ``mmap`` calls) and
    ``mallopt(M_TRIM_THRESHOLD, 2**31 - 1)`` (freed heap memory is not returned to the kernel), so a freed
    multi-MB tensor's pages are reused, already mapped, by the next tensor: no page faults on recycled sizes.

    Memory cost: the process's resident memory stays at its peak heap size instead of shrinking after big steps
    (the memory is reused, not leaked). Call it early, before the big allocations.

    Returns:
        True when the setting is active; False where it is unavailable (not glibc: macOS, Windows, musl), in which
        case nothing changes.
    """
    if _state["reuse"]:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False
    _state["reuse"] = ok
    return ok


def memory_reuse_active() -> bool:
    """Whether :func:`set_memory_reuse` took effect in this process."""
    return _state["reuse"]


def env_allocator() -> str | None:
    """An allocator condition set from outside: a preloaded malloc or glibc's MALLOC_* tunables."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if name in preload:
            return f"{name} (LD_PRELOAD)"
    tun = sorted(k for k in os.environ if k.startswith("MALLOC_") and k.endswith("_"))
    if tun or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "glibc with " + (", ".join(tun) or "GLIBC_TUNABLES") + " from the environment"
    return None


def allocator_setting() -> str:
    """One line: the process's allocator setting (what ``sublayer info``, ``bench`` and ``demo`` print)."""
    if _state["reuse"]:
        return "glibc, memory reuse on (sublayer.set_memory_reuse: mallopt no mmap, no trim)"
    return env_allocator() or "glibc default (freed big blocks go back to the kernel)"


def buffer_cache(limit_mb: float | None = None) -> dict[str, float]:
    """The fused Add & Norm kernels' cache of big buffers: its state, after setting its limit if given.

    Blocks of 256 KiB or more freed by those kernels' tensors are kept (up to the limit) for the next request of the
    same size; memory cost: at most ``limit_mb`` of freed buffers held between steps.

    Args:
        limit_mb: new limit in MiB (0 empties the cache and turns it off); None leaves it.

    Returns:
        ``{"limit_mb", "cached_mb", "blocks", "hits", "misses"}``; all zero when the kernels are switched off or
        unavailable.

    Raises:
        TypeError: ``limit_mb`` not a number. ValueError: ``limit_mb`` negative, not finite or above 2**40.
    """
    if limit_mb is not None:
        if isinstance(limit_mb, bool) or not isinstance(limit_mb, numbers.Real):
            raise TypeError(f"limit_mb must be a number of MiB, got {limit_mb!r} ({type(limit_mb).__name__})")
        if not 0 <= limit_mb <= 2**40:
            raise ValueError(f"limit_mb must be a number of MiB in [0, 2**40], got {limit_mb}")
    from . import kernels

    if not kernels.available():
        return {"limit_mb": 0.0, "cached_mb": 0.0, "blocks": 0, "hits": 0, "misses": 0}
    lim, cached, blocks, hits, misses = kernels.ops().buffer_cache(-1 if limit_mb is None else int(limit_mb * 2**20))
    return {"limit_mb": lim / 2**20, "cached_mb": round(cached / 2**20, 3), "blocks": blocks, "hits": hits,
            "misses": misses}  # fmt: skip
