"""Every custom autograd Function of the fused paths returns gradients that never alias each other: leaves'
``.grad`` stay separate tensors, and accumulating over two backward calls equals twice one call (and the
reference path's accumulation)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from sublayer import kernels
from sublayer.functional import fused

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels failed to build (see test_loader)")

D, F = 7, 11


def _leaves(shapes, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, dtype=dtype)) for s in shapes]


CASES = {
    # name: (leaf shapes, fn(impl, *leaves), dtype)
    "add_norm": ([(5, D), (5, D), (D,), (D,)], lambda impl, x, y, w, b: fused.add_norm(x, y, D, w, b, impl=impl)),
    "add_norm_rms": ([(5, D), (5, D), (D,)], lambda impl, x, y, w: fused.add_norm(x, y, D, w, norm="rms", impl=impl)),
    "feed_forward": (
        [(5, D), (F, D), (F,), (D, F), (D,)],
        lambda impl, x, w1, b1, w2, b2: fused.feed_forward(x, w1, b1, w2, b2, activation="gelu", impl=impl),
    ),
    "feed_forward_swiglu": (
        [(5, D), (2 * F, D), (2 * F,), (D, F), (D,)],
        lambda impl, x, w1, b1, w2, b2: fused.feed_forward(x, w1, b1, w2, b2, activation="swiglu", impl=impl),
    ),
}


def _grads(fn, impl, shapes, calls, dtype=torch.float32):
    leaves = _leaves(shapes, dtype)
    g = torch.randn(5, D, generator=torch.Generator().manual_seed(1), dtype=dtype)
    for _ in range(calls):
        (fn(impl, *leaves) * g).sum().backward()
    return leaves


@pytest.mark.parametrize("name", CASES)
def test_two_backward_calls_accumulate_as_the_reference(name):
    shapes, fn = CASES[name]
    fused_leaves = _grads(fn, "fused", shapes, 2)
    ptrs = [p.grad.untyped_storage().data_ptr() for p in fused_leaves]
    assert len(set(ptrs)) == len(ptrs), "two leaves share one gradient tensor"
    once = _grads(fn, "fused", shapes, 1)
    ref = _grads(fn, "reference", shapes, 2)
    for i, (a, o, r) in enumerate(zip(fused_leaves, once, ref)):
        assert_close(a.grad, 2 * o.grad, msg=f"{name} leaf {i}: not twice one call")
        assert_close(a.grad, r.grad, msg=f"{name} leaf {i}: not the reference's accumulation")
    fused_leaves[0].grad.zero_()
    assert fused_leaves[1].grad.abs().sum() > 0  # zeroing one leaf's gradient leaves the other's


def test_dropout_and_bf16_linear_accumulate_twice_one_call():
    for fn, shapes, dtype in (
        (lambda impl, x: fused.dropout(x, 0.5, impl=impl, generator=torch.Generator().manual_seed(3)), [(5, D)],
         torch.float32),
        (lambda impl, x, w, b: fused.linear(x, w, b), [(5, D), (D, D), (D,)], torch.bfloat16),
    ):  # fmt: skip
        two, once = _grads(fn, "fused", shapes, 2, dtype), _grads(fn, "fused", shapes, 1, dtype)
        ptrs = [p.grad.untyped_storage().data_ptr() for p in two]
        assert len(set(ptrs)) == len(ptrs)
        for a, o in zip(two, once):
            assert_close(a.grad, 2 * o.grad)
