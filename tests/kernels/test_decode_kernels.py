"""Decoding kernels (csrc/packed_linear.cpp, attention.cpp): skinny_linear on packed weights vs F.linear,
decode_attention vs SDPA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer import kernels

from ._tol import assert_fast_close

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels unavailable")


def _ops():
    return kernels.ops()


@pytest.fixture(params=["avx512", "avx2"])
def micro_kernel(request):
    """Each test with the AVX-512 several-row micro-kernels (where compiled in) and with the AVX2 ones."""
    was = _ops().decode_avx512(int(request.param == "avx512"))
    yield request.param
    _ops().decode_avx512(int(was))


@pytest.fixture(params=["avx512", "avx2"])
def attention_isa(request):
    """Each attention test with the 16-lane head loops (where compiled in) and with the 8-lane ones."""
    was = _ops().attention_avx512(int(request.param == "avx512"))
    yield request.param
    _ops().attention_avx512(int(was))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_pack_layout_is_panels_of_16_columns_zero_padded():
    w = torch.randn(37, 13, generator=_gen(0))
    packed = _ops().pack_linear_weight(w)
    assert packed.shape == (3, 13, 16)  # ceil(37 / 16) panels
    want = torch.cat([w, w.new_zeros(48 - 37, 13)]).view(3, 16, 13).transpose(1, 2)
    assert torch.equal(packed, want)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 11, 16, 19, 32])
@pytest.mark.parametrize(("n", "k"), [(37, 13), (17, 29), (5, 3), (53, 101)])
@pytest.mark.parametrize("bias", [True, False])
def test_skinny_linear_matches_f_linear(rows, n, k, bias, micro_kernel):
    g = _gen(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = _ops().skinny_linear(x, _ops().pack_linear_weight(w), b, n)
    ref64 = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert_fast_close(got, F.linear(x, w, b), ref64, what=f"rows={rows} n={n} k={k}")


@pytest.mark.parametrize(("act", "fn"), [(1, F.relu), (3, lambda t: F.gelu(t, approximate="tanh"))])
@pytest.mark.parametrize("rows", [1, 6])
def test_skinny_linear_fused_activation(act, fn, rows, micro_kernel):
    g = _gen(act + rows)
    x = torch.randn(rows, 19, generator=g)
    w = torch.randn(23, 19, generator=g) * 0.5
    b = torch.randn(23, generator=g)
    got = _ops().skinny_linear(x, _ops().pack_linear_weight(w), b, 23, act)
    assert_fast_close(got, fn(F.linear(x, w, b)), fn(F.linear(x.double(), w.double(), b.double())), what=f"act {act}")


def test_skinny_linear_rejects_unknown_activation():
    with pytest.raises(RuntimeError, match="act 6 unsupported"):
        _ops().skinny_linear(torch.randn(1, 3), _ops().pack_linear_weight(torch.randn(4, 3)), None, 4, 6)


def test_skinny_linear_takes_a_column_slice():
    # q/k/v come out of one (B, 3d) tensor: x may have a row stride wider than its width
    g = _gen(3)
    wide = torch.randn(5, 3 * 11, generator=g)
    x = wide[:, 11:22]
    w = torch.randn(7, 11, generator=g)
    assert_close(_ops().skinny_linear(x, _ops().pack_linear_weight(w), None, 7), F.linear(x.contiguous(), w))


def test_skinny_linear_rejects_mismatched_packing():
    packed = _ops().pack_linear_weight(torch.randn(17, 5))
    with pytest.raises(RuntimeError, match=r"packed must be \(P, K=7"):
        _ops().skinny_linear(torch.randn(2, 7), packed, None, 17)
    with pytest.raises(RuntimeError, match="does not fit"):
        _ops().skinny_linear(torch.randn(2, 5), packed, None, 40)


def _sdpa(q, k, v, length, mask):
    b, h, _, hd = k.shape
    am = None if mask is None else ~mask[:, None, None, :length]
    out = F.scaled_dot_product_attention(
        q.reshape(b, h, 1, hd), k[:, :, :length], v[:, :, :length], attn_mask=am, scale=1 / math.sqrt(hd)
    )
    return out.reshape(b, h * hd)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.usefixtures("attention_isa")
def test_decode_attention_writes_the_new_position_and_matches_sdpa(masked):
    g = _gen(7)
    b, h, cap, hd, length = 3, 2, 11, 5, 7
    k = torch.randn(b, h, cap, hd, generator=g)
    v = torch.randn(b, h, cap, hd, generator=g)
    qkv = torch.randn(b, 3 * h * hd, generator=g)
    d = h * hd
    q, nk, nv = qkv[:, :d], qkv[:, d : 2 * d], qkv[:, 2 * d :]
    mask = None
    if masked:
        mask = torch.zeros(b, cap, dtype=torch.bool)
        mask[0, :3] = True  # left padding
        mask[2, 1] = True
    k_ref, v_ref = k.clone(), v.clone()
    k_ref[:, :, length - 1] = nk.reshape(b, h, hd)
    v_ref[:, :, length - 1] = nv.reshape(b, h, hd)
    got = _ops().decode_attention(q, k, v, mask, length, 1 / math.sqrt(hd), nk, nv)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # written in place
    ref64 = _sdpa(q.double(), k_ref.double(), v_ref.double(), length, mask)
    assert_fast_close(got, _sdpa(q, k_ref, v_ref, length, mask), ref64)


@pytest.mark.usefixtures("attention_isa")
def test_decode_attention_fully_masked_row_gives_zeros():
    k = torch.randn(2, 1, 4, 3)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1] = True
    out = _ops().decode_attention(torch.randn(2, 3), k, torch.randn(2, 1, 4, 3), mask, 4, 1.0, None, None)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros(3))


def test_decode_attention_rejects_bad_length():
    k = torch.randn(1, 1, 4, 3)
    with pytest.raises(RuntimeError, match=r"length 5 outside \[1, 4\]"):
        _ops().decode_attention(torch.randn(1, 3), k, k.clone(), None, 5, 1.0, None, None)


# 8-lane loops: scalar; one vector; 4; 8 + 1; 8 + 8 + 1 accumulators. 16-lane: 1, 3, 4, 4 + 1, 4 + 4 + 1
@pytest.mark.parametrize("hd", [5, 8, 16, 32, 48, 64, 72, 80, 136, 144])
@pytest.mark.usefixtures("attention_isa")
def test_decode_attention_head_sizes_and_lengths(hd):
    g = _gen(hd)
    b, h, cap = 2, 3, 19
    k = torch.randn(b, h, cap, hd, generator=g)
    v = torch.randn(b, h, cap, hd, generator=g)
    q = torch.randn(b, h * hd, generator=g)
    for length in (1, 3, 4, 5, 8, 9, 13, 16, 17, 19):  # the four- and eight-key blocks' and the 8-wide exp's tails
        got = _ops().decode_attention(q, k, v, None, length, 1 / math.sqrt(hd), None, None)
        ref64 = _sdpa(q.double(), k.double(), v.double(), length, None)
        assert_fast_close(got, _sdpa(q, k, v, length, None), ref64, what=f"hd {hd} length {length}")


def _gathered(k: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """(B, H, T, hd) caches read through a (N, T) row table -> (N, H, length, hd), by a plain loop."""
    out = torch.empty(rows.shape[0], k.shape[1], length, k.shape[3], dtype=k.dtype)
    for n in range(rows.shape[0]):
        for j in range(length):
            out[n, :, j] = k[rows[n, j], :, j]
    return out


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.usefixtures("attention_isa")
def test_decode_attention_reads_keys_through_a_row_table(masked):
    g = _gen(3)
    b, n, h, cap, hd, length = 3, 5, 2, 11, 8, 7
    k = torch.randn(b, h, cap, hd, generator=g)
    v = torch.randn(b, h, cap, hd, generator=g)
    q = torch.randn(n, h * hd, generator=g)
    rows = torch.randint(0, b, (n, cap), generator=g)
    rows[1] = 2  # one query row whose keys all sit in one cache row (read in place, no gather)
    mask = None
    if masked:
        mask = torch.zeros(n, cap, dtype=torch.bool)
        mask[0, :2] = True
        mask[4, 3] = True
    got = _ops().decode_attention(q, k, v, mask, length, 1 / math.sqrt(hd), None, None, rows)
    kg, vg = _gathered(k, rows, length), _gathered(v, rows, length)
    ref64 = _sdpa(q.double(), kg.double(), vg.double(), length, mask)
    assert_fast_close(got, _sdpa(q, kg, vg, length, mask), ref64)


@pytest.mark.parametrize(
    "b,histories",
    [
        (4, [2, 2, 0, 1]),  # reordered beams: every row carries another row's history
        (5, [4, 1, 3]),  # a compacted batch (3 of 5 rows still running) that kept their histories
        (211, list(range(210, -1, -1))),  # heads enough for both threads, each writing the heads it reads
    ],
)
@pytest.mark.usefixtures("attention_isa")
def test_decode_attention_writes_in_the_own_row_and_reads_through_the_table(b, histories):
    g = _gen(b)
    n, h, cap, hd, length = len(histories), 2, 6, 8, 5
    k = torch.randn(b, h, cap, hd, generator=g)
    v = torch.randn(b, h, cap, hd, generator=g)
    qkv = torch.randn(n, 3 * h * hd, generator=g)
    d = h * hd
    rows = torch.arange(n)[:, None].repeat(1, cap)
    rows[:, : length - 1] = torch.tensor(histories)[:, None]
    k_ref, v_ref = k.clone(), v.clone()
    k_ref[:n, :, length - 1] = qkv[:, d : 2 * d].reshape(n, h, hd)  # query row i writes cache row i
    v_ref[:n, :, length - 1] = qkv[:, 2 * d :].reshape(n, h, hd)
    got = _ops().decode_attention(qkv[:, :d], k, v, None, length, 1 / math.sqrt(hd), qkv[:, d : 2 * d],
                                  qkv[:, 2 * d :], rows)  # fmt: skip
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    kg, vg = _gathered(k_ref, rows, length), _gathered(v_ref, rows, length)
    ref64 = _sdpa(qkv[:, :d].double(), kg.double(), vg.double(), length, None)
    assert_fast_close(got, _sdpa(qkv[:, :d], kg, vg, length, None), ref64)


def test_decode_attention_rejects_bad_row_tables():
    k = torch.randn(2, 1, 4, 8)
    q = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"q has 3 rows but the caches 2 \(pass rows"):
        _ops().decode_attention(q, k, k.clone(), None, 2, 1.0, None, None)
    bad = torch.zeros(3, 4, dtype=torch.long)
    bad[2, 1] = 2
    with pytest.raises(RuntimeError, match=r"rows\[2, 1\] = 2 is not a cache row in \[0, 2\)"):
        _ops().decode_attention(q, k, k.clone(), None, 2, 1.0, None, None, bad)
    with pytest.raises(RuntimeError, match=r"rows must be a contiguous int64 \(N=3, T_max=4\)"):
        _ops().decode_attention(q, k, k.clone(), None, 2, 1.0, None, None, bad.int())
    own = torch.zeros(2, 4, dtype=torch.long)  # row 1's new key would land in row 0's history
    with pytest.raises(RuntimeError, match=r"rows\[1, 1\] must be 1"):
        _ops().decode_attention(q[:2], k, k.clone(), None, 2, 1.0, q[:2], q[:2], own)


@pytest.mark.parametrize("hd", [5, 8, 24, 48])  # the scalar loops; one vector; three vectors per key (8 or 16 lanes)
@pytest.mark.parametrize("h_kv", [3, 1])  # one query head per key/value head; grouped-query (3 per head)
@pytest.mark.parametrize("table", [False, True])
@pytest.mark.usefixtures("attention_isa")
def test_decode_attention_bfloat16_caches_equal_float32_on_the_rounded_caches(hd, h_kv, table):
    """bfloat16 caches: the new key/value rounded to bfloat16 (as ``.to(torch.bfloat16)``) and the output that of
    the float32 kernel over the widened caches (float32 arithmetic, up to the order of a sum), with padding, an
    all-masked row (zeros), grouped-query heads and a row table."""
    g = _gen(hd * 7 + h_kv)
    b, h, cap = 3, 3, 13
    k = torch.randn(b, h_kv, cap, hd, generator=g).bfloat16()
    v = torch.randn(b, h_kv, cap, hd, generator=g).bfloat16()
    mask = torch.zeros(b, cap, dtype=torch.bool)
    mask[0, :3] = True  # left padding
    mask[1] = True  # every key masked: zeros
    for length in (1, 4, 6, 9, 11):  # the four- and eight-key blocks' and the 8-wide exp's tails
        rows = None
        if table:
            rows = torch.arange(b)[:, None].repeat(1, cap)
            rows[0, : min(4, length - 1)] = 2  # row 0 reads its earlier keys from cache row 2
        q = torch.randn(b, h * hd, generator=g)
        nk, nv = torch.randn(b, h_kv * hd, generator=g), torch.randn(b, h_kv * hd, generator=g)
        k32, v32 = k.float(), v.float()
        want = _ops().decode_attention(q, k32, v32, mask, length, 1 / math.sqrt(hd), nk.bfloat16().float(),
                                       nv.bfloat16().float(), rows)  # fmt: skip
        got = _ops().decode_attention(q, k, v, mask, length, 1 / math.sqrt(hd), nk, nv, rows)
        assert torch.equal(k[:, :, length - 1], nk.view(b, h_kv, hd).to(torch.bfloat16))
        assert torch.equal(v[:, :, length - 1], nv.view(b, h_kv, hd).to(torch.bfloat16))
        assert torch.equal(k.float(), k32) and torch.equal(v.float(), v32)
        assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"length {length}")  # summation order only
        assert torch.equal(got[1], torch.zeros(h * hd))


def test_decode_attention_rejects_mixed_or_other_cache_dtypes():
    q, k = torch.randn(1, 8), torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match=r"v_cache must have k_cache's dtype Float, got BFloat16"):
        _ops().decode_attention(q, k, k.bfloat16(), None, 2, 1.0, None, None)
    with pytest.raises(RuntimeError, match=r"k_cache must be a contiguous 4-D float32 or bfloat16 CPU tensor, got Ha"):
        _ops().decode_attention(q, k.half(), k.half(), None, 2, 1.0, None, None)
    with pytest.raises(RuntimeError, match=r"new_k/new_v must be float32"):
        _ops().decode_attention(q, k.bfloat16(), k.bfloat16(), None, 2, 1.0, q.bfloat16(), q.bfloat16())


def _qkv_sdpa(qkv: torch.Tensor, mask, b: int, s: int, h: int) -> torch.Tensor:
    """Reference: (B*S, 3*d) fused projection -> SDPA per sequence with the key padding mask, padded rows zeroed."""
    d = qkv.shape[1] // 3
    q, k, v = (t.reshape(b, s, h, d // h).transpose(1, 2) for t in qkv.split(d, dim=1))
    am = None if mask is None else ~mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=am).transpose(1, 2).reshape(b * s, d)
    return out if mask is None else out.masked_fill(mask.reshape(-1, 1), 0.0)


@pytest.mark.parametrize("hd", [5, 8, 32, 48])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.usefixtures("attention_isa")
def test_qkv_self_attention_matches_sdpa(hd, masked):
    g = _gen(hd)
    b, s, h = 3, 7, 2
    qkv = torch.randn(b * s, 3 * h * hd + 4, generator=g)[:, 2 : 2 + 3 * h * hd]  # a column slice works
    mask = None
    if masked:
        mask = torch.zeros(b, s, dtype=torch.bool)
        mask[0, 4:] = True  # right padding
        mask[2, 1:] = True  # one real token
    got = _ops().qkv_self_attention(qkv, mask, h, s, 1 / math.sqrt(hd))
    ref64 = _qkv_sdpa(qkv.double(), mask, b, s, h)
    assert_fast_close(got, _qkv_sdpa(qkv, mask, b, s, h), ref64)
    if masked:
        assert torch.equal(got[mask.reshape(-1)], torch.zeros(int(mask.sum()), h * hd))


@pytest.mark.parametrize("hd", [5, 8, 32, 48])
@pytest.mark.usefixtures("attention_isa")
def test_qkv_self_attention_causal_matches_sdpa(hd):
    g = _gen(hd + 1)
    b, s, h = 3, 11, 2
    qkv = torch.randn(b * s, 3 * h * hd, generator=g)
    got = _ops().qkv_self_attention(qkv, None, h, s, 1 / math.sqrt(hd), True)

    def ref(t):
        q, k, v = t.view(b, s, 3, h, hd).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b * s, h * hd)

    assert_fast_close(got, ref(qkv), ref(qkv.double()))
    assert torch.equal(got.view(b, s, -1)[:, 0], qkv.view(b, s, 3, -1)[:, 0, 2])  # the first query sees itself only
    # bfloat16: the widened values' float32 attention, rounded once
    q16 = qkv.bfloat16()
    got16 = _ops().qkv_self_attention(q16, None, h, s, 1 / math.sqrt(hd), True)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), ref(q16.double()).float(), rtol=2**-8, atol=1e-5)  # one rounding


def test_qkv_self_attention_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match=r"is not \(B\*4, 3\*2\*head_dim\)"):
        _ops().qkv_self_attention(torch.randn(10, 12), None, 2, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"mask must be a contiguous bool \(2, 4\)"):
        _ops().qkv_self_attention(torch.randn(8, 12), torch.zeros(2, 5, dtype=torch.bool), 2, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"qkv must be a float32 or bfloat16 matrix with unit inner stride, got Half"):
        _ops().qkv_self_attention(torch.randn(8, 12).half(), None, 2, 4, 1.0, True)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_skinny_linear_on_float16_panels_matches_the_widened_weight(rows, micro_kernel):
    g = _gen(rows + 77)
    w, x, b = torch.randn(53, 29, generator=g), torch.randn(rows, 29, generator=g), torch.randn(53, generator=g)
    packed = _ops().pack_linear_weight(w.half())
    assert packed.dtype == torch.float16 and packed.shape == (4, 29, 16)
    got = _ops().skinny_linear(x, packed, b, 53)
    assert_close(got, F.linear(x, w.half().float(), b))  # float16 widened exactly, float32 accumulation


def test_pack_linear_weight_rejects_other_dtypes():
    with pytest.raises(RuntimeError, match="float32, float16, bfloat16 or int8"):
        _ops().pack_linear_weight(torch.randn(4, 3, dtype=torch.float64))


@pytest.mark.parametrize("rows", [1, 3])
def test_skinny_linear_on_int8_panels_applies_the_column_scale(rows, micro_kernel):
    g = _gen(rows + 5)
    q = torch.randint(-127, 128, (149, 3001), generator=g, dtype=torch.int8)
    scale, b = torch.rand(149, generator=g) * 0.01, torch.randn(149, generator=g)
    x = torch.randn(rows, 3001, generator=g)
    packed = _ops().pack_linear_weight(q)
    got = _ops().skinny_linear(x, packed, b, 149, 3, scale)
    want = F.gelu(F.linear(x.double(), q.double() * scale.double()[:, None], b.double()), approximate="tanh")
    bound = 3001 * 2.0**-24 * (x.double().abs() @ q.double().abs().T * scale.double()).max().item()
    assert_close(got.double(), want, atol=bound + 1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="a scale"):
        _ops().skinny_linear(x, packed, b, 149, 0)  # int8 panels without their scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 13])
@pytest.mark.parametrize("n", [149, 133])
def test_skinny_linear_over_several_chunks_of_panels(n, rows, dtype, micro_kernel):
    # K = 3001: a panel is ~190 KB, so the 10 (9) panels form chunks of 4, 4 and 2 (1): one row reads four panels
    # at a time where it can and one at a time in the last chunk; several rows take two panels at a time (AVX-512)
    # and the last odd one alone, or one at a time (AVX2)
    g = _gen(rows + 31)
    w, x, b = torch.randn(n, 3001, generator=g), torch.randn(rows, 3001, generator=g), torch.randn(n, generator=g)
    w = w.to(dtype)
    got = _ops().skinny_linear(x, _ops().pack_linear_weight(w), b, n, 1)
    want = F.relu(F.linear(x.double(), w.double(), b.double()))
    # a float32 sum of K products in any order is within K u sum|x_k w_k| of the exact one (u = 2^-24)
    bound = 3001 * 2.0**-24 * (x.double().abs() @ w.double().abs().T).max().item()
    assert_close(got.double(), want, atol=bound, rtol=0)


@pytest.mark.parametrize("length", [5, 13])
@pytest.mark.usefixtures("attention_isa")
def test_decode_attention_keeps_a_nan_query_or_key(length):
    # a NaN query made every score NaN, which the max passed over: the row was taken for one without keys (zeros);
    # a NaN key was dropped by the vector exp's clamp from 8 keys on. Now NaN in that row and head, as softmax(q k^T) v
    # (SDPA's CPU kernel gives zeros for a query of NaN scores at some lengths, NaN at others)
    g = _gen(3)
    k, v = torch.randn(2, 2, 16, 8, generator=g), torch.randn(2, 2, 16, 8, generator=g)
    q = torch.randn(2, 16, generator=g)
    base = _ops().decode_attention(q, k, v, None, length, 1 / math.sqrt(8), None, None)
    q[0, 3] = math.nan  # row 0, head 0
    k[1, 1, 2, 5] = math.nan  # row 1, head 1
    got = _ops().decode_attention(q, k, v, None, length, 1 / math.sqrt(8), None, None)
    want = torch.zeros(2, 16, dtype=torch.bool)
    want[0, :8] = want[1, 8:] = True
    qh, kh, vh = q.double().view(2, 2, 1, 8), k[:, :, :length].double(), v[:, :, :length].double()
    assert torch.equal((torch.softmax(qh @ kh.transpose(-1, -2), -1) @ vh).reshape(2, 16).isnan(), want)
    assert torch.equal(got.isnan(), want) and torch.equal(got[~want], base[~want])
