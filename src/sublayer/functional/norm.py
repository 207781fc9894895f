"""Normalisation: the one reference of LayerNorm, RMSNorm and Add & Norm.

Statistics are always computed in float32 (or float64 for float64 inputs) and the variance is two-pass
(``mean((x - mean)**2)``), never ``E[x²] - E[x]²``, which cancels catastrophically for large means.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import (
    check_choice,
    check_last_dims,
    check_param_shape,
    check_probability,
    check_same_shape,
    normalize_shape,
)

__all__ = ["layer_norm", "rms_norm", "add_norm", "acc_dtype", "NORMS"]

NORMS = ("layer", "rms")


def acc_dtype(*ts: Tensor | None) -> torch.dtype:
    """The dtype that statistics, sums and products are accumulated in: float64 if any of ``ts`` is float64, else
    float32 (half and bfloat16 upcast)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _checked(x: Tensor, normalized_shape: int | Sequence[int], **params: Tensor | None) -> tuple[tuple, Tensor]:
    """The dims to normalise over and ``x`` in the statistics' dtype (half/bfloat16 in float32, float64 stays), once
    ``x``'s trailing dims and the parameters' shapes are checked against ``normalized_shape``."""
    shape = normalize_shape("normalized_shape", normalized_shape)
    check_last_dims("x", x, shape)
    if not x.is_floating_point():  # else the statistics run in float32 and the result is cast back to x's dtype
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    for name, t in params.items():
        check_param_shape(name, t, shape)
    return tuple(range(-len(shape), 0)), x.to(acc_dtype(x))


def layer_norm(
    x: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Layer normalisation over the trailing ``normalized_shape`` dims, equal to ``F.layer_norm``.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the biased (population) variance.

    Args:
        x: (..., *normalized_shape).
        normalized_shape: the trailing dims to normalise over.
        weight, bias: (*normalized_shape) or None.
        eps: added to the variance inside the square root.

    Returns:
        Tensor of the shape and dtype of ``x``.

    Raises:
        ValueError: if the trailing dims of ``x`` (or the shape of ``weight``/``bias``) differ from
            ``normalized_shape``.
        TypeError: ``x`` not floating-point.
    """
    dims, xf = _checked(x, normalized_shape, weight=weight, bias=bias)
    mean = xf.mean(dim=dims, keepdim=True)
    xc = xf - mean
    var = (xc * xc).mean(dim=dims, keepdim=True)  # two-pass variance
    y = xc * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def rms_norm(
    x: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Root-mean-square normalisation, equal to ``F.rms_norm`` (same eps) and HF ``LlamaRMSNorm``.

    ``y = x / sqrt(mean(x**2) + eps) * weight``, computed in float32 for half inputs.

    Args:
        x: (..., *normalized_shape).
        normalized_shape: the trailing dims to normalise over.
        weight: (*normalized_shape) or None.
        eps: added to the mean square (explicit: unlike ``nn.RMSNorm(eps=None)`` there is no dtype-eps default).

    Returns:
        Tensor of the shape and dtype of ``x``.

    Raises:
        ValueError: if the trailing dims of ``x`` (or the shape of ``weight``) differ from ``normalized_shape``.
        TypeError: ``x`` not floating-point.
    """
    dims, xf = _checked(x, normalized_shape, weight=weight)
    y = xf * torch.rsqrt((xf * xf).mean(dim=dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def add_norm(
    x: Tensor,
    y: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    dropout: float = 0.0,
    training: bool = True,
    norm: str = "layer",
) -> Tensor:
    """Post-norm Add & Norm: ``norm(x + dropout(y))`` (the Transformer's, BERT's and d2l's).

    Args:
        x: residual input (..., *normalized_shape).
        y: sub-layer output, same shape as ``x``.
        normalized_shape, weight, bias, eps: as in :func:`layer_norm` (``bias`` is ignored for ``norm="rms"``).
        dropout: probability applied to ``y`` when ``training``.
        norm: ``"layer"`` or ``"rms"``.

    Returns:
        Tensor of the shape of ``x``.

    Raises:
        ValueError: on shape mismatch between ``x`` and ``y``, a bad ``dropout`` or an unknown ``norm``.
    """
    check_choice("norm", norm, NORMS)
    check_probability("dropout", dropout)
    check_same_shape("x", x, "y", y)
    s = x + F.dropout(y, dropout, training)
    if norm == "layer":
        return layer_norm(s, normalized_shape, weight, bias, eps)
    return rms_norm(s, normalized_shape, weight, eps)
