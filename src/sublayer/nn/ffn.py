"""The position-wise feed-forward network module."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as SF
from ..functional import fused
from ..functional.ffn import activate
from .._checks import check_choice, check_positive_int, check_probability, check_tensor
from .hooks import hooked

__all__ = ["PositionWiseFFN"]


class PositionWiseFFN(nn.Module):
    """Position-wise feed-forward network: ``fc2(dropout(act(fc1(x))))`` applied to every position alike.

    Args:
        d_model: input size, or None to infer it at the first call (d2l 1.x style, ``nn.LazyLinear``).
        d_ff: hidden size; None -> 4·d_model (for a lazy FFN, None needs d_model, so give d_ff).
        d_out: output size; None -> d_model.
        activation: ``relu``, ``gelu`` (erf), ``gelu_tanh`` (GPT-2's gelu_new), ``silu``, ``relu2``, or gated
            ``swiglu``, ``geglu``, ``reglu`` (``fc1`` then packs gate and up projections: out 2·d_ff, gate first).
        dropout: on the hidden activation (the tutorials' placement).
        output_dropout: on the output (GPT-2's ``resid_pdrop`` placement).
        bias: biases on both linears.
        recompute: keep only the input for backward and run fc1 and the activation again there (one more GEMM,
            no hidden-size tensor saved; see :func:`sublayer.functional.fused.feed_forward`).

    Attributes:
        fc1: ``nn.Linear(d_model, d_ff)`` (gated: ``(d_model, 2·d_ff)``). fc2: ``nn.Linear(d_ff, d_out)``.

    Shape:
        input (..., d_model) -> output (..., d_out).

    Raises:
        ValueError: non-positive sizes, dropout outside [0, 1), unknown activation (listing the choices);
        at call time, an input whose last dim is not d_model.
        TypeError: ``recompute`` not a bool.
    """

    def __init__(
        self,
        d_model: int | None,
        d_ff: int | None = None,
        *,
        d_out: int | None = None,
        activation: str = "relu",
        dropout: float = 0.0,
        output_dropout: float = 0.0,
        bias: bool = True,
        recompute: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("d_model", d_model), ("d_ff", d_ff), ("d_out", d_out)):
            check_positive_int(name, v, allow_none=True)
        check_choice("activation", activation, SF.ACTIVATIONS)
        check_probability("dropout", dropout)
        check_probability("output_dropout", output_dropout)
        if not isinstance(recompute, bool):
            raise TypeError(f"recompute must be a bool, got {recompute!r}")
        if d_model is None and (d_ff is None or d_out is None):
            name = "d_ff" if d_ff is None else "d_out"
            raise ValueError(f"{name} must be given when d_model is None (lazy input size), got {name}=None")
        d_ff = 4 * d_model if d_ff is None else d_ff
        d_out = d_model if d_out is None else d_out
        self.d_model, self.d_ff, self.d_out = d_model, d_ff, d_out
        self.activation = activation
        self.dropout = float(dropout)
        self.output_dropout = float(output_dropout)
        self.recompute = recompute
        kw = {"device": device, "dtype": dtype}
        hidden = 2 * d_ff if activation in SF.GATED_ACTIVATIONS else d_ff
        self.fc1 = nn.Linear(d_model, hidden, bias=bias, **kw) if d_model else nn.LazyLinear(hidden, bias=bias, **kw)
        self.fc2 = nn.Linear(d_ff, d_out, bias=bias, **kw)

    @property
    def gated(self) -> bool:
        return self.activation in SF.GATED_ACTIVATIONS

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.fc1, nn.LazyLinear):
            check_tensor("x", x)
            if x.dim() == 0:  # else LazyLinear fails deep inside torch (IndexError)
                raise ValueError(f"x must have a last dim (the input size), got shape {tuple(x.shape)}")
            self.fc1(x[..., :0, :] if x.dim() > 1 else x)  # materialise fc1 from the input size (cheap)
            self.d_model = self.fc1.in_features
        if hooked(self.fc1, self.fc2, backward=True):  # their own forwards, so that their hooks see the calls
            h = activate(self.fc1(x), self.activation)
            y = self.fc2(fused.dropout(h, self.dropout, self.training))
            return fused.dropout(y, self.output_dropout, self.training)
        # fused CPU kernel when it applies (sublayer.kernels), else the reference SF.feed_forward
        return fused.feed_forward(
            x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, activation=self.activation,
            dropout=self.dropout, output_dropout=self.output_dropout, training=self.training, recompute=self.recompute,
        )  # fmt: skip

    def extra_repr(self) -> str:
        s = f"activation={self.activation!r}, dropout={self.dropout}, output_dropout={self.output_dropout}"
        return s + (", recompute=True" if self.recompute else "")
