"""The position-wise feed-forward network: the one reference of its math."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from .._checks import check_choice, check_input_weight, check_probability, check_tensor

__all__ = ["feed_forward", "activation_fn", "activate", "ACTIVATIONS", "GATED_ACTIVATIONS"]


def _relu2(x: Tensor) -> Tensor:
    return F.relu(x).square()


def _gelu_tanh(x: Tensor) -> Tensor:
    # GPT-2's gelu_new. Never hand-write the tanh formula: it gives NaN gradients in fp16 near x≈300.
    return F.gelu(x, approximate="tanh")


# name -> elementwise activation; a gated name maps to the activation applied to its gate.
_ELEMENTWISE: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": F.silu,
    "relu2": _relu2,
}
_GATES: dict[str, str] = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}

ACTIVATIONS: tuple[str, ...] = tuple(_ELEMENTWISE) + tuple(_GATES)
GATED_ACTIVATIONS: tuple[str, ...] = tuple(_GATES)


def activation_fn(name: str) -> Callable[[Tensor], Tensor]:
    """The elementwise function behind an activation name (for a gated name: the gate's activation).

    Raises:
        ValueError: for a name not in :data:`ACTIVATIONS`, listing the choices.
    """
    check_choice("activation", name, ACTIVATIONS)
    return _ELEMENTWISE[_GATES.get(name, name)]


def activate(h: Tensor, activation: str) -> Tensor:
    """``act(h)``, or for a gated activation ``act(gate) * up`` of ``h`` packed [gate; up] along its last dim."""
    if activation not in _GATES:
        return activation_fn(activation)(h)
    gate, up = h.chunk(2, dim=-1)
    return activation_fn(activation)(gate) * up


def feed_forward(
    x: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    *,
    activation: str = "relu",
    dropout: float = 0.0,
    output_dropout: float = 0.0,
    training: bool = True,
) -> Tensor:
    """``fc2(dropout(act(fc1(x))))``, then ``output_dropout`` — position-wise, on the last dim.

    For a gated activation (``swiglu``, ``geglu``, ``reglu``) ``fc1`` packs gate and up projections along its
    output dim, gate first: ``h = act(x @ W_gate.T) * (x @ W_up.T)`` (HF ``LlamaMLP`` order).

    Args:
        x: (..., d_model).
        fc1_weight: (d_ff, d_model), or (2·d_ff, d_model) packed [gate; up] for a gated activation.
        fc1_bias: (d_ff,) / (2·d_ff,) or None.
        fc2_weight: (d_out, d_ff).
        fc2_bias: (d_out,) or None.
        activation: one of :data:`ACTIVATIONS`.
        dropout: on the hidden activation (the tutorials' placement), when ``training``.
        output_dropout: on the output (GPT-2's placement), when ``training``.

    Returns:
        (..., d_out).

    Raises:
        ValueError: unknown activation, bad dropout, or ``x``'s last dim not equal to fc1's input size.
    """
    activation_fn(activation)  # validates the name first
    check_probability("dropout", dropout)
    check_probability("output_dropout", output_dropout)
    check_tensor("x", x)
    if x.dim() == 0 or x.shape[-1] != fc1_weight.shape[-1]:
        raise ValueError(f"x must have last dim d_model={fc1_weight.shape[-1]}, got shape {tuple(x.shape)}")
    check_input_weight("x", x, "fc1_weight", fc1_weight)
    h = activate(F.linear(x, fc1_weight, fc1_bias), activation)
    h = F.dropout(h, dropout, training)
    out = F.linear(h, fc2_weight, fc2_bias)
    return F.dropout(out, output_dropout, training)
