"""Empty sizes never crash the fused paths (an integer division by a zero width once killed the process with
SIGFPE): an empty batch, an empty model width, an empty hidden layer, a last dim of 0 — fused equals reference."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import sublayer
from sublayer import kernels
from sublayer.functional import fused

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels failed to build (see test_loader)")


def _ffn_run(impl, b, d, f, activation, p):
    gen = torch.Generator().manual_seed(0)
    g = 2 if activation == "swiglu" else 1
    ins = [torch.randn(*s, generator=gen).requires_grad_() for s in ((b, d), (g * f, d), (g * f,), (3, f), (3,))]
    out = fused.feed_forward(*ins, activation=activation, dropout=p, impl=impl, generator=gen)
    out.backward(torch.ones_like(out))
    return out, [t.grad for t in ins]


@pytest.mark.parametrize("b, d, f", [(0, 3, 5), (4, 0, 5), (4, 3, 0), (0, 0, 0)], ids=["batch", "d", "d_ff", "all"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
def test_feed_forward_empty_sizes(b, d, f, activation):
    # dropout 0: fused and reference must agree; with dropout the shapes and finiteness (masks differ)
    out, grads = _ffn_run("fused", b, d, f, activation, 0.0)
    ref, rgrads = _ffn_run("reference", b, d, f, activation, 0.0)
    assert_close(out, ref)
    for a, r in zip(grads, rgrads):
        assert_close(a, r)
    out, grads = _ffn_run("fused", b, d, f, activation, 0.3)
    assert out.shape == (b, 3) and all(torch.isfinite(g).all() for g in grads)


def test_feed_forward_zero_width_hidden_layer_is_fc2_bias():
    """The issue's reproducer: this crashed the interpreter (SIGFPE in act_fwd)."""
    b2 = torch.randn(2)
    out = fused.feed_forward(torch.randn(4, 3), torch.randn(0, 3), None, torch.randn(2, 0), b2, impl="fused")
    assert_close(out, b2.expand(4, 2))


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_add_norm_empty_batch_and_empty_width(impl):
    x, y = torch.randn(0, 5, requires_grad=True), torch.randn(0, 5, requires_grad=True)
    w, b = torch.ones(5, requires_grad=True), torch.zeros(5, requires_grad=True)
    out = fused.add_norm(x, y, 5, w, b, dropout=0.2, impl=impl)
    out.sum().backward()
    assert out.shape == (0, 5) and torch.equal(w.grad, torch.zeros(5)) and torch.equal(b.grad, torch.zeros(5))
    with pytest.raises(ValueError, match="normalized_shape entry must be a positive int, got 0"):
        fused.add_norm(torch.randn(4, 0), torch.randn(4, 0), 0, impl=impl)


@pytest.mark.parametrize("shape", [(4, 0), (0, 3), (2, 0, 5), (0,)])
def test_dropout_and_residual_on_empty_tensors(shape):
    x = torch.randn(*shape, requires_grad=True)
    for impl in ("fused", "reference"):
        out = fused.dropout(x, 0.3, impl=impl)
        assert out.shape == x.shape
        out.sum().backward()
    res = sublayer.ResidualConnection(dropout=0.3)
    assert res(torch.randn(*shape), lambda t: 2 * t).shape == shape
