"""sublayer.functional norms: layer_norm, rms_norm, add_norm — parity with torch, gradcheck, numerics, properties."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import sublayer.functional as SF

HALF = [torch.bfloat16, torch.float16]


# --------------------------------------------------------------------------------------------------------------
# parity with torch's functional ops
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7,), (5, 7)])
def test_layer_norm_matches_torch(dtype, shape):
    x = torch.randn(3, 2, *shape, dtype=dtype)
    w = torch.randn(shape, dtype=dtype)
    b = torch.randn(shape, dtype=dtype)
    assert_close(SF.layer_norm(x, shape, w, b, 1e-5), F.layer_norm(x, shape, w, b, 1e-5))
    assert_close(SF.layer_norm(x, shape), F.layer_norm(x, shape))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(dtype):
    x = torch.randn(3, 5, 7, dtype=dtype)
    w = torch.randn(7, dtype=dtype)
    assert_close(SF.rms_norm(x, 7, w, 1e-6), F.rms_norm(x, (7,), w, 1e-6))
    assert_close(SF.rms_norm(x, (5, 7), None, 1e-3), F.rms_norm(x, (5, 7), None, 1e-3))


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_add_norm_is_norm_of_sum(norm):
    x, y = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    w, b = torch.randn(5), torch.randn(5)
    got = SF.add_norm(x, y, 5, w, b, 1e-5, norm=norm)
    want = F.layer_norm(x + y, (5,), w, b, 1e-5) if norm == "layer" else F.rms_norm(x + y, (5,), w, 1e-5)
    assert_close(got, want)


def test_add_norm_dropout_inactive_when_not_training():
    x, y = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    assert_close(SF.add_norm(x, y, 5, dropout=0.5, training=False), F.layer_norm(x + y, (5,)))


def test_add_norm_dropout_applies_to_y_only():
    # x = 0 and y = 1: with layer norm over a single element... use rms over the last dim of width 1:
    # rms_norm(v) = sign(v) for a scalar row, so a dropped y gives 0/sqrt(eps)=0 and a kept one gives 1.
    x = torch.zeros(4000, 1)
    y = torch.ones(4000, 1)
    out = SF.add_norm(x, y, 1, eps=1e-12, dropout=0.25, training=True, norm="rms")
    kept = (out != 0).float().mean().item()
    assert set(out.unique().tolist()) <= {0.0, 1.0}
    assert abs(kept - 0.75) < 4 * (0.75 * 0.25 / 4000) ** 0.5


# --------------------------------------------------------------------------------------------------------------
# gradcheck (float64 only: fp32 LayerNorm fails gradcheck by design)
# --------------------------------------------------------------------------------------------------------------
def _req(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("shape", [(5,), (3, 5)])
def test_gradcheck_layer_norm(shape):
    x, w, b = _req(2, 3, *shape), _req(*shape), _req(*shape)
    assert torch.autograd.gradcheck(lambda x, w, b: SF.layer_norm(x, shape, w, b, 1e-5), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda x, w, b: SF.layer_norm(x, shape, w, b, 1e-5), (x, w, b))


@pytest.mark.parametrize("shape", [(5,), (3, 5)])
def test_gradcheck_rms_norm(shape):
    x, w = _req(2, 3, *shape), _req(*shape)
    assert torch.autograd.gradcheck(lambda x, w: SF.rms_norm(x, shape, w, 1e-6), (x, w))


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_gradcheck_add_norm(norm):
    x, y, w, b = _req(2, 3, 5), _req(2, 3, 5), _req(5), _req(5)
    fn = lambda x, y, w, b: SF.add_norm(x, y, 5, w, b, 1e-5, norm=norm)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, y, w, b))


# --------------------------------------------------------------------------------------------------------------
# fp32 statistics for half inputs (the naive half-precision / one-pass formulas fail these)
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_layer_norm_half_values_near_400(dtype, sign):
    # Half values around ±400 with a spread of a few units. Kept in half precision, E[x²] (160000) overflows fp16 and
    # is off by hundreds in bf16, and even a two-pass mean rounded to half (ulp 0.25 / 2 here) shifts every output
    # by a sizeable fraction of a standard deviation. Statistics in fp32 leave only the final rounding.
    x = (sign * (400.0 + 3.0 * torch.randn(4, 11, dtype=torch.float64))).to(dtype)
    ref = F.layer_norm(x.double(), (11,))  # fp64 reference on the very same (rounded) input
    got = SF.layer_norm(x, 11)
    assert got.dtype == dtype
    assert_close(got, ref.to(dtype))  # one rounding of an O(1) value: within the dtype's default tolerance
    assert got.abs().amax() > 1.0  # not collapsed to zeros


@pytest.mark.parametrize("dtype", HALF)
def test_layer_norm_half_large_mean_row(dtype):
    # Rows with mean ≈ 2000 and spread ~10 (half ulp there: 8 in bf16, 1 in fp16): the mean must not be rounded.
    x = (2000.0 + 10.0 * torch.randn(3, 13, dtype=torch.float64)).to(dtype)
    got = SF.layer_norm(x, 13)
    assert_close(got, F.layer_norm(x.double(), (13,)).to(dtype))


def test_layer_norm_fp32_large_mean_two_pass():
    # fp32 row with mean 2000 and variance ~0.44: E[x²]-E[x]² cancels (it gives ~0.25); two-pass does not.
    # Tolerance (PyTorch's "fused tolerances" convention): our error vs fp64 may be at most a small multiple of the
    # error torch's own fp32 F.layer_norm makes vs fp64 on the same input (plus 1 fp32 ulp of an O(1) output).
    x = (2000.0 + 0.66 * torch.randn(4, 64, dtype=torch.float64)).float()
    ref = F.layer_norm(x.double(), (64,))
    err_ours = (SF.layer_norm(x, 64).double() - ref).abs().max().item()
    err_torch = (F.layer_norm(x, (64,)).double() - ref).abs().max().item()
    assert err_ours <= 4 * err_torch + 1.2e-7, (err_ours, err_torch)
    # The input discriminates: a one-pass fp32 LayerNorm (E[x²]-E[x]²) is far outside that bound.
    m = x.mean(-1, keepdim=True)
    one_pass = (x - m) * torch.rsqrt((x * x).mean(-1, keepdim=True) - m * m + 1e-5)
    assert (one_pass.double() - ref).abs().max().item() > 100 * (4 * err_torch + 1.2e-7)


@pytest.mark.parametrize("dtype", HALF)
def test_rms_norm_half_uses_fp32_statistics(dtype):
    # sum of squares of values ~300 overflows fp16 (65504) if kept in half precision.
    x = (300.0 + torch.arange(7, dtype=torch.float64)).repeat(2, 1).to(dtype)
    ref = F.rms_norm(x.double(), (7,), None, 1e-6)
    got = SF.rms_norm(x, 7)
    assert torch.isfinite(got).all()
    assert_close(got, ref.to(dtype))


# --------------------------------------------------------------------------------------------------------------
# hypothesis properties
# --------------------------------------------------------------------------------------------------------------
# Rows of 7 values in [-10, 10] with a standard deviation of at least 0.1 (so var >= 1e-2). With eps = 1e-12 the
# eps term changes the output by at most eps / (2·var) ≈ 5e-11 relative — far below the fp64 tolerance (1e-7),
# for any positive scale a (eps/a² or eps·a² relative to var·a² is the same bound at var·a² ≥ 1e-2·0.25).
ROW = st.lists(st.floats(-10, 10, allow_nan=False), min_size=7, max_size=7).filter(
    lambda r: torch.tensor(r, dtype=torch.float64).std(unbiased=False) >= 0.1
)
EPS = 1e-12


@given(row=ROW, shift=st.floats(-1e3, 1e3), scale=st.floats(0.5, 100.0))
def test_layer_norm_invariant_to_shift_and_positive_scale(row, shift, scale):
    x = torch.tensor(row, dtype=torch.float64)
    base = SF.layer_norm(x, 7, eps=EPS)
    # |shift| ≤ 1e3 costs at most ~1e3·2^-52/0.1 ≈ 2e-11 in fp64 cancellation: still within default tolerance.
    assert_close(SF.layer_norm(scale * x + shift, 7, eps=EPS), base)


@given(row=ROW, scale=st.floats(0.5, 100.0))
def test_rms_norm_invariant_to_positive_scale(row, scale):
    x = torch.tensor(row, dtype=torch.float64)
    # ROW's std filter gives mean(x²) ≥ var ≥ 1e-2, so eps = 1e-12 is negligible here too.
    assert_close(SF.rms_norm(scale * x, 7, eps=EPS), SF.rms_norm(x, 7, eps=EPS))


@given(batch=st.integers(1, 5), row=st.integers(0, 4), norm=st.sampled_from(["layer", "rms"]))
def test_batch_row_equals_row_alone(batch, row, norm):
    row = row % batch
    x, y = torch.randn(batch, 3, 5), torch.randn(batch, 3, 5)
    w, b = torch.randn(5), torch.randn(5)
    full = SF.add_norm(x, y, 5, w, b, norm=norm)
    alone = SF.add_norm(x[row : row + 1], y[row : row + 1], 5, w, b, norm=norm)
    assert_close(full[row : row + 1], alone)


# --------------------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------------------
def test_layer_norm_wrong_trailing_dims_names_expected_and_got():
    with pytest.raises(ValueError, match=r"x must end with dims \(5,\).*got shape \(2, 3, 4\)"):
        SF.layer_norm(torch.randn(2, 3, 4), 5)
    with pytest.raises(ValueError, match=r"\(3, 5\).*got shape \(2, 5\)"):
        SF.rms_norm(torch.randn(2, 5), (3, 5))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_norms_refuse_a_non_floating_input(dtype):
    """An integer or bool input is a TypeError (F.layer_norm raises too), not a normalised result cast back to it."""
    x = torch.ones(2, 5, dtype=dtype)
    for fn in (lambda: SF.layer_norm(x, 5), lambda: SF.rms_norm(x, 5), lambda: SF.add_norm(x, x, 5)):
        with pytest.raises(TypeError, match=rf"x must be a floating-point tensor, got dtype {dtype}"):
            fn()


@pytest.mark.parametrize("shape", [0, -3, (3, 0)])
def test_norm_non_positive_normalized_shape(shape):
    with pytest.raises(ValueError, match=r"normalized_shape.*positive int"):
        SF.layer_norm(torch.randn(3), shape)


@pytest.mark.parametrize("shape", [True, "5", 2.5])
def test_norm_bad_normalized_shape_type(shape):
    with pytest.raises(TypeError, match="normalized_shape"):
        SF.rms_norm(torch.randn(5), shape)


def test_add_norm_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"x and y must have the same shape, got \(2, 5\) and \(3, 5\)"):
        SF.add_norm(torch.randn(2, 5), torch.randn(3, 5), 5)


def test_add_norm_unknown_norm_lists_choices():
    with pytest.raises(ValueError, match=r"unknown norm 'batch'; choose one of: layer, rms"):
        SF.add_norm(torch.randn(2, 5), torch.randn(2, 5), 5, norm="batch")


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_add_norm_dropout_out_of_range(p):
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got"):
        SF.add_norm(torch.randn(2, 5), torch.randn(2, 5), 5, dropout=p)


@pytest.mark.parametrize("wshape", [(1,), (4, 7), (7, 1)])
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_weight_and_bias_must_have_normalized_shape(wshape, impl):
    """F.layer_norm raises for a weight of shape (1,) or (N, d); ours used to broadcast it silently."""
    from sublayer.functional import fused

    x = torch.randn(4, 7)
    bad, good = torch.ones(wshape), torch.ones(7)
    with pytest.raises(RuntimeError):
        F.layer_norm(x, (7,), bad, good)
    for w, b, name in ((bad, good, "weight"), (good, bad, "bias")):
        msg = rf"{name} must have shape \(7,\) \(normalized_shape\), got {re.escape(str(wshape))}"
        with pytest.raises(ValueError, match=msg):
            fused.add_norm(x, x, 7, w, b, impl=impl)
        if impl == "reference":
            with pytest.raises(ValueError, match=msg):
                SF.layer_norm(x, 7, w, b)
    if impl == "reference":
        with pytest.raises(ValueError, match=r"weight must have shape \(7,\)"):
            SF.rms_norm(x, 7, bad)
