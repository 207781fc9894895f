"""packed_self_attention (csrc/packed_attention.cpp): bf16 self-attention on packed rows, one call for all runs of
equal-length sequences, against SDPA per sequence in float64 on the same bf16 q, k, v; its float32-products mode
against SDPA in float32 and float64 on float32 q, k, v; on the AVX-512 kernels (where compiled in) and on the
portable loops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sublayer import kernels
from sublayer.runtime.encoder import runs

from ._tol import assert_fast_close

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels unavailable")


def _ops():
    return kernels.ops()


@pytest.fixture(params=["avx512-bf16", "portable"])
def path(request):
    """Each test on the vdpbf16ps kernel (skipped where not compiled in) and on the portable loop."""
    if request.param == "avx512-bf16" and not _ops().packed_attention_avx512(-1):
        pytest.skip("no AVX512_BF16 kernel compiled in")
    was = _ops().packed_attention_avx512(int(request.param != "portable"))
    yield request.param
    _ops().packed_attention_avx512(int(was))


def _reference(qkv: torch.Tensor, segments, heads: int, scale: float, dtype) -> torch.Tensor:
    """SDPA per sequence on the bf16 values widened to ``dtype`` (rows outside every run: zeros)."""
    d = qkv.shape[1] // 3
    x, out = qkv.to(dtype), torch.zeros(qkv.shape[0], d, dtype=dtype)
    for row, count, n in segments:
        q, k, v = x[row : row + count * n].view(count, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, scale=scale)
        out[row : row + count * n] = ctx.transpose(1, 2).reshape(count * n, d)
    return out


def _case(lengths, heads: int, hd: int, seed: int = 0):
    pad = torch.ones(len(lengths), max(lengths), dtype=torch.bool)
    for i, n in enumerate(lengths):
        pad[i, :n] = False
    segments = runs(pad, tuple(pad.shape))
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(sum(lengths), 3 * heads * hd, generator=g) * 1.5).bfloat16()
    return qkv, segments


@pytest.mark.parametrize(
    "lengths,heads,hd",
    [([7, 7, 3, 1, 19], 3, 5), ([13, 37, 37], 2, 32), ([41, 2, 2, 2], 1, 17), ([23], 5, 3)],
    ids=["odd-head-dim", "two-query-blocks", "head-dim-17", "one-run"],
)
def test_packed_attention_equals_sdpa_per_sequence(path, lengths, heads, hd):
    qkv, segments = _case(lengths, heads, hd)
    table = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3)
    scale = 1 / math.sqrt(hd)
    want = _reference(qkv, segments, heads, scale, torch.float64)
    low = _reference(qkv, segments, heads, scale, torch.float32)
    # float32 q|k|v are rounded to bf16 inside: off-grid values give what their rounding gives
    nudge = torch.rand(qkv.shape, generator=torch.Generator().manual_seed(9)) * 2.0**-10
    off_grid = qkv.float() * (1 + nudge)
    for x in (qkv, qkv.float(), off_grid):
        out = _ops().packed_self_attention(x, table, heads, scale, torch.float32)
        assert_fast_close(out, low, want, what=f"float32 out from {x.dtype}")
        half = _ops().packed_self_attention(x, table, heads, scale, torch.bfloat16)
        assert half.dtype == torch.bfloat16
        assert_fast_close(half, low.bfloat16(), want, what=f"bf16 out from {x.dtype}")
    # the probabilities as one bf16 part: bf16's error on them, as SDPA's bf16 kernel
    one = _ops().packed_self_attention(qkv, table, heads, scale, torch.float32, False)
    assert_fast_close(one, _reference(qkv, segments, heads, scale, torch.bfloat16).float(), want, what="one part")
    assert (one - want).abs().max() > (out - want).abs().max()


@pytest.mark.parametrize(
    "lengths,heads,hd",
    [([7, 7, 3, 1, 19], 3, 5), ([13, 37, 37], 2, 32), ([41, 2, 2, 2], 1, 17), ([23], 5, 3), ([53, 11], 2, 64),
     ([64, 49, 33, 17, 16, 16, 2, 1], 3, 32), ([71, 67, 5], 2, 16), ([29], 7, 48)],
    ids=["odd-head-dim", "two-query-blocks", "head-dim-17", "one-run", "head-dim-64", "key-blocks-1-to-4",
         "over-64-keys", "one-sequence-many-heads"],
)  # fmt: skip
def test_packed_attention_float32_products_equal_sdpa(path, lengths, heads, hd):
    qkv, segments = _case(lengths, heads, hd, seed=5)
    qkv = qkv.float() + torch.randn(qkv.shape, generator=torch.Generator().manual_seed(2)) * 0.01  # off bf16's grid
    table = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3)
    scale = 1 / math.sqrt(hd)
    want = _reference(qkv, segments, heads, scale, torch.float64)
    out = _ops().packed_self_attention(qkv, table, heads, scale, torch.float32, True, True)
    assert_fast_close(out, _reference(qkv, segments, heads, scale, torch.float32), want, what="float32 products")
    assert (out - want).abs().max() < 1e-5  # float32's accuracy, not bf16's
    half = _ops().packed_self_attention(qkv, table, heads, scale, torch.bfloat16, True, True)
    torch.testing.assert_close(half, out.bfloat16(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="float32_products needs float32 qkv"):
        _ops().packed_self_attention(qkv.bfloat16(), table, heads, scale, torch.float32, True, True)


def test_packed_attention_kernel_and_loop_agree():
    if not _ops().packed_attention_avx512(-1):
        pytest.skip("no AVX512_BF16 kernel compiled in")
    qkv, segments = _case([29, 29, 11, 4], 3, 13, seed=3)
    table = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3)
    wide = qkv.float() * 1.01
    fast = _ops().packed_self_attention(qkv, table, 3, 0.3, torch.float32)
    fast32 = _ops().packed_self_attention(wide, table, 3, 0.3, torch.float32, True, True)
    _ops().packed_attention_avx512(0)
    try:
        loop = _ops().packed_self_attention(qkv, table, 3, 0.3, torch.float32)
        loop32 = _ops().packed_self_attention(wide, table, 3, 0.3, torch.float32, True, True)
    finally:
        _ops().packed_attention_avx512(1)
    torch.testing.assert_close(fast, loop, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast32, loop32, rtol=1e-5, atol=1e-6)


def test_packed_attention_rows_outside_the_runs_are_zeros(path):
    qkv, _ = _case([5, 3], 2, 7)
    out = _ops().packed_self_attention(qkv, torch.tensor([[0, 1, 5]]), 2, 0.4, torch.float32)
    assert bool((out[5:] == 0).all()) and bool((out[:5] != 0).any())
    empty = _ops().packed_self_attention(qkv[:0], torch.zeros(0, 3, dtype=torch.int64), 2, 0.4, torch.bfloat16)
    assert empty.shape == (0, 14) and empty.dtype == torch.bfloat16


def test_packed_attention_rejects_bad_inputs():
    qkv, segments = _case([5, 3], 2, 7)
    table = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3)
    op = _ops().packed_self_attention
    with pytest.raises(RuntimeError, match="qkv must be a contiguous bfloat16 or float32"):
        op(qkv.half(), table, 2, 0.4, torch.float32)
    with pytest.raises(RuntimeError, match="qkv must be a contiguous bfloat16 or float32"):
        op(qkv.t().contiguous().t(), table, 2, 0.4, torch.float32)
    with pytest.raises(RuntimeError, match="columns are not 3 \\* n_heads"):
        op(qkv, table, 4, 0.4, torch.float32)
    with pytest.raises(RuntimeError, match="out_dtype must be float32 or bfloat16"):
        op(qkv, table, 2, 0.4, torch.float16)
    with pytest.raises(RuntimeError, match="runs must be a contiguous int64"):
        op(qkv, table.int(), 2, 0.4, torch.float32)
    with pytest.raises(RuntimeError, match=r"run 0 \(0, 2, 5\) is outside"):
        op(qkv, torch.tensor([[0, 2, 5]]), 2, 0.4, torch.float32)


def _softmax_reference(x: torch.Tensor, segments, heads: int, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence in float64, spelled out: NaN wherever a NaN reaches (SDPA's CPU kernel
    gives zeros for a query whose scores are all NaN in short sequences, NaN in longer ones)."""
    d = x.shape[1] // 3
    out = torch.zeros(x.shape[0], d, dtype=torch.float64)
    for row, count, n in segments:
        q, k, v = x[row : row + count * n].double().view(count, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        ctx = torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v
        out[row : row + count * n] = ctx.transpose(1, 2).reshape(count * n, d)
    return out


@pytest.mark.parametrize("part", ["query", "key", "value"])
def test_packed_attention_keeps_a_nan_as_sdpa(path, part):
    # a NaN in one query (key, value) of the second sequence, head 1: NaN in that query's row (every row, the
    # value's column) of that head and sequence, as softmax(q k^T) v and SDPA; the outputs elsewhere unchanged.
    # The vector exp's clamp dropped the NaN (e^-87.3 instead), so the rows came out finite
    heads, hd = 3, 16
    qkv, segments = _case([19, 17, 17, 7, 3], heads, hd, seed=4)
    table = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3)
    d, scale = heads * hd, 1 / math.sqrt(hd)
    clean = qkv.float()
    x = clean.clone()
    x[{"query": 20, "key": 23, "value": 29}[part], {"query": 0, "key": d, "value": 2 * d}[part] + hd + 3] = math.nan
    want = _softmax_reference(x, segments, heads, scale).isnan()
    assert want.any() and not (_reference(x, segments, heads, scale, torch.float64).isnan() & ~want).any()
    assert torch.equal(_reference(x[19:36], [(0, 1, 17)], heads, scale, torch.float64).isnan(), want[19:36])
    for inp, f32 in ((x.bfloat16(), False), (x, False), (x, True)):
        got = _ops().packed_self_attention(inp, table, heads, scale, torch.float32, True, f32)
        base = _ops().packed_self_attention(clean.to(inp.dtype), table, heads, scale, torch.float32, True, f32)
        assert torch.equal(got.isnan(), want), (part, inp.dtype, f32)
        assert torch.equal(got[~want], base[~want])


@pytest.mark.parametrize("part", ["query", "key", "value"])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_qkv_self_attention_keeps_a_nan_as_sdpa(part, isa):
    # the float32 attention of the packed rows without AVX-512: a query whose scores are all NaN got zeros (taken for
    # a row without keys) and, from 8 keys, a NaN key was dropped by the vector exp's clamp
    heads, hd, n = 3, 16, 17
    clean = torch.randn(2 * n, 3 * heads * hd, generator=torch.Generator().manual_seed(6))
    d, x = heads * hd, clean.clone()
    x[{"query": n + 2, "key": n + 5, "value": n + 9}[part], {"query": 0, "key": d, "value": 2 * d}[part] + hd + 3] = math.nan
    want = _softmax_reference(x, [(0, 2, n)], heads, 0.25).isnan()
    assert want.any() and torch.equal(_reference(x, [(0, 2, n)], heads, 0.25, torch.float64).isnan(), want)
    was = _ops().attention_avx512(int(isa == "avx512"))
    try:
        got, base = (_ops().qkv_self_attention(t, None, heads, n, 0.25) for t in (x, clean))
    finally:
        _ops().attention_avx512(int(was))
    assert torch.equal(got.isnan(), want), part
    assert torch.equal(got[~want], base[~want])
