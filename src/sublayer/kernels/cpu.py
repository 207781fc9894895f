"""The CPU's features, read once per process: ``/proc/cpuinfo``'s flags on Linux (``flags`` on x86, ``Features`` on
Arm), less AVX-512, AMX and AVX-VNNI under ``SUBLAYER_ISA=avx2``; elsewhere none are known and the decisions below
take their portable default.

Every choice that depends on the CPU is made here: the kernels' cache key (:func:`tag`), whether bf16 GEMMs run
natively (:func:`native_bf16_gemm`), which engine the int8 GEMMs use (:func:`int8_engine`), how many threads the
``sublayer`` command uses (:func:`choose_threads`), and the lines ``sublayer info`` prints (:func:`describe`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path

from .. import settings

__all__ = [
    "cpuinfo_text", "flags", "has", "model", "is_x86", "tag", "native_bf16_gemm", "onednn_fp32_gemm", "int8_engine",
    "usable_cpus", "load_snapshot", "others_busy", "busy_cpus", "default_threads", "choose_threads", "describe",
]  # fmt: skip


@functools.cache
def cpuinfo_text() -> str:
    """``/proc/cpuinfo`` as read once ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def _cpuinfo() -> tuple[frozenset[str], str, bool]:
    """(flags, model name, whether /proc/cpuinfo was read) of the first processor listed."""
    text = cpuinfo_text()
    if not text:
        return frozenset(), "", False
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in ("flags", "Features", "model name") and key not in found:
            found[key] = value.strip()
    names = frozenset((found.get("flags") or found.get("Features", "")).split())
    if settings.isa() == "avx2":  # behave as an AVX2 + FMA CPU: what x86-64-v3 code may not use is not there
        names = frozenset(f for f in names if not f.startswith(_BEYOND_AVX2))
    return names, found.get("model name", ""), True


#: the flags ``SUBLAYER_ISA=avx2`` hides (AVX-512 and its extensions, AMX, the 256-bit VNNI of newer cores)
_BEYOND_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx_vnni_int")


