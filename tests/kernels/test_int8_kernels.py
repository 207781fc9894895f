"""The int8 helper kernels (kernels/csrc/int8.cpp) against the PyTorch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer import kernels
from sublayer.functional import activation_fn
from sublayer.functional.fused import _ACT_IDS

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built here")


def _data(n=7, k=37):  # 37: four 8-lane blocks and a 5-element tail
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, k, generator=g)
    x[2] = 0.0  # an all-zero row gets r = 1
    return x, torch.rand(k, generator=g) + 0.5, torch.rand(n, 1, generator=g) + 0.5, torch.randn(k, generator=g)


@pytest.mark.parametrize("smooth", [False, True])
def test_scale_rows(smooth):
    x, inv, _, _ = _data()
    xs, r = kernels.ops().int8_scale_rows(x, inv if smooth else None)
    v = x * inv if smooth else x
    ref_r = v.abs().amax(1, keepdim=True)
    ref_r[2] = 1.0
    assert_close(r, ref_r)
    assert_close(xs, v / ref_r)


def test_rescale_rows():
    y, _, r, b = _data()
    assert_close(kernels.ops().int8_rescale_rows_(y.clone(), r, b), y * r + b)
    assert_close(kernels.ops().int8_rescale_rows_(y.clone(), r, None), y * r)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("prepare", [False, True])
def test_act_rows(act, prepare):
    y, inv, r, b = _data()
    h_ref = activation_fn(act)(y * r + b)
    h, r2 = kernels.ops().int8_act_rows_(y.clone(), r, b, _ACT_IDS[act], inv if prepare else None)
    if not prepare:
        assert_close(h, h_ref)
        assert r2.numel() == 0
        return
    v = h_ref * inv
    ref_r2 = v.abs().amax(1, keepdim=True).clamp_min(1e-30)
    assert_close(r2, ref_r2)
    assert_close(h, v / ref_r2)


@pytest.mark.parametrize("prepare", [False, True])
def test_add_norm_rows(prepare):
    y, inv, r, b = _data()
    resid = torch.randn_like(y)
    w, beta = torch.rand(y.shape[1]) + 0.5, torch.randn(y.shape[1])
    ref = F.layer_norm(y * r + b + resid, (y.shape[1],), w, beta, 1e-5)
    out, xs, r2 = kernels.ops().int8_add_norm_rows_(y.clone(), r, b, resid, w, beta, 1e-5, inv if prepare else None)
    assert_close(out, ref)
    if prepare:
        v = ref * inv
        ref_r2 = v.abs().amax(1, keepdim=True)
        assert_close(r2, ref_r2)
        assert_close(xs, v / ref_r2)
    else:
        assert xs.numel() == 0 and r2.numel() == 0


def test_bad_inputs_are_named():
    x, inv, r, b = _data()
    with pytest.raises(RuntimeError, match="int8_scale_rows: x: expected a contiguous 2-D float32"):
        kernels.ops().int8_scale_rows(x.double(), None)
    with pytest.raises(RuntimeError, match="inv_smooth: expected a contiguous float32 vector of 37"):
        kernels.ops().int8_scale_rows(x, inv[:5])
    with pytest.raises(RuntimeError, match="r must hold one float32 per row"):
        kernels.ops().int8_rescale_rows_(x, r[:3], None)
    with pytest.raises(RuntimeError, match="resid must have y's shape"):
        kernels.ops().int8_add_norm_rows_(x, r, b, x[:3], inv, b, 1e-5, None)
