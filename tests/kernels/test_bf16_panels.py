"""skinny_linear on bfloat16 panels and compact bfloat16 panels (csrc/packed_linear.cpp) against F.linear on the bf16
weight widened to float32, on every micro-kernel this CPU can run: AVX2, AVX-512 widening the weights, AVX-512 with
vdpbf16ps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sublayer import kernels
from sublayer.functional import activation_fn
from sublayer.functional.fused import ACT_IDS
from sublayer.runtime.linear import PackedLinear, compact_bf16, compact_kernels

from ._tol import assert_fast_close

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels unavailable")


def _ops():
    return kernels.ops()


def _has_dot() -> bool:
    was = _ops().decode_bf16_dot(1)
    on = _ops().decode_bf16_dot(-1)
    _ops().decode_bf16_dot(int(was))
    return on


@pytest.fixture(params=["avx512-dot", "avx512", "avx2"])
def path(request):
    """Each test on the AVX-512 kernels with vdpbf16ps (where compiled in), widening, and on the AVX2 kernels.
    Yields whether several rows round x to bf16 (the vdpbf16ps path)."""
    if request.param == "avx512-dot" and not (_has_dot() and _ops().decode_avx512(-1)):
        pytest.skip("no AVX512_BF16 kernels compiled in")
    was_avx, was_dot = _ops().decode_avx512(int(request.param != "avx2")), _ops().decode_bf16_dot(-1)
    _ops().decode_bf16_dot(int(request.param == "avx512-dot"))
    yield request.param == "avx512-dot"
    _ops().decode_avx512(int(was_avx))
    _ops().decode_bf16_dot(int(was_dot))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _x_as_multiplied(x: torch.Tensor, dot: bool) -> torch.Tensor:
    """x as the kernel multiplies it: rounded to bf16 for several rows on the vdpbf16ps path, else as is."""
    return x.bfloat16().float() if dot and x.shape[0] > 1 else x


def test_pack_bf16_layout_interleaves_k_pairs_zero_padded():
    w = torch.randn(37, 13, generator=_gen(0)).bfloat16()
    packed = _ops().pack_linear_weight(w)
    assert packed.shape == (3, 7, 16, 2) and packed.dtype == torch.bfloat16  # ceil(37/16) panels, ceil(13/2) pairs
    padded = torch.zeros(48, 14, dtype=torch.bfloat16)
    padded[:37, :13] = w
    want = padded.view(3, 16, 7, 2).transpose(1, 2)  # [p, i, j, t] = W[16p + j, 2i + t]
    assert torch.equal(packed, want)


# the two panel layouts of a bf16 weight: bf16 pairs, and compact with a table that leaves many exceptions
PACKINGS = {
    "bf16": lambda w: _ops().pack_linear_weight(w),
    "compact": lambda w: _ops().pack_compact_bf16(w, _table(0x3C, 0xBC, 0x3B, 0xBB, 0x3A, 0xBA)),
}


@pytest.mark.parametrize("packing", sorted(PACKINGS))
@pytest.mark.parametrize(("n", "k"), [(37, 13), (17, 29), (5, 3), (53, 101), (131, 64), (48, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_panels_match_f_linear_on_the_widened_weight(n, k, bias, path, packing):
    g = _gen(n * 100 + k)
    w = _special_weight(n, k, n + k)
    w[w.float().abs() > 1e4] = 0.5  # finite results to compare
    b = torch.randn(n, generator=g) if bias else None
    packed = PACKINGS[packing](w)
    for rows in range(1, 41):
        x = _x_as_multiplied(torch.randn(rows, k, generator=g), path)
        got = _ops().skinny_linear(x, packed, b, n)
        ref64 = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert_fast_close(got, F.linear(x, w.float(), b), ref64, what=f"rows={rows} n={n} k={k}")


@pytest.mark.parametrize("packing", sorted(PACKINGS))
@pytest.mark.parametrize("act", sorted(ACT_IDS))
@pytest.mark.parametrize("rows", [1, 6, 11])
def test_panels_fused_activation(act, rows, path, packing):
    g = _gen(rows + 7)
    x = torch.randn(rows, 19, generator=g)[:, 2:]  # a column slice: row stride 19, unit inner stride
    w = _special_weight(23, 17, rows) * 25  # std 0.5
    w[w.float().abs() > 1e4] = -0.25
    b = torch.randn(23, generator=g)
    got = _ops().skinny_linear(x, PACKINGS[packing](w), b, 23, ACT_IDS[act])
    xm, fn = _x_as_multiplied(x, path), activation_fn(act)
    ref64 = fn(F.linear(xm.double(), w.double(), b.double()))
    assert_fast_close(got, fn(F.linear(xm, w.float(), b)), ref64, what=act)


def test_widening_keeps_x_in_float32_and_vdpbf16ps_rounds_it():
    # x with bits below bf16's precision: widening multiplies them, the vdpbf16ps path rounds them off
    g = _gen(5)
    w = torch.randn(16, 32, generator=g).bfloat16()
    x = torch.full((4, 32), 1.0 + 2.0**-12)
    exact, rounded = F.linear(x, w.float()), F.linear(x.bfloat16().float(), w.float())
    assert not torch.allclose(exact, rounded, rtol=0, atol=1e-6)
    packed = _ops().pack_linear_weight(w)
    was = _ops().decode_bf16_dot(0)
    try:
        torch.testing.assert_close(_ops().skinny_linear(x, packed, None, 16), exact)
        if _has_dot() and _ops().decode_avx512(-1):
            _ops().decode_bf16_dot(1)
            torch.testing.assert_close(_ops().skinny_linear(x, packed, None, 16), rounded)
    finally:
        _ops().decode_bf16_dot(int(was))


@pytest.mark.parametrize("k", [67, 31, 97])
def test_x_is_rounded_to_bf16_as_torch_rounds_it(k, path):
    # an identity weight: each output is one x times 1, exact, so y shows the bits x was multiplied with; x holds
    # ties to even both ways (1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6), the values either side of them, both signs
    # and large magnitudes, in the vectorised pairs (k < 32 * (k // 32)) and the odd tail
    g = _gen(k)
    ties = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20, 1 + 2.0**-8 - 2.0**-20, 3.0e38, 7.0])
    x = torch.randn(5, k, generator=g) * 100
    x.view(-1)[torch.randperm(5 * k, generator=g)[: 5 * 12]] = torch.cat([ties, -ties]).repeat(5)
    got = _ops().skinny_linear(x, _ops().pack_linear_weight(torch.eye(k).bfloat16()), None, k)
    assert torch.equal(got, _x_as_multiplied(x, path))


def test_bf16_panels_reject_a_mismatched_packing():
    packed = _ops().pack_linear_weight(torch.randn(17, 5).bfloat16())
    with pytest.raises(RuntimeError, match=r"bfloat16 packed must be \(P, ceil\(K/2\)=4, 16, 2\)"):
        _ops().skinny_linear(torch.randn(2, 7), packed, None, 17)
    with pytest.raises(RuntimeError, match="a scale"):
        _ops().skinny_linear(torch.randn(2, 5), packed, None, 17, 0, torch.ones(17))


# ------------------------------------------------------------------ compact bf16 panels (pack_compact_bf16)
def _table(*high: int) -> torch.Tensor:
    """A compact table: 0x00, then the given high bytes, padded with 0x00 to 16 entries."""
    return torch.tensor([0, *high] + [0] * (15 - len(high)), dtype=torch.uint8)


def _special_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian weights (std 0.02, as GPT-2's) with zeros, -0, tiny, subnormal, large, outlier and infinite ones:
    exceptions of every kind, at random places."""
    g = _gen(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    odd = torch.tensor([0.0, -0.0, 1e-30, -1e-39, 3.0e38, -7.5, 2.0**-126, 1e-8, float("inf"), -float("inf")])
    w.view(-1)[torch.randperm(n * k, generator=g)[: len(odd)]] = odd[: min(len(odd), n * k)]
    return w.bfloat16()


def _columns(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """W (n, k) as the kernel multiplies it, read through one-hot rows of x: each output is one weight times 1."""
    return torch.cat([_ops().skinny_linear(e[None], packed, None, n) for e in torch.eye(k)]).t()


@pytest.mark.parametrize(("n", "k"), [(37, 13), (17, 29), (5, 3), (16, 4), (53, 101), (33, 6)])
def test_compact_panels_are_lossless(n, k, path):
    w = _special_weight(n, k, n * 7 + k)
    packed = compact_bf16(w) if n * k >= 256 * 10 else _ops().pack_compact_bf16(w, _table(0x3C, 0xBC, 0x3B, 0xBB))
    got, plain = _columns(packed, n, k), _columns(_ops().pack_linear_weight(w), n, k)
    torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True)  # a row with an inf reads NaN in both
    finite = torch.isfinite(w.float()).all(dim=1)
    assert finite.sum() >= n - 2 and torch.equal(got[finite], w.float()[finite])  # -0 reads +0 (0 * 1 + -0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 2**31 - 1), st.lists(st.integers(1, 255), max_size=15))
def test_compact_round_trip_of_any_bits(n, k, seed, high):
    # any 16-bit patterns but NaN and inf (their products with the one-hot rows' zeros are NaN either way), any table
    bits = torch.randint(-(2**15), 2**15, (n, k), generator=_gen(seed), dtype=torch.int32).to(torch.int16)
    w = bits.view(torch.bfloat16)
    w[~torch.isfinite(w.float())] = 1.0
    packed = _ops().pack_compact_bf16(w.contiguous(), _table(*high))
    in_table = torch.isin((w.view(torch.int16).int() >> 8) & 0xFF, torch.tensor([0, *high]))
    p = (n + 15) // 16  # panels, in groups of 4 steps of 96 bytes, then the table and the offsets
    base = (p + 3) // 4 * 4 * ((k + 3) // 4) * 96 + 64 + 4 * (p + 1)
    assert packed.numel() == base + 8 * int((~in_table).sum())  # one exception per weight outside the table
    assert torch.equal(_columns(packed, n, k), w.float())


def test_compact_bf16_keeps_bf16_panels_when_exceptions_are_many():
    w = (torch.randn(64, 64, generator=_gen(3)) * torch.logspace(-30, 30, 64)).bfloat16()  # 60 decades of scale
    assert compact_bf16(w) is None
    w = (torch.randn(64, 64, generator=_gen(3)) * 0.02).bfloat16()
    assert compact_bf16(w).dtype == torch.uint8


def test_packed_linear_picks_compact_bf16_panels_where_their_kernels_are_compiled():
    w = torch.randn(40, 24, generator=_gen(4)) * 0.02
    assert PackedLinear(w, dtype=torch.bfloat16).packed.dtype == (torch.uint8 if compact_kernels() else torch.bfloat16)
    assert PackedLinear(w, dtype=torch.bfloat16, compact=False).packed.dtype == torch.bfloat16
    assert PackedLinear(w, dtype=torch.float32).packed.dtype == torch.float32
    x = torch.randn(3, 24, generator=_gen(5))
    torch.testing.assert_close(
        PackedLinear(w, dtype=torch.bfloat16, compact=True)(x[:1]), PackedLinear(w, dtype=torch.bfloat16, compact=False)(x[:1])
    )


def test_compact_pack_and_skinny_reject_bad_input():
    w = torch.randn(17, 5).bfloat16()
    with pytest.raises(RuntimeError, match="table must be 16 uint8 high bytes, the first 0"):
        _ops().pack_compact_bf16(w, torch.arange(16, dtype=torch.uint8).flip(0))
    with pytest.raises(RuntimeError, match="weight must be a contiguous 2-D bfloat16"):
        _ops().pack_compact_bf16(w.float(), _table())
    packed = _ops().pack_compact_bf16(torch.ones(17, 5).bfloat16(), _table(0x3F))  # no exceptions
    with pytest.raises(RuntimeError, match=r"compact packed must be pack_compact_bf16's bytes of an \(n=17, K=9\)"):
        _ops().skinny_linear(torch.randn(2, 9), packed, None, 17)
    with pytest.raises(RuntimeError, match=r"compact packed holds an \(17, 5\) weight, not \(n=17, K=7\)"):
        _ops().skinny_linear(torch.randn(2, 7), packed, None, 17)  # as many steps of 4 as K = 5
    with pytest.raises(RuntimeError, match=r"compact packed holds an \(17, 5\) weight, not \(n=20, K=5\)"):
        _ops().skinny_linear(torch.randn(2, 5), packed, None, 20)  # as many panels as n = 17
    with pytest.raises(RuntimeError, match="compact panels take no scale"):
        _ops().skinny_linear(torch.randn(2, 5), packed, None, 17, 0, torch.ones(17))
    end = 4 * 2 * 96 + 64 + 4 * 3  # a group of 4 panels of 2 steps, the table, the offsets: off[P] is the last int32
    damaged = packed.clone()
    damaged[end - 4 : end] = 9
    with pytest.raises(RuntimeError, match="compact packed is damaged"):
        _ops().skinny_linear(torch.randn(2, 5), damaged, None, 17)
    # exceptions (a weight of 0.5 with two entries outside its table): an offset between them out of order, and an
    # exception's k past K; each would make the kernels read out of bounds
    w = torch.full((17, 5), 0.5).bfloat16()
    w[3, 2], w[16, 4] = 100.0, -1e-20
    packed = _ops().pack_compact_bf16(w, _table(0x3F))
    offsets = end - 12  # off[0..2] of the 2 panels
    assert packed[offsets : offsets + 12].view(torch.int32).tolist() == [0, 1, 2]
    for where, value in ((offsets + 4, 7), (end, 200)):  # off[1] = 7; the first exception's k * 16 + j = 200
        damaged = packed.clone()
        damaged[where : where + 4] = torch.tensor([value], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(RuntimeError, match=r"compact packed is damaged \(its exception list\)"):
            _ops().skinny_linear(torch.randn(1, 5), damaged, None, 17)


def test_compact_panels_with_infinite_activations_equal_bf16_panels(path):
    # an exception is stored as 0 and added in the epilogue, where 0 * inf would be NaN: rows with a non-finite
    # entry take the unpacked panels, exceptions in place
    w = torch.full((16, 8), 0.5).bfloat16()
    w[3, 2], w[5, 6] = 100.0, -1e-20  # outside the table
    x = torch.randn(3, 8, generator=_gen(9))
    x[:, 2], x[1, 6] = float("inf"), -float("inf")
    big = torch.full((3, 8), 3.4e38)  # finite in float32, infinite once rounded to bf16 (several rows: vdpbf16ps)
    for xs in (x, big):
        got = _ops().skinny_linear(xs, _ops().pack_compact_bf16(w, _table(0x3F)), None, 16)
        want = _ops().skinny_linear(xs, _ops().pack_linear_weight(w), None, 16)
        torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.isinf(got[:, 3]).all()


def test_compact_panels_of_an_empty_weight():
    for n, k in ((0, 5), (3, 0)):
        w = torch.zeros(n, k, dtype=torch.bfloat16)
        b = torch.randn(n, generator=_gen(n + k))
        got = _ops().skinny_linear(torch.randn(2, k), _ops().pack_compact_bf16(w, _table()), b, n)
        assert torch.equal(got, b.expand(2, n))
