"""The int8 helper kernels (kernels/csrc/int8.cpp) against the PyTorch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer import kernels
from sublayer.functional import activation_fn
from sublayer.functional.fused import ACT_IDS
from sublayer.runtime.linear import Int8Linear

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
    h, r2 = kernels.ops().int8_act_rows_(y.clone(), r, b, ACT_IDS[act], inv if prepare else None)
    if not prepare:
        assert_close(h, h_ref)
        assert r2.numel() == 0
        return
    v = h_ref * inv
    ref_r2 = v.abs().amax(1, keepdim=True).clamp_min(1e-30)
    assert_close(r2, ref_r2)
    assert_close(h, v / ref_r2)


def test_int8_epilogue_gelu_is_erf_gelu_over_its_whole_range():
    # the int8 epilogues' GELU (a rational erf, clamped beyond |z| = 4 sqrt 2) against the float64 erf GELU
    z = torch.linspace(-12, 12, 48_001)
    lin = Int8Linear(torch.ones(1, 1, dtype=torch.int8), torch.ones(1))  # z -> z up to its 8-bit rounding
    pairs = [(z, kernels.ops().int8_act_rows_(z[None].clone(), None, None, ACT_IDS["gelu"], None)[0][0]),
             (lin(z[:, None])[:, 0], lin(z[:, None], "gelu")[:, 0])]
    for x, y in pairs:
        x = x.double()
        err = (y.double() - F.gelu(x)).abs()
        assert float((err / (1 + x.abs())).max()) < 3e-7, float(err.max())
        assert torch.equal(y[x > 6].double(), x[x > 6]) and y[x < -8].abs().max() < 1e-12


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
    with pytest.raises(RuntimeError, match="int8_scale_rows: inv_smooth must have 37 elements, got 5"):
        kernels.ops().int8_scale_rows(x, inv[:5])
    with pytest.raises(RuntimeError, match="r must hold one float32 per row"):
        kernels.ops().int8_rescale_rows_(x, r[:3], None)
    with pytest.raises(RuntimeError, match="resid must have y's shape"):
        kernels.ops().int8_add_norm_rows_(x, r, b, x[:3], inv, b, 1e-5, None)


# ------------------------------------------------------------------------------- weight-only int8 GEMV (decoding)
# packed_linear.cpp's skinny_linear on int8 panels (the product QuantizedGPT2 runs) against the dequantized reference
@pytest.fixture(params=["avx512", "avx2"])
def gemv_isa(request):
    """Each GEMV test with the AVX-512 micro-kernels (where compiled in) and with the AVX2 ones."""
    was = kernels.ops().decode_avx512(int(request.param == "avx512"))
    yield request.param
    kernels.ops().decode_avx512(int(was))


def _int8_linear(x, q, s, b, n, act=0):
    return kernels.ops().skinny_linear(x, kernels.ops().pack_linear_weight(q), b, n, act, s)


def test_pack_int8_layout_is_panels_of_16_columns_zero_padded():
    q = torch.randint(-127, 128, (37, 13), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = kernels.ops().pack_linear_weight(q)
    assert packed.shape == (3, 13, 16) and packed.dtype == torch.int8  # ceil(37 / 16) panels
    want = torch.cat([q, q.new_zeros(48 - 37, 13)]).view(3, 16, 13).transpose(1, 2)
    assert torch.equal(packed, want)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 37])
@pytest.mark.parametrize(("n", "k"), [(37, 13), (17, 29), (5, 3), (53, 101), (149, 773)])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_panels_match_dequantized_reference(rows, n, k, bias, gemv_isa):
    from sublayer.models.quantized_gpt2 import weight_int8_linear_reference

    from ._tol import assert_fast_close

    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g) * 0.02
    b = torch.randn(n, generator=g) if bias else None
    got = _int8_linear(x, q, s, b, n)
    ref64 = (x.double() @ q.double().t()) * s.double() + (0 if b is None else b.double())
    assert_fast_close(got, weight_int8_linear_reference(x, q, s, b), ref64, what=f"rows={rows} n={n} k={k}")


@pytest.mark.parametrize("act", sorted(ACT_IDS))
@pytest.mark.parametrize("rows", [1, 6, 11])
def test_int8_panels_fused_activation(act, rows, gemv_isa):
    from ._tol import assert_fast_close

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 19, generator=g)[:, 2:]  # a column slice: row stride 19, unit inner stride
    q = torch.randint(-127, 128, (23, 17), dtype=torch.int8, generator=g)
    s, b = torch.rand(23, generator=g) * 0.05, torch.randn(23, generator=g)
    got = _int8_linear(x, q, s, b, 23, ACT_IDS[act])
    fn = activation_fn(act)
    ref64 = fn((x.double() @ q.double().t()) * s.double() + b.double())
    assert_fast_close(got, fn(F.linear(x, q.float()) * s + b), ref64, what=act)


def test_int8_panels_reject_bad_inputs():
    q = torch.zeros(5, 3, dtype=torch.int8)
    packed = kernels.ops().pack_linear_weight(q)
    with pytest.raises(RuntimeError, match="act 9 unsupported"):
        kernels.ops().skinny_linear(torch.randn(2, 3), packed, None, 5, 9, torch.ones(5))
    with pytest.raises(RuntimeError, match=r"packed must be \(P, K=4, 16\)"):
        kernels.ops().skinny_linear(torch.randn(2, 4), packed, None, 5, 0, torch.ones(5))
    with pytest.raises(RuntimeError, match="scale must have 5 elements, got 4"):
        kernels.ops().skinny_linear(torch.randn(2, 3), packed, None, 5, 0, torch.ones(4))
    with pytest.raises(RuntimeError, match="float32, float16, bfloat16 or int8"):
        kernels.ops().pack_linear_weight(torch.zeros(5, 3, dtype=torch.float64))


@pytest.mark.parametrize("tiny", [1e-40, 1e-43])
def test_rows_of_subnormal_entries_scale_to_zero(tiny):
    # 1 / max|v| overflows float32 for such a row: int8_scale_rows and the epilogues preparing the next input
    # (scale_row) gave inf and NaN (0 * inf); now r = 1 and zeros, as Int8Linear.prepare's reference (the row
    # quantized as zero; its products are below float32's normal range either way)
    from sublayer.models.quantized import Int8Linear as DynamicInt8Linear

    x, inv, _, _ = _data()
    x[4] *= tiny
    for smooth in (None, inv):
        xs, r = kernels.ops().int8_scale_rows(x, smooth)
        assert r[4].item() == 1.0 and torch.equal(xs[4], torch.zeros(37)) and torch.isfinite(xs).all()
        assert_close(xs[:4], (x[:4] if smooth is None else x[:4] * smooth) / r[:4])
    lin = DynamicInt8Linear(torch.ones(3, 37, dtype=torch.int8), torch.ones(3), None, smooth=1 / inv)
    was = kernels.switched_on()
    kernels.set_enabled(False)
    try:
        xs_ref, r_ref = lin.prepare(x)
    finally:
        kernels.set_enabled(was)
    xs, r = lin.prepare(x)
    assert torch.equal(r_ref[4], torch.ones(1)) and torch.equal(xs_ref[4], torch.zeros(37))
    assert_close((xs, r), (xs_ref, r_ref))
    y = x.abs()  # relu keeps the subnormal row
    h, r2 = kernels.ops().int8_act_rows_(y.clone(), None, None, ACT_IDS["relu"], inv)
    assert r2[4].item() == 1.0 and torch.equal(h[4], torch.zeros(37)) and torch.isfinite(h).all()
    assert_close(h[:4], y[:4] * inv / r2[:4])
    w = torch.full((37,), 1e-41)  # a subnormal norm weight: every normalised row subnormal
    _, xs, r2 = kernels.ops().int8_add_norm_rows_(y.clone(), None, None, torch.zeros_like(y), w, torch.zeros(37), 1e-5, inv)
    assert torch.equal(r2, torch.ones(7, 1)) and torch.equal(xs, torch.zeros(7, 37))
