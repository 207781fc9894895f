"""int8_linear (csrc/packed_linear.cpp): int8 activations quantized per row (or carried at 24 bits) times int8
quad panels, against runtime.linear's PyTorch reference (exact integer sums), with AVX512-VNNI and with the
portable loop."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from sublayer import kernels
from sublayer.functional import activation_fn
from sublayer.functional.fused import ACT_IDS
from hypothesis import given, settings
from hypothesis import strategies as st

from sublayer.runtime.linear import Int8Linear, int8_linear_reference, quantize_rows, quantize_rows24

from ._tol import assert_fast_close

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="C++ kernels unavailable")


@pytest.fixture(params=["vnni", "portable"])
def isa(request):
    """Each test with the AVX-512 (VNNI where compiled in) kernels and with the portable loop."""
    was = kernels.ops().decode_avx512(int(request.param == "vnni"))
    yield request.param
    kernels.ops().decode_avx512(int(was))


def _int8(seed: int, n: int, k: int) -> torch.Tensor:
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["plain", "grouped"])
def layout(request):
    """Each test with the weight in panels of 16 columns and in groups of 48 (pack_int8_quads' two layouts)."""
    return request.param


def _linear(x, q, s, b, act=0, layout="plain", bits=8):
    ops = kernels.ops()
    packed = ops.pack_int8_quads(q, layout == "grouped")
    return ops.int8_linear(x, packed, q.sum(1, dtype=torch.int32), s, b, q.shape[0], act, None, bits)


@needs_kernels
@pytest.mark.parametrize(("n", "width"), [(37, 16), (37, 48), (101, 48)])
def test_pack_int8_quads_layout(n, width):
    q = _int8(0, n, 13)
    packed = kernels.ops().pack_int8_quads(q, grouped=width == 48)
    P = -(-n // width)
    assert packed.shape == (P, 4, width, 4) and packed.dtype == torch.int8
    padded = torch.zeros(P * width, 16, dtype=torch.int8)
    padded[:n, :13] = q
    want = padded.view(P, width, 4, 4).transpose(1, 2)  # [p, i, j, t] = W[width * p + j, 4i + t]
    assert torch.equal(packed, want)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 40])
@pytest.mark.parametrize(("n", "k"), [(37, 13), (17, 29), (5, 3), (53, 101), (149, 773)])
def test_int8_linear_integer_sums_are_exact(rows, n, k, isa, layout):
    # integer x whose rows span [-128, 127] (row scale 1, zero point 128) and unit weight scales: the output is
    # the integer sum itself
    g = torch.Generator().manual_seed(rows * 100 + n)
    q = _int8(n + k, n, k)
    x = torch.randint(-128, 128, (rows, k), generator=g).float()
    x[:, 0] = 127.0
    x[:, -1] = -128.0
    got = _linear(x, q, torch.ones(n), None, layout=layout)
    assert torch.equal(got, (x.long() @ q.long().t()).float())


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 32])
@pytest.mark.parametrize(("n", "k"), [(37, 13), (53, 101), (149, 773)])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_matches_the_pytorch_reference(rows, n, k, bias, isa, layout):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g)
    x[0] = 0.0  # an all-zero row: scale 0, output = bias
    q, s = _int8(n * k, n, k), torch.rand(n, generator=g) * 0.02
    b = torch.randn(n, generator=g) if bias else None
    got = _linear(x, q, s, b, layout=layout)
    want = int8_linear_reference(x, q, s, b)
    xq, sx = quantize_rows(x)
    ref64 = (xq.double() @ q.double().t()) * sx.double() * s.double() + (0 if b is None else b.double())
    assert_fast_close(got, want, ref64, what=f"rows={rows} n={n} k={k}")


@needs_kernels
@pytest.mark.parametrize("act", sorted(ACT_IDS))
def test_int8_linear_fused_activation(act, isa, layout):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 19, generator=g)[:, 2:]  # a column slice
    q, s, b = _int8(4, 23, 17), torch.rand(23, generator=g) * 0.05, torch.randn(23, generator=g)
    fn = activation_fn(act)
    xq, sx = quantize_rows(x)
    ref64 = fn((xq.double() @ q.double().t()) * sx.double() * s.double() + b.double())
    assert_fast_close(_linear(x, q, s, b, ACT_IDS[act], layout), fn(int8_linear_reference(x, q, s, b)), ref64, what=act)


def test_quantize_rows_spans_each_row_and_is_close():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    x[1] = x[1].abs() + 0.5  # all positive: the range starts at 0
    xq, sx = quantize_rows(x)
    assert torch.equal(xq, xq.round()) and (xq.amax(1) - xq.amin(1)).le(255).all()
    span = xq.amax(1).clamp(min=0) - xq.amin(1).clamp(max=0)  # 256 levels over [min(x, 0), max(x, 0)]
    assert span.ge(254).all()  # (less one where both ends round inwards)
    assert ((xq * sx - x).abs() <= sx / 2 * (1 + 1e-5)).all()
    assert xq[1].amin() >= 0 and torch.equal(quantize_rows(torch.zeros(2, 3))[1], torch.zeros(2, 1))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17])
