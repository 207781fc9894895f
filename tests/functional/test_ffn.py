"""sublayer.functional.feed_forward: the formula for every activation, gradcheck, dropout, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import sublayer.functional as SF

D, FF, OUT = 5, 7, 3
PLAIN = {
    "relu": F.relu,
    "gelu": lambda t: F.gelu(t, approximate="none"),
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
    "relu2": lambda t: F.relu(t) ** 2,
}
GATED = {"swiglu": F.silu, "geglu": lambda t: F.gelu(t, approximate="none"), "reglu": F.relu}


def _weights(activation: str, dtype=torch.float64, requires_grad=False):
    hidden = 2 * FF if activation in GATED else FF
    ws = [torch.randn(hidden, D), torch.randn(hidden), torch.randn(OUT, FF), torch.randn(OUT)]
    return [w.to(dtype).requires_grad_(requires_grad) for w in ws]


def _formula(x, w1, b1, w2, b2, activation):
    """Written out independently of the implementation (gated: gate rows first, then up rows)."""
    if activation in GATED:
        gate = x @ w1[:FF].T + b1[:FF]
        up = x @ w1[FF:].T + b1[FF:]
        h = GATED[activation](gate) * up
    else:
        h = PLAIN[activation](x @ w1.T + b1)
    return h @ w2.T + b2


def test_activation_names():
    assert set(SF.ACTIVATIONS) == set(PLAIN) | set(GATED)
    assert set(SF.GATED_ACTIVATIONS) == set(GATED)


@pytest.mark.parametrize("activation", list(PLAIN) + list(GATED))
def test_feed_forward_matches_formula(activation):
    x = torch.randn(2, 3, D, dtype=torch.float64)
    w = _weights(activation)
    assert_close(SF.feed_forward(x, *w, activation=activation), _formula(x, *w, activation))


def test_feed_forward_without_bias():
    x = torch.randn(2, 3, D)
    w1, _, w2, _ = _weights("relu", torch.float32)
    assert_close(SF.feed_forward(x, w1, None, w2, None), F.relu(x @ w1.T) @ w2.T)


@pytest.mark.parametrize("activation", list(PLAIN) + list(GATED))
def test_gradcheck_feed_forward(activation):
    x = torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)
    w = _weights(activation, requires_grad=True)
    # relu/relu2/reglu have a kink at 0; random normal pre-activations are never within gradcheck's 1e-6 of it.
    fn = lambda x, *w: SF.feed_forward(x, *w, activation=activation)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, *w))


def test_activation_fn_maps_gates():
    t = torch.randn(11)
    assert_close(SF.activation_fn("gelu_tanh")(t), F.gelu(t, approximate="tanh"))
    assert_close(SF.activation_fn("relu2")(t), F.relu(t).square())
    assert_close(SF.activation_fn("swiglu")(t), F.silu(t))
    assert_close(SF.activation_fn("geglu")(t), F.gelu(t))
    assert_close(SF.activation_fn("reglu")(t), F.relu(t))


def test_gelu_tanh_has_finite_half_gradients_at_300():
    # A hand-written tanh-GELU gives NaN gradients in fp16 near x≈300 (REFERENCE pitfalls).
    t = torch.full((4,), 300.0, dtype=torch.float16, requires_grad=True)
    SF.activation_fn("gelu_tanh")(t).sum().backward()
    assert torch.isfinite(t.grad).all()


# --------------------------------------------------------------------------------------------------------------
# dropout
# --------------------------------------------------------------------------------------------------------------
def _identity_ffn(n: int):
    """fc1 = I with bias +1 (so relu(x + 1) > 0 for x ≥ 0), fc2 = I: the output is dropout(x + 1) exactly."""
    eye = torch.eye(n)
    return eye, torch.ones(n), eye, torch.zeros(n)


@pytest.mark.parametrize("where", ["dropout", "output_dropout"])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate_and_scale(where, p):
    n, rows = 16, 1250  # 20000 elements
    x = torch.rand(rows, n)
    out = SF.feed_forward(x, *_identity_ffn(n), **{where: p}, training=True)
    kept = out != 0
    rate = kept.float().mean().item()
    # 20000 Bernoulli(1-p) draws: 5 standard deviations is a false-alarm rate < 1e-6.
    assert abs(rate - (1 - p)) < 5 * (p * (1 - p) / kept.numel()) ** 0.5
    assert_close(out[kept], (x + 1)[kept] / (1 - p))


def test_dropout_zero_and_eval_are_exact_identity():
    x = torch.randn(4, D)
    w = _weights("gelu", torch.float32)
    ref = SF.feed_forward(x, *w, activation="gelu", training=False)
    assert torch.equal(SF.feed_forward(x, *w, activation="gelu", dropout=0.0, output_dropout=0.0), ref)
    assert torch.equal(SF.feed_forward(x, *w, activation="gelu", dropout=0.5, output_dropout=0.3, training=False), ref)


def test_dropout_same_seed_same_mask():
    x = torch.rand(8, 16)
    torch.manual_seed(3)
    a = SF.feed_forward(x, *_identity_ffn(16), dropout=0.5, training=True)
    torch.manual_seed(3)
    b = SF.feed_forward(x, *_identity_ffn(16), dropout=0.5, training=True)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------------------------------
@given(batch=st.integers(1, 6), row=st.integers(0, 5), activation=st.sampled_from(sorted(PLAIN) + sorted(GATED)))
def test_batch_row_equals_row_alone(batch, row, activation):
    row %= batch
    x = torch.randn(batch, 3, D, dtype=torch.float64)
    w = _weights(activation)
    full = SF.feed_forward(x, *w, activation=activation)
    assert_close(full[row], SF.feed_forward(x[row], *w, activation=activation))


def test_position_wise():
    # Equal rows in, equal rows out: the same map at every position.
    x = torch.randn(1, 1, D).expand(2, 7, D)
    out = SF.feed_forward(x, *_weights("silu", torch.float32), activation="silu")
    assert_close(out, out[:1, :1].expand_as(out))


# --------------------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------------------
def test_unknown_activation_lists_choices():
    w = _weights("relu", torch.float32)
    with pytest.raises(ValueError, match=r"unknown activation 'tanh'; choose one of: relu, gelu, .*swiglu"):
        SF.feed_forward(torch.randn(2, D), *w, activation="tanh")
    with pytest.raises(ValueError, match=r"unknown activation 'GELU'"):
        SF.activation_fn("GELU")


@pytest.mark.parametrize("kw", ["dropout", "output_dropout"])
@pytest.mark.parametrize("p", [-0.5, 1.0, 2])
def test_dropout_out_of_range(kw, p):
    with pytest.raises(ValueError, match=rf"{kw} must be in \[0, 1\), got {p}"):
        SF.feed_forward(torch.randn(2, D), *_weights("relu", torch.float32), **{kw: p})


@pytest.mark.parametrize("p", [True, "0.1", None])
def test_dropout_wrong_type(p):
    with pytest.raises(TypeError, match=r"dropout must be a float in \[0, 1\)"):
        SF.feed_forward(torch.randn(2, D), *_weights("relu", torch.float32), dropout=p)


def test_wrong_last_dim_names_expected_and_got():
    with pytest.raises(ValueError, match=rf"x must have last dim d_model={D}, got shape \(2, 3, 4\)"):
        SF.feed_forward(torch.randn(2, 3, 4), *_weights("relu", torch.float32))
    with pytest.raises(ValueError, match=rf"d_model={D}, got shape \(\)"):
        SF.feed_forward(torch.tensor(1.0), *_weights("relu", torch.float32))


def test_x_not_a_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        SF.feed_forward([[1.0] * D], *_weights("relu", torch.float32))


def test_dtype_mismatch_names_both():
    with pytest.raises(TypeError, match=r"fc1_weight dtype torch.float64 does not match x dtype torch.float32"):
        SF.feed_forward(torch.randn(2, D), *_weights("relu", torch.float64))
