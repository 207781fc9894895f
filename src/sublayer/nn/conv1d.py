"""GPT-2's Conv1D: a linear layer whose weight is stored (in, out)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._checks import check_input_weight, check_positive_int, check_tensor

__all__ = ["Conv1D"]


class Conv1D(nn.Module):
    """HF/GPT-2 ``Conv1D(nf, nx)``: ``y = x @ weight + bias`` with ``weight`` of shape (nx, nf) = (in, out).

    The transpose of ``nn.Linear``'s layout; kept so GPT-2 checkpoints load without copies.

    Args:
        nf: output features. nx: input features.

    Shape:
        input (..., nx) -> output (..., nf).
    """

    def __init__(
        self,
        nf: int,
        nx: int,
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("nf", nf)
        check_positive_int("nx", nx)
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(nf, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)  # GPT-2's initializer_range
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        check_tensor("x", x)
        check_input_weight("x", x, "weight", self.weight)  # (autocast casts addmm's operands itself)
        if x.dim() == 0 or x.shape[-1] != self.nx:
            raise ValueError(f"x must have last dim nx={self.nx}, got shape {tuple(x.shape)}")
        flat = x.reshape(-1, self.nx)
        y = torch.addmm(self.bias, flat, self.weight) if self.bias is not None else flat @ self.weight
        return y.view(*x.shape[:-1], self.nf)

    def to_linear(self) -> nn.Linear:
        """An exact ``nn.Linear(nx, nf)`` copy (weight transposed)."""
        w = self.weight
        lin = nn.Linear(self.nx, self.nf, bias=self.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w.t())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Conv1D:
        """An exact Conv1D copy of ``linear`` (weight transposed)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        conv = cls(linear.out_features, linear.in_features, bias=linear.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            conv.weight.copy_(w.t())
            if linear.bias is not None:
                conv.bias.copy_(linear.bias)
        return conv

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}"
