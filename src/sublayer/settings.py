"""Every ``SUBLAYER_*`` environment variable, read here and nowhere else (:data:`VARIABLES` lists them with
their values and defaults; one typed accessor each).

Each accessor reads the environment when it is called (``environ=`` reads a mapping instead, for tests). An empty
or unset variable means its default; any other value outside its list is a ``ValueError`` naming the variable, its
value and the accepted ones. This module imports nothing from sublayer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

__all__ = [
    "VARIABLES",
    "kernels_enabled",
    "kernels_cache_root",
    "kernels_lock_timeout",
    "kernels_verbose",
    "bf16_gemm",
    "int8_engine",
    "decoding_enabled",
    "buffer_cache_mb",
    "fit_threads",
    "threads",
    "wait_policy",
    "apply_wait_policy",
    "wait_policy_effect",
    "isa",
    "ISA_CAPS",
    "apply_isa",
    "command_line_process",
]

#: name -> its values, default and effect
VARIABLES: dict[str, str] = {
    "SUBLAYER_KERNELS": "1/0: the fused C++ kernels on (default) or off (every module runs the pure-PyTorch reference "
    "path; the extension is never built); read once, at the first use of the kernels",
    "SUBLAYER_KERNELS_CACHE": "folder of the compiled kernels (default ~/.cache/sublayer/kernels)",
    "SUBLAYER_KERNELS_LOCK_TIMEOUT": "seconds to wait for another process compiling the kernels (default 600)",
    "SUBLAYER_KERNELS_VERBOSE": "1/0: print torch's build commands (default 0)",
    "SUBLAYER_BF16_GEMM": "native/fp32: how bf16 GEMMs run (default: detected from the CPU's flags)",
    "SUBLAYER_INT8_ENGINE": "fbgemm/onednn: the int8 GEMMs' quantized engine (default: detected)",
    "SUBLAYER_DECODING": "1/0: generate/translate use the fast decoding loops (default) or the reference loops; read "
    "once, at the first generate/translate",
    "SUBLAYER_BUFFER_CACHE_MB": "MiB of freed big buffers the fused Add & Norm keeps for reuse (default 256, 0: off); "
    "applied when the kernels load",
    "SUBLAYER_FIT_THREADS": "1/0: generate/translate run on torch's threads less the CPUs other processes kept "
    "busy during the previous call (default) or on torch's threads as set",
    "SUBLAYER_THREADS": "auto or a count: torch threads of the sublayer command (default auto: the usable CPUs, "
    "less those other processes keep busy where OpenMP threads spin; a command's --threads wins)",
    "SUBLAYER_WAIT_POLICY": "passive/openmp: how idle OpenMP threads of the sublayer command wait (default passive: "
    "they sleep at once, so a busy neighbour process cannot stall every parallel region; openmp: OpenMP's own "
    "spin-then-sleep); applied only before torch is imported and only when neither OMP_WAIT_POLICY nor "
    "GOMP_SPINCOUNT is set",
    "SUBLAYER_ISA": "native/avx2: the vector instructions sublayer uses (default native: what the CPU has; avx2: "
    "behave as on an AVX2 + FMA CPU — the kernels compile for x86-64-v3 and take their AVX2 paths, the CPU-feature "
    "reader reports no AVX-512, AMX or AVX-VNNI, and torch's, oneDNN's, MKL's and CTranslate2's own kernels are "
    "capped to AVX2 when sublayer is imported before torch); x86 only",
}

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _raw(name: str, environ: Mapping[str, str] | None) -> str:
    return (os.environ if environ is None else environ).get(name, "").strip()


def _flag(name: str, default: bool, environ: Mapping[str, str] | None) -> bool:
    v = _raw(name, environ).lower()
    if not v:
        return default
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ValueError(f"{name}={v!r} is not a switch: use one of {', '.join(_TRUE + _FALSE)}")


def _choice(name: str, choices: tuple[str, ...], environ: Mapping[str, str] | None) -> str | None:
    v = _raw(name, environ).lower()
    if not v:
        return None
    if v not in choices:
        raise ValueError(f"{name}={v!r} is not one of {', '.join(choices)}")
    return v


def _number(name: str, default: float | None, environ: Mapping[str, str] | None, *, positive: bool) -> float | None:
    v = _raw(name, environ)
    if not v:
        return default
    try:
        x = float(v)
    except ValueError:
        x = float("nan")
    if not (x > 0 if positive else x >= 0):
        raise ValueError(f"{name}={v!r} must be a number {'> 0' if positive else '>= 0'}")
    return x


def kernels_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``SUBLAYER_KERNELS``: whether the fused C++ kernels may be used (default True)."""
    return _flag("SUBLAYER_KERNELS", True, environ)


