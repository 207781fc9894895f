"""Conv1D (GPT-2 layout) vs HF transformers.pytorch_utils.Conv1D; exact nn.Linear round trips."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from transformers.pytorch_utils import Conv1D as HFConv1D

from sublayer import Conv1D

NF, NX = 7, 5  # out, in


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(NX,), (3, NX), (2, 3, NX)])
def test_matches_hf_conv1d(dtype, shape):
    hf = HFConv1D(NF, NX).to(dtype)
    with torch.no_grad():
        hf.bias.copy_(torch.randn(NF))
    ours = Conv1D(NF, NX, dtype=dtype)
    ours.load_state_dict(hf.state_dict())  # strict: same names and the same (nx, nf) weight layout
    x = torch.randn(shape, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y1, y2 = ours(x1), hf(x2)
    assert y1.shape == (*shape[:-1], NF)
    assert_close(y1, y2)
    gy = torch.randn_like(y1)
    y1.backward(gy)
    y2.backward(gy)
    assert_close(x1.grad, x2.grad)
    assert_close(ours.weight.grad, hf.weight.grad)
    assert_close(ours.bias.grad, hf.bias.grad)


def test_layout_and_init():
    c = Conv1D(NF, NX)
    assert c.weight.shape == (NX, NF) and c.bias.shape == (NF,)
    assert torch.equal(c.bias, torch.zeros(NF))
    big = Conv1D(64, 64)
    assert 0.015 < big.weight.std().item() < 0.025  # GPT-2's initializer_range 0.02


def test_formula_x_at_w_plus_b():
    c = Conv1D(NF, NX)
    with torch.no_grad():
        c.bias.copy_(torch.randn(NF))
    x = torch.randn(4, NX)
    assert_close(c(x), x @ c.weight + c.bias)


def test_no_bias():
    c = Conv1D(NF, NX, bias=False)
    assert c.bias is None and [n for n, _ in c.named_parameters()] == ["weight"]
    x = torch.randn(2, 3, NX)
    assert_close(c(x), x @ c.weight)
    lin = c.to_linear()
    assert lin.bias is None
    assert_close(lin(x), c(x))


def test_non_contiguous_input():
    c = Conv1D(NF, NX)
    x = torch.randn(NX, 3, 2).permute(2, 1, 0)  # (2, 3, NX), not contiguous
    assert not x.is_contiguous()
    assert_close(c(x), c(x.contiguous()))


def test_to_linear_exact():
    c = Conv1D(NF, NX, dtype=torch.float64)
    with torch.no_grad():
        c.bias.copy_(torch.randn(NF))
    lin = c.to_linear()
    assert isinstance(lin, nn.Linear) and (lin.in_features, lin.out_features) == (NX, NF)
    assert lin.weight.dtype == torch.float64
    assert torch.equal(lin.weight, c.weight.T) and torch.equal(lin.bias, c.bias)
    x = torch.randn(2, 3, NX, dtype=torch.float64)
    assert_close(lin(x), c(x))
    # a copy, not a view: changing one leaves the other
    with torch.no_grad():
        lin.weight.zero_()
    assert c.weight.abs().sum() > 0


@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_and_back_is_bit_exact(bias):
    lin = nn.Linear(NX, NF, bias=bias)
    c = Conv1D.from_linear(lin)
    assert (c.nf, c.nx) == (NF, NX) and torch.equal(c.weight, lin.weight.T)
    back = c.to_linear()
    assert torch.equal(back.weight, lin.weight)
    if bias:
        assert torch.equal(back.bias, lin.bias) and torch.equal(c.bias, lin.bias)
    else:
        assert back.bias is None and c.bias is None
    again = Conv1D.from_linear(back)
    assert torch.equal(again.weight, c.weight)
    x = torch.randn(4, NX)
    assert_close(c(x), lin(x))


def test_dtype_and_meta_device():
    assert Conv1D(NF, NX, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    m = Conv1D(NF, NX, device="meta")
    assert m.weight.is_meta and m.bias.is_meta


# --------------------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("nf", "nx", "name"), [(0, NX, "nf"), (NF, -1, "nx")])
def test_non_positive_sizes(nf, nx, name):
    with pytest.raises(ValueError, match=rf"{name} must be a positive int, got -?\d"):
        Conv1D(nf, nx)


@pytest.mark.parametrize(("nf", "nx", "name"), [(True, NX, "nf"), (NF, "5", "nx"), (7.0, NX, "nf")])
def test_bool_str_float_sizes(nf, nx, name):
    with pytest.raises(TypeError, match=rf"{name} must be a positive int, got"):
        Conv1D(nf, nx)


def test_wrong_input_last_dim():
    with pytest.raises(ValueError, match=rf"x must have last dim nx={NX}, got shape \(2, 3, 4\)"):
        Conv1D(NF, NX)(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=rf"nx={NX}, got shape \(\)"):
        Conv1D(NF, NX)(torch.tensor(1.0))


def test_from_linear_rejects_other_modules():
    with pytest.raises(TypeError, match="linear must be an nn.Linear, got Conv1D"):
        Conv1D.from_linear(Conv1D(NF, NX))


def test_non_tensor_input_is_type_error():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        Conv1D(NF, NX)([1.0] * NX)


def test_dtype_mismatch_names_both():
    with pytest.raises(TypeError, match=r"weight dtype torch.float32 does not match x dtype torch.float64"):
        Conv1D(NF, NX)(torch.randn(2, NX, dtype=torch.float64))


def test_autocast_mixed_dtypes_allowed():
    c = Conv1D(NF, NX)
    x = torch.randn(3, NX)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = c(x)
    assert y.dtype == torch.bfloat16
    assert_close(y.float(), c(x), rtol=2e-2, atol=2e-2)  # bf16 GEMM of O(0.1) values: a few bf16 ulps