@pytest.mark.parametrize(("n", "k"), [(37, 13), (5, 3), (53, 101), (149, 773)])
def test_int8_linear_24_bits_matches_the_reference_and_float32(rows, n, k, isa, layout):
    """bits=24: each row as 24-bit integers (three uint8 planes through the same kernel, exact integer sums): the
    reference's result, and the float32 product of x and the int8 weight within x's rounding, far inside 8 bits'."""
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]  # rows of every scale
    x[-1, 0] = 1e4 if rows > 1 else x[-1, 0]  # an outlier
    q, s, b = _int8(n + 2 * k, n, k), torch.rand(n, generator=g) * 0.02, torch.randn(n, generator=g)
    got = _linear(x, q, s, b, layout=layout, bits=24)
    t, sx = quantize_rows24(x)
    ref64 = (t @ q.double().t()) * sx * s.double() + b.double()
    assert_fast_close(got, int8_linear_reference(x, q, s, b, bits=24), ref64, what=f"rows={rows} n={n} k={k}")
    exact = x.double() @ (q.double() * s.double()[:, None]).t() + b.double()
    # |x - t s| <= max|x| 2^-22 per entry, plus float32's rounding of the result
    tol = x.abs().amax(1, keepdim=True).double() * 2.0**-22 * (q.double().abs() @ torch.ones(k, 1).double()).t() * s.double()
    assert ((got.double() - exact).abs() <= tol + 4 * 2.0**-24 * exact.abs() + 1e-30).all()
    if rows > 1:  # 8 bits are much coarser on the same rows
        assert (_linear(x, q, s, b, layout=layout).double() - exact).abs().max() > 100 * (got.double() - exact).abs().max()


@needs_kernels
def test_int8_linear_24_bits_zero_tiny_and_non_finite_rows(isa, layout):
    """A zero row gives the bias, rows of denormals or of ~1e-30 their products, a row with inf or NaN NaN
    outputs; the other rows are unaffected; an activation is fused; bits other than 8 and 24 are refused."""
    g = torch.Generator().manual_seed(4)
    q, s, b = _int8(3, 19, 23), torch.rand(19, generator=g) * 0.05, torch.randn(19, generator=g)
    x = torch.randn(5, 23, generator=g)
    x[0] = 0.0
    x[1] = torch.randn(23, generator=g) * 1e-40
    x[2, 3], x[3, 7] = float("inf"), float("nan")
    got = _linear(x, q, s, b, layout=layout, bits=24)
    assert torch.equal(got[0], b) and got[2:4].isnan().all()
    torch.testing.assert_close(got[[1, 4]], int8_linear_reference(x[[1, 4]], q, s, b, bits=24), rtol=1e-6, atol=1e-6)
    small = x[[1]] * 1e10  # ~1e-30: no bias to swamp it, the products far from float32's denormals
    torch.testing.assert_close(_linear(small, q, s, None, layout=layout, bits=24)[0].double(),
                               (small[0].double() @ q.double().t()) * s.double(), rtol=1e-5, atol=0)
    relu = _linear(x[[4]], q, s, b, ACT_IDS["relu"], layout=layout, bits=24)
    torch.testing.assert_close(relu, F.relu(got[[4]]), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="bits must be 8 or 24, got 16"):
        _linear(x, q, s, b, layout=layout, bits=16)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-2.0**100, 2.0**100, allow_nan=False, width=32), min_size=1, max_size=40))
def test_quantize_rows24_is_within_half_a_step_of_x(values):
    """t holds integers of at most 2^22, s is a power of two (0 for a zero row) with max|x| < 2^22 s, and
    |x - t s| <= s / 2."""
    x = torch.tensor([values], dtype=torch.float32)
    t, s = quantize_rows24(x)
    m = float(x.abs().max())
    assert torch.equal(t, t.round()) and float(t.abs().max()) <= 2**22
    if m == 0:
        assert float(s) == 0 and not t.any()
        return
    assert torch.frexp(s).mantissa.item() == 0.5 and m < 2**22 * float(s) <= 2 * m
    assert ((x.double() - t * s).abs() <= s / 2).all()