def kernels_cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """``SUBLAYER_KERNELS_CACHE``: the root folder of the kernels' build cache (default ``~/.cache/sublayer/kernels``)."""
    v = _raw("SUBLAYER_KERNELS_CACHE", environ)
    return Path(v) if v else Path.home() / ".cache" / "sublayer" / "kernels"


def kernels_lock_timeout(environ: Mapping[str, str] | None = None) -> float:
    """``SUBLAYER_KERNELS_LOCK_TIMEOUT``: seconds to wait for another process's build (default 600)."""
    return _number("SUBLAYER_KERNELS_LOCK_TIMEOUT", 600.0, environ, positive=True)


def kernels_verbose(environ: Mapping[str, str] | None = None) -> bool:
    """``SUBLAYER_KERNELS_VERBOSE``: whether torch's build prints its commands (default False)."""
    return _flag("SUBLAYER_KERNELS_VERBOSE", False, environ)


def bf16_gemm(environ: Mapping[str, str] | None = None) -> str | None:
    """``SUBLAYER_BF16_GEMM``: ``"native"`` or ``"fp32"`` when forced, None to detect from the CPU."""
    return _choice("SUBLAYER_BF16_GEMM", ("native", "fp32"), environ)


def int8_engine(environ: Mapping[str, str] | None = None) -> str | None:
    """``SUBLAYER_INT8_ENGINE``: ``"fbgemm"`` or ``"onednn"`` when forced, None to detect from the CPU."""
    return _choice("SUBLAYER_INT8_ENGINE", ("fbgemm", "onednn"), environ)


