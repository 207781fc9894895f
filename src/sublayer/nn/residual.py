"""Residual connections: post-norm Add & Norm, the plain residual, and the pre-norm residual."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..functional import fused
from .._checks import check_probability, normalize_shape
from .hooks import hooked
from .norm import make_norm

__all__ = ["AddNorm", "ResidualConnection", "PreNormResidual"]


class _Residual(nn.Module):
    """What the residuals share: ``dropout``, a probability, on the branch in training."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        check_probability("dropout", dropout)
        self.dropout = float(dropout)

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}"


class _NormResidual(_Residual):
    """What the residuals with a norm share: the norm (``norm``: ``"layer"`` or ``"rms"``) over the trailing
    ``normalized_shape`` dims, ``eps`` None -> the norm's default."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        dropout: float = 0.0,
        *,
        norm: str = "layer",
        eps: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dropout)
        self.normalized_shape = normalize_shape("normalized_shape", normalized_shape)
        self.norm_type = norm
        self.norm = make_norm(norm, self.normalized_shape, eps, device=device, dtype=dtype)


class AddNorm(_NormResidual):
    """Post-norm Add & Norm: ``norm(x + dropout(y))`` (the Transformer's, BERT's and d2l's).

    Args:
        normalized_shape: int or tuple — the trailing dims.
        dropout: on ``y`` in training.
        norm: ``"layer"`` (:class:`LayerNorm`) or ``"rms"`` (:class:`RMSNorm`).
        eps: the norm's eps; None -> 1e-5 (layer) / 1e-6 (rms).

    Attributes:
        norm: the normalisation module.

    Shape:
        x, y: (..., *normalized_shape), equal shapes -> output of the same shape.

    Raises:
        ValueError: bad sizes, dropout, norm name; at call time, x/y shape mismatch or wrong trailing dims.
    """

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        n = self.norm
        if hooked(n, backward=True):  # the norm's own forward, so that its hooks see the call
            return n(x + fused.dropout(y, self.dropout, self.training))
        # fused CPU kernel when it applies (sublayer.kernels), else the reference SF.add_norm
        return fused.add_norm(x, y, n.normalized_shape, n.weight, getattr(n, "bias", None), n.eps, dropout=self.dropout,
                              training=self.training, norm=self.norm_type)  # fmt: skip


class ResidualConnection(_Residual):
    """The plain residual: ``x + dropout(sublayer(x))``.

    Args:
        dropout: on the sub-layer's output in training (on the CPU, :func:`sublayer.functional.fused.dropout`:
            Philox masks, regenerated in backward).
        device, dtype: accepted like every module's factory kwargs; there are no parameters to place.

    Shape:
        x: (..., D); ``sublayer`` must keep the shape.
    """

    def __init__(
        self,
        dropout: float = 0.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dropout)

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return x + fused.dropout(sublayer(x), self.dropout, self.training)  # Philox dropout on the CPU


class PreNormResidual(_NormResidual):
    """Pre-norm residual: ``x + dropout(sublayer(norm(x)))`` (GPT-2, the Annotated Transformer).

    A stack of pre-norm blocks needs one final norm after the last block (see ``TransformerEncoder``).

    Args:
        normalized_shape: int or tuple — the trailing dims.
        dropout: on the sub-layer's output in training (on the CPU, :func:`sublayer.functional.fused.dropout`:
            Philox masks, regenerated in backward).
        norm: ``"layer"`` or ``"rms"``. eps: None -> the norm's default.

    Shape:
        x: (..., *normalized_shape); ``sublayer`` must keep the shape.
    """

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return x + fused.dropout(sublayer(self.norm(x)), self.dropout, self.training)  # Philox dropout on the CPU