@pytest.mark.parametrize(("activations", "grouped"), [("int8", False), ("int8", True), ("float", False)])
@pytest.mark.parametrize("kernels_on", [True, False])
def test_int8_linear_class_matches_its_reference(activations, grouped, kernels_on, monkeypatch):
    if kernels_on and not kernels.available():
        pytest.skip("C++ kernels unavailable")
    monkeypatch.setattr(kernels, "_enabled", kernels_on)
    g = torch.Generator().manual_seed(2)
    x, q = torch.randn(7, 41, generator=g), _int8(9, 29, 41)
    s, b = torch.rand(29, generator=g) * 0.03, torch.randn(29, generator=g)
    lin = Int8Linear(q, s, b, activations=activations, grouped=grouped)
    if activations == "int8":
        want = int8_linear_reference(x, q, s, b)
    else:
        want = F.linear(x, q.float()) * s + b
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x, "gelu_tanh"), F.gelu(want, approximate="tanh"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x, "gelu"), F.gelu(want), rtol=1e-5, atol=1e-5)
    # int8 activations stay close to the float product: the per-row rounding error only
    full = F.linear(x, q.float() * s[:, None], b)
    assert F.cosine_similarity(lin(x), full, dim=1).min() > 0.999


@pytest.mark.parametrize("kernels_on", [True, False])
def test_int8_linear_class_carries_a_single_row_at_24_bits(kernels_on, monkeypatch):
    """single_row_bits=24: a call of one row equals the 24-bit reference, several rows the 8-bit one; the step's
    operands are the quads (flat_quads), not panels (flat)."""
    if kernels_on and not kernels.available():
        pytest.skip("C++ kernels unavailable")
    monkeypatch.setattr(kernels, "_enabled", kernels_on)
    g = torch.Generator().manual_seed(8)
    q, s, b = _int8(10, 31, 43), torch.rand(31, generator=g) * 0.03, torch.randn(31, generator=g)
    lin = Int8Linear(q, s, b, grouped=True, single_row_bits=24)
    x = torch.randn(5, 43, generator=g)
    torch.testing.assert_close(lin(x[:1]), int8_linear_reference(x[:1], q, s, b, bits=24), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x), int8_linear_reference(x, q, s, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x[:1], "gelu"), F.gelu(lin(x[:1])), rtol=1e-5, atol=1e-5)
    assert lin.flat() is None and (lin.flat_quads() is not None) == kernels_on
    if kernels_on:
        assert lin.flat_quads()[0].shape[2] == 48 and torch.equal(lin.flat_quads()[3], q.sum(1, dtype=torch.int32))
    weight_only = Int8Linear(q, s, b, activations="float")
    assert weight_only.flat_quads() is None and (weight_only.flat() is not None) == kernels_on
    # one row at 8 bits is not what the one-call step computes: no operands for it
    assert Int8Linear(q, s, b, grouped=True).flat_quads() is None


def test_int8_linear_class_rejects_bad_arguments():
    with pytest.raises(ValueError, match="activations must be 'int8' or 'float', got 'int4'"):
        Int8Linear(torch.zeros(3, 2, dtype=torch.int8), torch.ones(3), activations="int4")
    with pytest.raises(ValueError, match=r"single_row_bits must be 8 or 24 \(24 with int8 activations\), got 16"):
        Int8Linear(torch.zeros(3, 2, dtype=torch.int8), torch.ones(3), single_row_bits=16)
    with pytest.raises(ValueError, match=r"single_row_bits must be 8 or 24 \(24 with int8 activations\), got 24"):
        Int8Linear(torch.zeros(3, 2, dtype=torch.int8), torch.ones(3), activations="float", single_row_bits=24)
    with pytest.raises(TypeError, match="q must be a 2-D int8 tensor"):
        Int8Linear(torch.zeros(3, 2), torch.ones(3))


@pytest.mark.parametrize(("activations", "bits"), [("int8", 8), ("int8", 24), ("float", 8)])
@pytest.mark.parametrize("kernels_on", [True, False])
def test_int8_linear_class_checks_the_inner_size_and_the_vectors(activations, bits, kernels_on, monkeypatch):
    """x's inner size must be q's K exactly, also where ceil(K/4) matches (the int8 kernel sees only that); scale
    and bias are (N,), smooth (K,), checked when the layer is made."""
    if kernels_on and not kernels.available():
        pytest.skip("C++ kernels unavailable")
    monkeypatch.setattr(kernels, "_enabled", kernels_on)
    q, s = _int8(3, 7, 11), torch.rand(7) * 0.03
    lin = Int8Linear(q, s, torch.zeros(7), activations=activations, single_row_bits=bits)
    of_q = r"for q of shape \(N, K\)=\(7, 11\), got "
    for shape in ((1, 9), (3, 10), (3, 12), (11,)):
        with pytest.raises(ValueError, match=r"x must be \(M, K=11\) " + of_q + re.escape(str(shape))):
            lin(torch.randn(shape))
    assert lin(torch.randn(3, 11)).shape == (3, 7)
    with pytest.raises(ValueError, match=r"scale must have shape \(N=7,\) " + of_q + r"\(5,\)"):
        Int8Linear(q, s[:5])
    with pytest.raises(ValueError, match=r"bias must have shape \(N=7,\) " + of_q + r"\(3,\)"):
        Int8Linear(q, s, torch.zeros(3))
    with pytest.raises(ValueError, match=r"smooth must have shape \(K=11,\) " + of_q + r"\(7,\)"):
        Int8Linear(q, s, smooth=torch.ones(7))