def decoding_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``SUBLAYER_DECODING``: whether generation uses the fast decoding loops (default True)."""
    return _flag("SUBLAYER_DECODING", True, environ)


def buffer_cache_mb(environ: Mapping[str, str] | None = None) -> float | None:
    """``SUBLAYER_BUFFER_CACHE_MB``: the fused Add & Norm's buffer cache limit in MiB (0: off); None when unset
    (the kernels' own default, 256)."""
    return _number("SUBLAYER_BUFFER_CACHE_MB", None, environ, positive=False)


def fit_threads(environ: Mapping[str, str] | None = None) -> bool:
    """``SUBLAYER_FIT_THREADS``: whether decoding leaves CPUs that other processes keep busy to them (default
    True; :func:`sublayer.runtime.generation.fitted_threads`)."""
    return _flag("SUBLAYER_FIT_THREADS", True, environ)


def threads(environ: Mapping[str, str] | None = None) -> int | None:
    """``SUBLAYER_THREADS``: a thread count, or None for ``auto`` (unset, empty or ``auto``)."""
    v = _raw("SUBLAYER_THREADS", environ)
    if not v or v.lower() == "auto":
        return None
    if not (v.isascii() and v.isdigit() and int(v) >= 1):
        raise ValueError(f"SUBLAYER_THREADS={v!r} must be auto or an integer >= 1")
    return int(v)


def wait_policy(environ: Mapping[str, str] | None = None) -> str:
    """``SUBLAYER_WAIT_POLICY``: ``"passive"`` (default) or ``"openmp"``."""
    return _choice("SUBLAYER_WAIT_POLICY", ("passive", "openmp"), environ) or "passive"


def apply_wait_policy(environ: MutableMapping[str, str] | None = None, *, torch_loaded: bool | None = None) -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` (default ``os.environ``) per :func:`wait_policy`, where it
    can still take effect: OpenMP reads it once, when torch's import loads it (``torch_loaded``: whether that
    happened; default: whether ``torch`` is in ``sys.modules``). A user's ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` is left as it is.

    Returns:
        What the process's OpenMP waits with, for ``sublayer info``.

    Raises:
        ValueError: ``SUBLAYER_WAIT_POLICY`` is not passive or openmp.
    """
    env = os.environ if environ is None else environ
    policy, effect = wait_policy(env), _user_wait(env)  # the user's variables win
    if effect is None:
        if policy == "openmp":
            effect = "OpenMP's default (SUBLAYER_WAIT_POLICY=openmp)"
        elif "torch" in sys.modules if torch_loaded is None else torch_loaded:
            effect = "OpenMP's default (torch was imported before sublayer)"
        else:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
            effect = "OMP_WAIT_POLICY=PASSIVE (sublayer's default: idle threads sleep at once)"
    if environ is None:
        _applied["effect"] = effect
    return effect


_applied: dict[str, str | None] = {"effect": None}


def _user_wait(env: Mapping[str, str]) -> str | None:
    """The user's ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` (the first set), as ``sublayer info`` shows it."""
    name = next((n for n in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if env.get(n, "").strip()), None)
    return None if name is None else f"{name}={env[name].strip()} (set by the user)"


def wait_policy_effect() -> str:
    """What this process's OpenMP waits with: what :func:`apply_wait_policy` did, else the user's variables or
    OpenMP's default."""
    return _applied["effect"] or _user_wait(os.environ) or "OpenMP's default (spin, then sleep)"


def isa(environ: Mapping[str, str] | None = None) -> str:
    """``SUBLAYER_ISA``: ``"native"`` (default) or ``"avx2"``."""
    return _choice("SUBLAYER_ISA", ("native", "avx2"), environ) or "native"


#: what ``SUBLAYER_ISA=avx2`` sets for the libraries below sublayer (each read once, when the library starts)
ISA_CAPS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorized kernels
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's GEMMs and convolutions
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL's BLAS
    "CT2_FORCE_CPU_ISA": "AVX2",  # CTranslate2 (a benchmark peer)
}


def apply_isa(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Under ``SUBLAYER_ISA=avx2``, set :data:`ISA_CAPS` in ``environ`` (default ``os.environ``) where the user has
    not set them; they take effect in libraries not yet started (import sublayer before torch, or set them before
    Python starts). Under ``native`` nothing changes.

    Returns:
        The variables it set.

    Raises:
        ValueError: ``SUBLAYER_ISA`` is not native or avx2.
    """
    env = os.environ if environ is None else environ
    if isa(env) != "avx2":
        return {}
    set_now = {k: v for k, v in ISA_CAPS.items() if not env.get(k, "").strip()}
    env.update(set_now)
    return set_now


def command_line_process(argv: list[str] | None = None) -> bool:
    """Whether this process runs the ``sublayer`` command: its console script, or ``python -m sublayer.cli``.

    Args:
        argv: the interpreter's own command line (default ``sys.orig_argv``: ``[python, options..., script or
            -m module, args...]``).
    """
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    skip = False
    for i, a in enumerate(argv[1:], 1):
        if skip or a in ("-X", "-W"):  # options with a value
            skip = not skip
            continue
        if a == "-m":
            return argv[i + 1 : i + 2] == ["sublayer.cli"]
        if a.startswith("-m"):
            return a == "-msublayer.cli"
        if a == "-c" or a == "-":
            return False
        if not a.startswith("-"):
            return Path(a).stem == "sublayer"
    return False
