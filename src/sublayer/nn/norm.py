"""LayerNorm and RMSNorm modules (our own implementations, equal to ``nn.LayerNorm`` / ``nn.RMSNorm``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as SF
from .._checks import check_choice, check_eps, check_last_dims, normalize_shape

__all__ = ["LayerNorm", "RMSNorm", "make_norm"]


class _Norm(nn.Module):
    """What LayerNorm and RMSNorm share: the trailing shape, eps and the affine ``weight`` (ones) and, for
    LayerNorm (``bias`` not None), ``bias`` (zeros)."""

    def __init__(self, normalized_shape, eps, elementwise_affine, bias, device, dtype) -> None:
        super().__init__()
        self.normalized_shape = normalize_shape("normalized_shape", normalized_shape)
        check_eps("eps", eps)
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine

        def param(wanted: bool) -> nn.Parameter | None:  # values: reset_parameters
            return nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype)) if wanted else None

        self.register_parameter("weight", param(elementwise_affine))
        if bias is not None:  # LayerNorm's
            self.register_parameter("bias", param(elementwise_affine and bias))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if getattr(self, "bias", None) is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class LayerNorm(_Norm):
    """Layer normalisation over the trailing ``normalized_shape`` dims; same numbers as ``nn.LayerNorm``.

    Statistics in float32 for half inputs. A float32 or float64 input with parameters of its dtype runs torch's own
    ``F.layer_norm`` (one kernel forward and backward, stable statistics); other dtypes run
    :func:`sublayer.functional.layer_norm` (two-pass variance).

    Args:
        normalized_shape: int or tuple — the trailing dims of the input.
        eps: added to the variance.
        elementwise_affine: learn ``weight`` (ones) and, if ``bias``, ``bias`` (zeros).
        bias: learn a bias (``nn.LayerNorm(bias=False)`` equivalent).

    Shape:
        input (..., *normalized_shape) -> output of the same shape.

    Raises:
        ValueError: non-positive sizes or eps; at call time, trailing dims ≠ ``normalized_shape``.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        *,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        # torch's one-kernel LayerNorm (forward and backward) where it gives SF.layer_norm's numbers and dtype: float32
        # or float64 input with parameters of its dtype (autocast leaves both dtypes as they are)
        dt = x.dtype
        if dt in (torch.float32, torch.float64) and all(t is None or t.dtype == dt for t in (self.weight, self.bias)):
            check_last_dims("x", x, self.normalized_shape)
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return SF.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(_Norm):
    """Root-mean-square normalisation; same numbers as ``nn.RMSNorm`` (same eps) and HF ``LlamaRMSNorm``.

    Args:
        normalized_shape: int or tuple — the trailing dims of the input.
        eps: added to the mean square (1e-6, HF's default; explicit, never the dtype's epsilon).
        elementwise_affine: learn ``weight`` (ones).

    Shape:
        input (..., *normalized_shape) -> output of the same shape.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-6,
        *,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, None, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return SF.rms_norm(x, self.normalized_shape, self.weight, self.eps)


def make_norm(
    norm: str,
    normalized_shape: int | Sequence[int],
    eps: float | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> LayerNorm | RMSNorm:
    """``"layer"`` -> :class:`LayerNorm` (eps 1e-5), ``"rms"`` -> :class:`RMSNorm` (eps 1e-6) when ``eps`` is None."""
    check_choice("norm", norm, SF.NORMS)
    if norm == "layer":
        return LayerNorm(normalized_shape, 1e-5 if eps is None else eps, device=device, dtype=dtype)
    return RMSNorm(normalized_shape, 1e-6 if eps is None else eps, device=device, dtype=dtype)