@needs_kernels
def test_int8_linear_rejects_a_mismatched_packing():
    q = _int8(0, 17, 5)
    packed = kernels.ops().pack_int8_quads(q)
    with pytest.raises(RuntimeError, match=r"packed must be int8 \(P, ceil\(K/4\)=3, 16 or 48, 4\)"):
        kernels.ops().int8_linear(torch.randn(2, 9), packed, q.sum(1, dtype=torch.int32), torch.ones(17), None, 17)
    with pytest.raises(RuntimeError, match="n=49 does not fit 1 panels of 48"):
        kernels.ops().int8_linear(torch.randn(2, 5), kernels.ops().pack_int8_quads(q, True), torch.zeros(49, dtype=torch.int32), torch.ones(49), None, 49)
    with pytest.raises(RuntimeError, match="colsum must be int32"):
        kernels.ops().int8_linear(torch.randn(2, 5), packed, torch.zeros(17), torch.ones(17), None, 17)


@needs_kernels
def test_int8_linear_24_bits_with_smoothing(isa, layout):
    """bits=24 with inv_smooth: x * inv_smooth is what is carried at 24 bits, as the reference computes it."""
    g = torch.Generator().manual_seed(12)
    q, s, b = _int8(7, 29, 37), torch.rand(29, generator=g) * 0.05, torch.randn(29, generator=g)
    x, inv = torch.randn(3, 37, generator=g), torch.rand(37, generator=g) + 0.5
    ops = kernels.ops()
    got = ops.int8_linear(x, ops.pack_int8_quads(q, layout == "grouped"), q.sum(1, dtype=torch.int32), s, b, 29, 0,
                          inv, 24)  # fmt: skip
    want = int8_linear_reference(x, q, s, b, inv_smooth=inv, bits=24)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, int8_linear_reference(x, q, s, b, bits=24), rtol=1e-3, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("tiny", [1e-40, 1e-37])
def test_int8_linear_rows_of_subnormal_entries_quantize_as_zero(tiny, isa, layout):
    # 255 / range overflows float32 for such a row: the reference gave NaN and the kernel integers of an infinite
    # scale; now both quantize the row as zero (the product is below float32's normal range either way)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 19, generator=g)
    x[0] *= tiny
    q, s, b = _int8(12, 7, 19), torch.rand(7, generator=g) * 0.05, torch.randn(7, generator=g)
    xq, sx = quantize_rows(x)
    assert torch.equal(xq[0], torch.zeros(19)) and torch.isfinite(sx).all()
    want = int8_linear_reference(x, q, s, b)
    assert torch.equal(want[0], b)
    torch.testing.assert_close(_linear(x, q, s, b, layout=layout), want)
    torch.testing.assert_close(_linear(x, q, s, None, layout=layout)[0], torch.zeros(7), atol=1e-36, rtol=0)


@needs_kernels
@pytest.mark.parametrize("at", [(3, 7), (17, 18)], ids=["vector-part", "tail"])
def test_int8_linear_rows_whose_range_overflows_float32(at, isa, layout):
    # entries near -FLT_MAX and +FLT_MAX: hi - lo overflowed float32, so the scale was inf and every integer 0, the
    # outputs NaN (reference and kernel). Now the range in float64: a finite scale, the row dequantized to within
    # half a step, the outputs of the product's sign (+-inf here: the integer sums times the row's scale exceed
    # float32 before the weights' scales multiply)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(3, 19, generator=g)
    x[0, at[0]], x[0, at[1]] = 3e38, -2.5e38
    xq, sx = quantize_rows(x)
    assert torch.isfinite(sx).all() and torch.isfinite(xq).all()
    assert ((xq[0].double() * sx[0].double() - x[0].double()).abs() <= sx[0].double() * (0.5 + 1e-6)).all()
    q, s, b = _int8(14, 7, 19), torch.rand(7, generator=g) * 0.05, torch.randn(7, generator=g)
    want = int8_linear_reference(x, q, s, b)
    assert not want.isnan().any() and torch.isinf(want[0]).any()
    exact = F.linear(x.double(), q.double() * s.double()[:, None])
    assert torch.equal(want[0].sign(), exact[0].sign())
    torch.testing.assert_close(_linear(x, q, s, b, layout=layout), want)
