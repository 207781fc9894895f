"""The CPU's features, read once per process: ``/proc/cpuinfo``'s flags on Linux (``flags`` on x86, ``Features`` on
Arm); elsewhere none are known and the decisions below take their portable default.

Every choice that depends on the CPU is made here: the kernels' cache key (:func:`tag`), whether bf16 GEMMs run
natively (:func:`native_bf16_gemm`), which engine the int8 GEMMs use (:func:`int8_engine`), and the lines
``sublayer info`` prints (:func:`describe`).
"""

from __future__ import annotations

import functools
import hashlib
import platform
from collections.abc import Iterable
from pathlib import Path

from .. import settings

__all__ = ["cpuinfo_text", "flags", "has", "model", "is_x86", "tag", "native_bf16_gemm", "int8_engine", "describe"]


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
    return frozenset((found.get("flags") or found.get("Features", "")).split()), found.get("model name", ""), True


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


def int8_engine(supported: Iterable[str]) -> str:
    """The quantized engine for the int8 GEMMs among ``supported`` (``torch.backends.quantized.supported_engines``):
    ``"onednn"`` on CPUs with AMX-INT8 or AVX512-VNNI (oneDNN uses them, fbgemm does not), ``"fbgemm"`` elsewhere
    (AVX2). ``SUBLAYER_INT8_ENGINE=fbgemm|onednn`` overrides when that engine is supported."""
    supported = list(supported)
    force = settings.int8_engine()
    if force in supported:
        return force
    return "onednn" if has("amx_int8", "avx512_vnni") and "onednn" in supported else "fbgemm"


def describe() -> dict[str, str]:
    """``sublayer info``'s rows about the CPU's vector units."""
    if not _cpuinfo()[2]:
        return {}
    yes = {True: "yes", False: "no"}
    return {"avx512": yes[has("avx512f")], "amx-bf16": yes[has("amx_bf16")], "avx512-bf16": yes[has("avx512_bf16")]}
