"""torch's oneDNN float32 linear on CPU, the one place that calls it: ``torch.ops.mkldnn._reorder_linear_weight``
packs a weight once, ``torch.ops.mkldnn._linear_pointwise`` multiplies with it (an internal op of torch's, checked by
:func:`available` before any use). Where it is faster than torch's default GEMM is the callers' decision
(:func:`sublayer.kernels.cpu.onednn_fp32_gemm` for the fused FFN)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["available", "pack", "linear"]


@functools.cache
def available() -> bool:
    """Whether torch is built with oneDNN and has the linear ops this module calls."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(w: Tensor) -> Tensor:
    """``w`` (N, K) float32 reordered into oneDNN's blocked layout, for :func:`linear` (call :func:`available` first)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def linear(x: Tensor, w: Tensor, b: Tensor | None = None, *, gelu: bool = False) -> Tensor:
    """``x @ w.T + b`` (erf GELU applied when ``gelu``), a new (M, N) tensor; ``x`` (M, K) row-major, ``w`` (N, K)
    as is or :func:`pack` ed."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu" if gelu else "none", [], "none" if gelu else "")