def flags() -> frozenset[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` names them (``avx2``, ``avx512f``, ``amx_bf16``…); empty when
    unknown."""
    return _cpuinfo()[0]


def has(*names: str) -> bool:
    """Whether the CPU has any of the flags ``names``."""
    return not flags().isdisjoint(names)


def model() -> str:
    """The CPU's model name ("" when unknown)."""
    return _cpuinfo()[1]


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def tag() -> str:
    """A short hash of the machine type, flags and model: ``-march=native`` code is reused only on the same CPU."""
    return hashlib.sha1(f"{platform.machine()} {' '.join(sorted(flags()))} {model()}".encode()).hexdigest()[:10]


_native_bf16: bool | None = None


def native_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX-BF16; non-x86 or unknown flags: assumed yes).

    Without it, oneDNN's bf16 GEMM is several times slower than fp32 (AVX2): the fused FFN then multiplies bf16
    operands in fp32 and rounds the result to bf16 — the numbers of a bf16 GEMM with fp32 accumulation.
    ``SUBLAYER_BF16_GEMM=native`` / ``=fp32`` overrides the detection (read at the first call).
    """
    global _native_bf16
    if _native_bf16 is None:
        force = settings.bf16_gemm()
        if force is not None:
            _native_bf16 = force == "native"
        else:
            _native_bf16 = not is_x86() or not _cpuinfo()[2] or has("avx512_bf16", "amx_bf16")
    return _native_bf16


@functools.cache
def onednn_fp32_gemm() -> bool:
    """Whether large float32 GEMMs (:func:`sublayer.kernels.onednn.mm`: the fused FFN's, the attention
    projections', the fused loss's logits and input gradient, the decoding paths' many-row products) go through
    oneDNN rather than torch's default BLAS (MKL): on AMD CPUs with AVX-512, where MKL runs its generic code path
    and oneDNN its AVX-512 kernels. Needs torch built with oneDNN."""
    if not (is_x86() and has("avx512f") and "AuthenticAMD" in cpuinfo_text()):
        return False
    from . import onednn

    return onednn.available()


def int8_engine(supported: Iterable[str]) -> str:
    """The quantized engine for the int8 GEMMs among ``supported`` (``torch.backends.quantized.supported_engines``):
    ``"onednn"`` on CPUs with AMX-INT8 or AVX512-VNNI (oneDNN uses them, fbgemm does not), ``"fbgemm"`` elsewhere
    (AVX2). ``SUBLAYER_INT8_ENGINE=fbgemm|onednn`` overrides when that engine is supported."""
    supported = list(supported)
    force = settings.int8_engine()
    if force in supported:
        return force
    return "onednn" if has("amx_int8", "avx512_vnni") and "onednn" in supported else "fbgemm"


def usable_cpus() -> float:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (``cpu.max``, a
    container's ``--cpus``) where there is one."""
    try:
        n = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        n = float(os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1.0, int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return n


def _cpu_ticks(stat: str = "/proc/stat") -> tuple[int, int, int] | None:
    """(busy, total, n) clock ticks since boot summed over the n CPUs this process may run on (its affinity mask:
    a CPU outside it, busy or idle, is not this process's to share), from ``/proc/stat``'s per-CPU lines; where
    the mask is unknown or names no CPU line there (a ``/proc/stat`` that renumbers a container's CPUs), the
    all-CPU line, as ``os.cpu_count()`` CPUs. None where there is none."""
    try:
        mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
    except (AttributeError, OSError):
        mine = set()
    ticks: dict[str, list[int]] = {}
    try:
        with open(stat) as f:
            for line in f:
                if not line.startswith("cpu"):  # the CPU lines come first; the rest (intr: long) is not read
                    break
                name, *fields = line.split()
                if name == "cpu" or name in mine:
                    ticks[name] = [int(x) for x in fields]
    except (OSError, ValueError):
        return None
    rows = [v for k, v in ticks.items() if k != "cpu"]
    n = len(rows)
    if not rows and "cpu" in ticks:
        rows, n = [ticks["cpu"]], os.cpu_count() or 1
    if not rows or any(len(v) < 4 for v in rows):
        return None
    busy = sum(sum(v) - v[3] - (v[4] if len(v) > 4 else 0) for v in rows)  # idle and iowait are not busy
    return busy, sum(sum(v) for v in rows), n


def load_snapshot() -> tuple:
    """The machine's and this process's CPU time now: the start of a measurement by :func:`others_busy`."""
    return _cpu_ticks(), time.process_time(), time.perf_counter()


def others_busy(since: tuple) -> float | None:
    """How many of this process's CPUs (its affinity mask) other processes kept busy since the :func:`load_snapshot`
    ``since``: their busy time (``/proc/stat``, in clock ticks) less this process's own, in CPUs. None where
    ``/proc/stat`` is missing or no tick has passed."""
    (a, own0, t0), (b, own1, t1) = since, load_snapshot()
    if a is None or b is None or b[1] <= a[1]:
        return None
    busy = b[2] * (b[0] - a[0]) / (b[1] - a[1])
    return max(0.0, busy - (own1 - own0) / max(t1 - t0, 1e-9))


def busy_cpus(seconds: float = 0.1) -> float | None:
    """How many CPUs other processes keep busy: :func:`others_busy` over ``seconds`` from now. None where
    ``/proc/stat`` is missing."""
    since = load_snapshot()
    time.sleep(seconds)
    return others_busy(since)


def default_threads(cpus: float, busy: float | None, *, waits_sleep: bool) -> tuple[int, str]:
    """The thread count that fits the machine, and why.

    With threads that spin at barriers (``waits_sleep`` False: OpenMP's default), the usable ``cpus`` less those
    that other processes keep busy (``busy``, in CPUs; rounded: a neighbour that takes 0.6 of a CPU counts as
    one), at least 1: a spinning thread holds the core that the thread every region waits for needs, and two
    threads beside a busy neighbour run many times slower than one. With threads that sleep at barriers
    (``OMP_WAIT_POLICY=PASSIVE``) every usable CPU: a thread that waits frees its core, and the extra threads
    win a share of busy cores too.
    """
    usable = max(1, math.floor(cpus))
    if busy is None:
        return usable, f"{usable} usable CPUs (their load is unknown)"
    why = f"{usable} usable CPUs, {busy:.1f} kept busy by other processes"
    if waits_sleep:
        return usable, why + "; waits sleep"
    return usable - min(usable - 1, int(math.floor(busy + 0.5))), why + "; waits spin: busy CPUs left to them"


def choose_threads(given: int | None = None) -> tuple[int, str]:
    """The ``sublayer`` command's thread count and why: ``given`` (a ``--threads`` flag), else
    ``SUBLAYER_THREADS``, else :func:`default_threads` of this machine now (which samples its load for 0.1 s;
    waits sleep where ``OMP_WAIT_POLICY`` is passive, as the command sets it).

    Raises:
        ValueError: ``SUBLAYER_THREADS`` is neither auto nor a count >= 1.
    """
    if given is not None:
        return given, "--threads"
    if (n := settings.threads()) is not None:
        return n, "SUBLAYER_THREADS"
    sleep = os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"
    return default_threads(usable_cpus(), busy_cpus(), waits_sleep=sleep)


def describe() -> dict[str, str]:
    """``sublayer info``'s rows about the CPU's vector units."""
    if not _cpuinfo()[2]:
        return {}
    yes = {True: "yes", False: "no"}
    isa = {"isa": "avx2 (SUBLAYER_ISA: AVX-512 and AMX not used)"} if settings.isa() == "avx2" else {}
    return isa | {"avx512": yes[has("avx512f")], "amx-bf16": yes[has("amx_bf16")], "avx512-bf16": yes[has("avx512_bf16")]}
