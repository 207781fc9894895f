"""Fused Add & Norm (sublayer.functional.fused.add_norm) against the reference sublayer.functional.add_norm."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck
from torch.testing import assert_close

import sublayer
import sublayer.functional as SF
from sublayer import kernels
from sublayer.functional import fused

from ._tol import as64, assert_fast_close, graph_names, run

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels failed to build (see test_loader)")


def _inputs(shape, d, dtype, ydtype=None, affine=True, scale=1.0, offset=0.0):
    x = (torch.randn(*shape, d) * scale + offset).to(dtype).requires_grad_()
    y = (torch.randn(*shape, d) * scale).to(ydtype or dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(d)).requires_grad_(affine)
    b = (0.5 * torch.randn(d)).requires_grad_(affine)
    return [x, y, w, b]


def _check(shape, d, dtype, norm, *, ydtype=None, wdtype=torch.float32, eps=1e-5, **kw):
    ins = _inputs(shape, d, dtype, ydtype, **kw)
    ins[2], ins[3] = ins[2].detach().to(wdtype).requires_grad_(), ins[3].detach().to(wdtype).requires_grad_()

    def f(impl):
        return lambda x, y, w, b: fused.add_norm(x, y, d, w, b, eps, norm=norm, impl=impl)

    fo, fg = run(f("fused"), ins)
    ro, rg = run(f("reference"), ins)
    wo, wg = run(f("reference"), as64(ins))
    assert_fast_close(fo, ro, wo, what="out")
    names = ["dx", "dy", "dweight", "dbias"]
    for n, a, r, w in zip(names, fg, rg, wg):
        if norm == "rms" and n == "dbias":
            assert a is None or not a.abs().any()
            continue
        assert_fast_close(a, r, w, what=n)
    return fo, fg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("d", [1, 7, 37])  # rows not a multiple of the vector width; d = 1
def test_matches_reference_forward_and_grads(dtype, norm, d):
    _check((3, 5), d, dtype, norm, wdtype=dtype)


@pytest.mark.parametrize("xd,yd", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_mixed_dtypes_promote_like_reference(xd, yd):
    out, grads = _check((11,), 13, xd, "layer", ydtype=yd)
    assert out.dtype == torch.float32
    assert grads[0].dtype == xd and grads[1].dtype == yd


def test_large_values_keep_fp32_statistics():
    # mean 2000, spread 1: E[x^2]-E[x]^2 would cancel; bf16 sums near 400 would zero out without fp32 stats
    _check((7,), 31, torch.float32, "layer", offset=2000.0)
    out, _ = _check((7,), 31, torch.bfloat16, "layer", scale=100.0, offset=400.0)
    assert out.float().std() > 0.1


def test_no_affine_and_no_bias():
    x, y = torch.randn(5, 11), torch.randn(5, 11)
    w = torch.randn(11)
    for norm in ("layer", "rms"):
        for wt, bt in ((None, None), (w, None)):
            got = fused.add_norm(x, y, 11, wt, bt, norm=norm, impl="fused")
            assert_close(got, SF.add_norm(x, y, 11, wt, bt, norm=norm))


def test_multi_dim_normalized_shape_and_noncontiguous():
    x = torch.randn(5, 7, 3).transpose(0, 2)  # (3, 7, 5), non-contiguous
    y = torch.randn(3, 7, 5)
    w, b = torch.randn(7, 5), torch.randn(7, 5)
    assert not x.is_contiguous()
    assert_close(fused.add_norm(x, y, (7, 5), w, b, impl="fused"), SF.add_norm(x, y, (7, 5), w, b))


def test_batch_zero():
    x = torch.randn(0, 7, requires_grad=True)
    y = torch.randn(0, 7, requires_grad=True)
    an = sublayer.AddNorm(7, dropout=0.1)
    out = an(x, y)
    assert out.shape == (0, 7)
    out.sum().backward()
    assert x.grad.shape == (0, 7) and an.norm.weight.grad.abs().sum() == 0


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_gradcheck_float64(norm, p):
    x, y = torch.randn(4, 6, dtype=torch.float64, requires_grad=True), torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def f(x, y, w, b):  # a fixed generator: the same dropout mask at every call
        g = torch.Generator().manual_seed(3)
        return fused.add_norm(x, y, 6, w, b, dropout=p, norm=norm, impl="fused", generator=g)

    assert gradcheck(f, (x, y, w, b), eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_matches_reference_with_the_same_mask(dtype):
    # The fused mask is Philox's, not F.dropout's: rebuild it with fused.dropout (same seed, same flat indices)
    # and compare against the reference applied to y * mask.
    p, d = 0.4, 19
    ins = _inputs((6,), d, dtype)
    mask = fused.dropout(torch.ones(6, d, dtype=dtype), p, generator=torch.Generator().manual_seed(9), impl="fused")
    assert 0 < (mask == 0).sum() < mask.numel()

    def fast(x, y, w, b):
        return fused.add_norm(x, y, d, w, b, dropout=p, impl="fused", generator=torch.Generator().manual_seed(9))

    def ref(x, y, w, b):
        return SF.add_norm(x, y * mask.to(y.dtype), d, w, b)

    fo, fg = run(fast, ins)
    ro, rg = run(ref, ins)
    wo, wg = run(ref, as64(ins))
    assert_fast_close(fo, ro, wo, what="out")
    for n, a, r, w in zip(["dx", "dy", "dw", "db"], fg, rg, wg):
        assert_fast_close(a, r, w, what=n)
    assert (fg[1][mask == 0] == 0).all()


@pytest.mark.parametrize("d", [5, 16, 37])  # tail bits only, whole bytes, both
def test_saves_the_dropout_mask_as_bits_and_backward_uses_it(d):
    # Saved for backward: the sum (N, d), mean and rstd (N,), the weight and the mask as (N, ceil(d/8)) uint8 — one
    # bit per element, never a full-precision mask. The gradient of y is zero exactly where the bit is clear.
    n, p = 11, 0.5
    x, y = torch.randn(n, d, requires_grad=True), torch.randn(n, d, requires_grad=True)
    w, b = torch.randn(d, requires_grad=True), torch.randn(d, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused.add_norm(x, y, d, w, b, dropout=p, impl="fused", generator=torch.Generator().manual_seed(4))
    masks = [t for t in saved if t.dtype == torch.uint8]
    assert len(masks) == 1 and masks[0].shape == (n, (d + 7) // 8)
    assert not any(t.shape == (n, d) and t.dtype != x.dtype for t in saved)
    bits = masks[0].view(-1, 1).bitwise_right_shift(torch.arange(8, dtype=torch.uint8)).bitwise_and(1)
    keep = bits.view(n, -1)[:, :d].bool()  # bit j % 8 of byte j // 8
    gy = torch.autograd.grad(out, y, torch.randn(n, d))[0]
    assert 0 < keep.sum() < keep.numel()
    assert torch.equal(gy != 0, keep)
    ref = fused.dropout(torch.ones(n, d), p, generator=torch.Generator().manual_seed(4), impl="fused")
    assert torch.equal(ref != 0, keep)  # the same Philox mask the forward applied


def test_gradient_of_both_inputs_equal_but_not_aliased_without_dropout():
    x, y = torch.randn(4, 9, requires_grad=True), torch.randn(4, 9, requires_grad=True)
    out = fused.add_norm(x, y, 9, impl="fused")
    gx, gy = torch.autograd.grad(out, (x, y), torch.randn(4, 9))
    assert torch.equal(gx, gy)  # computed once ...
    assert gx.data_ptr() != gy.data_ptr()  # ... handed out as two tensors (see test_grad_aliasing.py)


def test_eval_is_identity_dropout_and_p0_is_reference():
    an = sublayer.AddNorm(13, dropout=0.5).eval()
    x, y = torch.randn(3, 13), torch.randn(3, 13)
    assert_close(an(x, y), SF.add_norm(x, y, 13, an.norm.weight, an.norm.bias))
    an0 = sublayer.AddNorm(13, dropout=0.0)
    assert_close(an0(x, y), SF.add_norm(x, y, 13, an0.norm.weight, an0.norm.bias))


def test_module_uses_fused_path_by_default_and_switch_turns_it_off():
    an = sublayer.AddNorm(7, dropout=0.1)
    x, y = torch.randn(2, 7, requires_grad=True), torch.randn(2, 7)
    assert "AddNormFn" in graph_names(an(x, y))
    kernels.set_enabled(False)
    try:
        assert "AddNormFn" not in graph_names(an(x, y))
    finally:
        kernels.set_enabled(True)
    an.double()  # float64 runs the reference by default (double backward works there)
    assert "AddNormFn" not in graph_names(an(x.double(), y.double()))


def test_autocast_bf16_with_fp32_weights():
    # what a user's training step sees: fp32 residual, bf16 sub-layer output (from a Linear under autocast)
    an = sublayer.AddNorm(16, dropout=0.0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(3, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = an(x, lin(x))
        ref = SF.add_norm(x, lin(x), 16, an.norm.weight, an.norm.bias)
    assert out.dtype == ref.dtype == torch.float32
    assert_close(out, ref)
    out.sum().backward()
    assert an.norm.weight.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32


def test_no_grad_forward():
    x, y = torch.randn(3, 7), torch.randn(3, 7)
    w = torch.randn(7, requires_grad=True)
    with torch.no_grad():
        out = fused.add_norm(x, y, 7, w, None, impl="fused")
    assert out.grad_fn is None
    assert_close(out, SF.add_norm(x, y, 7, w.detach()))


def test_bad_input_errors():
    with pytest.raises(ValueError, match="same shape"):
        fused.add_norm(torch.randn(2, 3), torch.randn(2, 4), 3)
    with pytest.raises(ValueError, match="impl"):
        fused.add_norm(torch.randn(2, 3), torch.randn(2, 3), 3, impl="fast")
    with pytest.raises(ValueError, match="dropout"):
        fused.add_norm(torch.randn(2, 3), torch.randn(2, 3), 3, dropout=1.0)
    with pytest.raises(ValueError, match="must end with dims"):
        fused.add_norm(torch.randn(2, 3), torch.randn(2, 3), 4)
    with pytest.raises(RuntimeError, match="impl='fused' cannot run"):
        fused.add_norm(torch.randn(2, 3, dtype=torch.float16), torch.randn(2, 3, dtype=torch.float16), 3, impl="fused")


# ----------------------------------------------------------------- the AVX-512 rows and the AVX2 loops
# The AVX-512 rows take one storage type with d a multiple of 64 (forward) or 16 (backward); the switch
# add_norm_avx512 turns them off so that the AVX2 loops run the same shapes on the same machine.
@pytest.fixture(params=["avx512", "avx2"])
def add_norm_isa(request):
    ops = kernels.ops()
    if request.param == "avx512" and not ops.add_norm_avx512(-1):
        pytest.skip("the AVX-512 rows are not compiled in on this CPU")
    was = ops.add_norm_avx512(int(request.param == "avx512"))
    yield request.param
    ops.add_norm_avx512(int(was))


def _same_mask_check(rows, d, dtype, norm, p, affine, seed=9):
    """The fused result against the reference applied to y * (the Philox mask of fused.dropout, same seed)."""
    ins = _inputs((rows,), d, dtype, affine=affine)
    mask = fused.dropout(torch.ones(rows, d, dtype=dtype), p, generator=torch.Generator().manual_seed(seed), impl="fused")

    def fast(x, y, w, b):
        g = torch.Generator().manual_seed(seed)
        return fused.add_norm(x, y, d, w, b, dropout=p, norm=norm, impl="fused", generator=g)

    def ref(x, y, w, b):
        return SF.add_norm(x, y * mask.to(y.dtype), d, w, b, norm=norm)

    fo, fg = run(fast, ins)
    ro, rg = run(ref, ins)
    wo, wg = run(ref, as64(ins))
    assert_fast_close(fo, ro, wo, what="out")
    for n, a, r, w in zip(["dx", "dy", "dw", "db"], fg, rg, wg):
        if n == "db" and norm == "rms" or not affine and n in ("dw", "db"):
            continue
        assert_fast_close(a, r, w, what=n)
    if p > 0:
        assert 0 < (mask == 0).sum() < mask.numel()
        assert (fg[1][mask == 0] == 0).all() and (fg[1][mask != 0] != 0).all()
    return fo, fg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("d,p", [(64, 0.3), (128, 0.0), (192, 0.1), (48, 0.3)])  # 48: AVX-512 backward only
def test_vector_rows_match_reference_with_the_same_mask(add_norm_isa, dtype, norm, d, p):
    _same_mask_check(13, d, dtype, norm, p, affine=True)  # 13 rows: groups of 4 rows and a remainder of 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_rows_without_weight_or_bias(add_norm_isa, dtype):
    x, y = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    w = torch.randn(64)
    for norm in ("layer", "rms"):
        for wt, bt in ((None, None), (w, None)):
            got = fused.add_norm(x, y, 64, wt, bt, norm=norm, impl="fused")
            lowp = SF.add_norm(x, y, 64, wt, bt, norm=norm)
            want = SF.add_norm(x.double(), y.double(), 64, wt, bt, norm=norm)
            assert_fast_close(got, lowp, want, what=f"{norm} weight={wt is not None}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_rows_match_reference(add_norm_isa, dtype):
    # >= 1 MiB per tensor: the saved sum and the input gradients go out through streaming stores
    rows = 4099 if dtype == torch.bfloat16 else 2053
    _same_mask_check(rows, 128, dtype, "layer", 0.1, affine=True)


def test_vector_rows_and_avx2_loops_agree():
    # The same mask bit for bit and the same values to rounding, whichever loops run.
    ops = kernels.ops()
    if not ops.add_norm_avx512(-1):
        pytest.skip("the AVX-512 rows are not compiled in on this CPU")
    x, y, g = torch.randn(11, 128), torch.randn(11, 128), torch.randn(11, 128)
    w, b = torch.randn(128), torch.randn(128)
    got = []
    try:
        for on in (1, 0):
            ops.add_norm_avx512(on)
            out, s, mean, rstd, keep = ops.add_norm_fwd(x, y, w, b, 1e-5, 0.25, 77, False, True)
            got.append((out, s, mean, rstd, keep, *ops.add_norm_bwd(g, s, mean, rstd, w, keep, x.dtype, y.dtype, 0.25,
                                                                   False, True, True, True)))  # fmt: skip
    finally:
        ops.add_norm_avx512(1)
    keep = got[0][4]
    assert torch.equal(keep, got[1][4]) and 0 < keep.sum() and (keep != 255).any()
    for i, name in enumerate(["out", "sum", "mean", "rstd", None, "dx", "dy", "dw", "db"]):
        if name:
            assert_close(got[0][i], got[1][i], atol=1e-5, rtol=1e-5, msg=name)


def test_default_generator_seed_is_the_one_dropout_seed_draws():
    # Without generator= the kernel draws the seed from torch's default generator itself: the same draw as
    # dropout_seed(), so manual_seed reproduces the mask and the generator advances as it would.
    x, y = torch.randn(5, 64), torch.randn(5, 64)
    torch.manual_seed(21)
    got = fused.add_norm(x, y, 64, dropout=0.5, impl="fused")
    after = torch.rand(3)
    torch.manual_seed(21)
    want = fused.add_norm(x, y, 64, dropout=0.5, impl="fused", generator=torch.Generator().manual_seed(21))
    torch.manual_seed(21)
    fused.dropout_seed()
    assert torch.equal(got, want)
    assert torch.equal(after, torch.rand(3))
    assert not torch.equal(got, fused.add_norm(x, y, 64, dropout=0.5, impl="fused"))  # the next draw: a new mask
