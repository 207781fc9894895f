"""torch's oneDNN float32 linear on CPU, the one place that calls it: ``torch.ops.mkldnn._reorder_linear_weight``
packs a weight once, ``torch.ops.mkldnn._linear_pointwise`` multiplies with it (an internal op of torch's, checked by
:func:`available` before any use). Where it is faster than torch's default GEMM is the callers' decision
(:func:`sublayer.kernels.use_onednn` for the fused loss and linear, :func:`sublayer.kernels.cpu.onednn_fp32_gemm` for
the fused FFN)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["available", "pack", "linear", "mm", "MIN_MACS"]

MIN_MACS = 1 << 24  # smaller products stay on torch's BLAS (oneDNN's per-call cost is not repaid)


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether torch is built with oneDNN and has the linear ops this module calls, for weights of ``dtype``
    (``torch.bfloat16``: only where torch runs oneDNN's bf16 path, AVX512BW/VL/DQ, AVX-NE-CONVERT or AMX; it
    refuses to pack a bf16 weight on an AVX2 CPU)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(w: Tensor) -> Tensor:
    """``w`` (N, K) float32 or bfloat16 reordered into oneDNN's blocked layout, for :func:`linear` (call
    :func:`available` with its dtype first)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def linear(x: Tensor, w: Tensor, b: Tensor | None = None, *, gelu: bool | str = False) -> Tensor:
    """``x @ w.T + b`` (then GELU: ``gelu=True`` erf, ``gelu="tanh"`` its tanh approximation), a new (M, N) tensor;
    ``x`` (M, K) row-major, ``w`` (N, K) as is or :func:`pack` ed, ``b`` (N,) or None (made contiguous: oneDNN reads
    a bias as a dense vector, whatever its strides)."""
    attr, algorithm = ("gelu", "none" if gelu is True else gelu) if gelu else ("none", "")
    return torch.ops.mkldnn._linear_pointwise(x, w, None if b is None else b.contiguous(), attr, [], algorithm)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``torch.mm(a, b)`` of float32 CPU matrices (M, K) @ (K, N): through oneDNN's linear (``a @ (b.T).T``, ``a``
    made row-major first: a weight gradient's transposed left operand is copied, O(MK) against the product's
    O(MKN)) when the product has :data:`MIN_MACS` multiply-adds or more, else ``torch.mm``; the same product up to
    the summation order. Where oneDNN is the faster is the callers' decision (call :func:`available` first)."""
    if a.shape[0] * a.shape[1] * b.shape[1] >= MIN_MACS:
        return linear(a.contiguous(), b.t())
    return torch.mm(a, b)
