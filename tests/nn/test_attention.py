"""MultiHeadAttention: parity with ``nn.MultiheadAttention`` (forward and backward, copied weights), fully-masked
rows, hypothesis properties, the KV cache and bad input."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sublayer import KVCache, MultiHeadAttention
from sublayer.functional import causal_mask

from ._weights import assert_grads_close, mha_from_torch, mha_pairs, randomize_

D, H = 15, 3  # head_dim 5
B, T, S = 3, 7, 5
KDIM, VDIM = 7, 11


def make_pair(*, kdim=None, vdim=None, bias=True, dtype=torch.float32):
    ref = nn.MultiheadAttention(D, H, batch_first=True, kdim=kdim, vdim=vdim, bias=bias, dtype=dtype)
    randomize_(ref)
    return mha_from_torch(ref), ref


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def run_pair(ours, ref, q, k=None, v=None, *, dead=None, ours_kw=None, ref_kw=None, check_weights=True, seed=None):
    """Forward and backward of both modules with one upstream gradient; compare outputs, weights, input grads
    and every parameter grad (``seed``: reseed the global RNG before each forward, for dropout).

    ``dead`` (B, T_q) bool marks query rows with no key left: there ``nn.MultiheadAttention`` may give NaN, so
    those rows are compared only where the reference is finite, and ours must give the attention-free output
    (``out_proj.bias``) with finite gradients."""
    ours_kw, ref_kw = dict(ours_kw or {}), dict(ref_kw or ours_kw or {})
    self_attn = k is None
    k = q if k is None else k
    v = k if v is None else v
    q1, k1, v1 = leaf(q), leaf(k), leaf(v)
    q2, k2, v2 = leaf(q), leaf(k), leaf(v)
    if seed is not None:
        torch.manual_seed(seed)
    out, w = ours(q1, None if self_attn else k1, None if self_attn else v1, **ours_kw)
    if seed is not None:
        torch.manual_seed(seed)
    ref_out, ref_w = ref(q2, q2 if self_attn else k2, q2 if self_attn else v2, **ref_kw)
    g = torch.randn_like(out)
    loss = (out * g).sum()
    ref_loss = (ref_out * g).sum()
    if ours_kw.get("need_weights"):
        assert w is not None and ref_w is not None
        gw = torch.randn_like(w)
        loss = loss + (w * gw).sum()
        ref_loss = ref_loss + (ref_w * gw).sum()
    else:
        assert w is None
    loss.backward()
    ref_loss.backward()

    ref_finite = bool(torch.isfinite(ref_out).all()) and (ref_w is None or bool(torch.isfinite(ref_w).all()))
    if dead is None or ref_finite:
        torch.testing.assert_close(out, ref_out)
        if check_weights and w is not None:
            torch.testing.assert_close(w, ref_w)
        inputs = [(q1, q2)] if self_attn else [(q1, q2), (k1, k2), (v1, v2)]
        for a, b in inputs:
            torch.testing.assert_close(a.grad, b.grad)
        assert_grads_close(mha_pairs(ours, ref))
    else:
        live = ~dead
        torch.testing.assert_close(out[live], ref_out[live])
        expected_dead = (ours.out_proj.bias if ours.out_proj.bias is not None else torch.zeros(D)).expand_as(out)
        torch.testing.assert_close(out[dead], expected_dead[dead])
        if w is not None:
            torch.testing.assert_close(
                w[live] if w.dim() == 3 else w.transpose(1, 2)[live],
                ref_w[live] if w.dim() == 3 else ref_w.transpose(1, 2)[live],
            )
            dead_w = w[dead] if w.dim() == 3 else w.transpose(1, 2)[dead]
            assert (dead_w == 0).all()
        for t in (q1, k1, v1, *ours.parameters()):
            if t.grad is not None:
                assert torch.isfinite(t.grad).all()
    return out, w


# --------------------------------------------------------------------------- parity with nn.MultiheadAttention


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_self_attention_padding_matches_torch(mask, need_weights):
    ours, ref = make_pair()
    x = torch.randn(B, T, D)
    lengths = torch.tensor([T, 4, 2])
    kpm = torch.arange(T)[None, :] >= lengths[:, None]  # True = padding, no dead rows
    kw = {"need_weights": need_weights}
    if mask == "bool":
        kw["key_padding_mask"] = kpm
    elif mask == "float":
        kw["key_padding_mask"] = torch.zeros(B, T).masked_fill(kpm, float("-inf"))
    run_pair(ours, ref, x, ours_kw=kw)


def test_float_padding_mask_with_finite_bias_matches_torch():
    """An additive key_padding_mask that is a soft bias (no -inf) is added to the scores, not thresholded."""
    ours, ref = make_pair()
    x = torch.randn(B, T, D)
    kpm = torch.randn(B, T)
    run_pair(ours, ref, x, ours_kw={"key_padding_mask": kpm, "need_weights": True})


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_cross_attention_kdim_vdim_matches_torch(need_weights):
    ours, ref = make_pair(kdim=KDIM, vdim=VDIM)
    assert not ref._qkv_same_embed_dim
    q, k, v = torch.randn(B, T, D), torch.randn(B, S, KDIM), torch.randn(B, S, VDIM)
    kpm = torch.tensor([[False] * S, [False] * (S - 2) + [True] * 2, [False] + [True] * (S - 1)])
    run_pair(ours, ref, q, k, v, ours_kw={"key_padding_mask": kpm, "need_weights": need_weights})


def test_cross_attention_same_dims_matches_torch():
    ours, ref = make_pair()
    q, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    run_pair(ours, ref, q, mem, mem)


def _attn_masks(kind: str):
    """(ours, torch's) attention masks: torch takes 2-D or (B·H, T, S) only, ours also 4-D."""
    g = torch.Generator().manual_seed(1)
    base = torch.rand(B, H, T, S, generator=g) < 0.4
    base[..., 0] = False  # every query keeps key 0: no dead rows here
    if kind.startswith("bool"):
        m4 = base
    else:
        m4 = torch.randn(B, H, T, S, generator=g).masked_fill(base, float("-inf"))
    dim = kind[-2:]
    if dim == "2d":
        return m4[0, 0], m4[0, 0]
    if dim == "3d":
        return m4.reshape(B * H, T, S), m4.reshape(B * H, T, S)
    if dim == "4d":
        return m4, m4.reshape(B * H, T, S)
    if dim == "b1":  # (B, 1, T, S) broadcast over heads
        m = m4[:, :1]
        return m, m.expand(B, H, T, S).reshape(B * H, T, S)
    if dim == "1h":  # (1, H, T, S) broadcast over the batch
        m = m4[:1]
        return m, m.expand(B, H, T, S).reshape(B * H, T, S)
    raise AssertionError(kind)


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
@pytest.mark.parametrize(
    "kind", ["bool_2d", "float_2d", "bool_3d", "float_3d", "bool_4d", "float_4d", "bool_b1", "float_1h"]
)
def test_attn_mask_matches_torch(kind, need_weights):
    ours, ref = make_pair()
    q, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    ours_mask, ref_mask = _attn_masks(kind)
    run_pair(
        ours, ref, q, mem, mem,
        ours_kw={"attn_mask": ours_mask, "need_weights": need_weights},
        ref_kw={"attn_mask": ref_mask, "need_weights": need_weights},
    )  # fmt: skip


def test_padding_and_attn_mask_combined_match_torch():
    ours, ref = make_pair()
    x = torch.randn(B, T, D)
    kpm = torch.arange(T)[None, :] >= torch.tensor([T, 5, 3])[:, None]
    am = torch.rand(T, T) < 0.3
    am[:, 0] = False
    run_pair(ours, ref, x, ours_kw={"key_padding_mask": kpm, "attn_mask": am, "need_weights": True})


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
def test_causal_matches_torch_explicit_mask(need_weights, padding):
    """``is_causal=True`` equals torch with the explicit upper-triangular mask (torch's is_causal is only a hint)."""
    ours, ref = make_pair()
    x = torch.randn(B, T, D)
    tri = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = masked (future)
    ours_kw = {"is_causal": True, "need_weights": need_weights}
    ref_kw = {"attn_mask": tri, "need_weights": need_weights}
    if padding:  # right padding: key 0 is always real, so no row is dead under the causal mask
        kpm = torch.arange(T)[None, :] >= torch.tensor([T, 4, 1])[:, None]
        ours_kw["key_padding_mask"] = ref_kw["key_padding_mask"] = kpm
    run_pair(ours, ref, x, ours_kw=ours_kw, ref_kw=ref_kw)


def test_per_head_weights_match_torch():
    ours, ref = make_pair()
    x = torch.randn(B, T, D)
    kpm = torch.arange(T)[None, :] >= torch.tensor([T, 5, 3])[:, None]
    kw = {"key_padding_mask": kpm, "need_weights": True, "average_attn_weights": False}
    _, w = run_pair(ours, ref, x, ours_kw=kw)
    assert w.shape == (B, H, T, T)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, T))


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
def test_no_bias_matches_torch(need_weights):
    ours, ref = make_pair(bias=False)
    assert all(getattr(ours, n).bias is None for n in ("q_proj", "k_proj", "v_proj", "out_proj"))
    x = torch.randn(B, T, D)
    run_pair(ours, ref, x, ours_kw={"need_weights": need_weights, "is_causal": True},
             ref_kw={"need_weights": need_weights, "attn_mask": ~causal_mask(T, T)})  # fmt: skip


def test_float64_matches_torch():
    ours, ref = make_pair(dtype=torch.float64)
    x = torch.randn(B, T, D, dtype=torch.float64)
    kpm = torch.arange(T)[None, :] >= torch.tensor([T, 5, 3])[:, None]
    run_pair(ours, ref, x, ours_kw={"key_padding_mask": kpm, "need_weights": True})


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "weights"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_error_within_torch_error(dtype, need_weights):
    """Low precision: no fixed tolerance; our error against the float64 reference must stay within 2× the error of
    ``nn.MultiheadAttention`` run in the same precision (REFERENCE.md §3)."""
    ref = randomize_(nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64))
    ours = mha_from_torch(ref)
    x = torch.randn(B, T, D, dtype=torch.float64)
    kpm = torch.arange(T)[None, :] >= torch.tensor([T, 5, 3])[:, None]
    with torch.no_grad():
        exact = ref(x, x, x, key_padding_mask=kpm)[0]
        ref_lp, ours_lp, x_lp = copy.deepcopy(ref).to(dtype), copy.deepcopy(ours).to(dtype), x.to(dtype)
        out = ours_lp(x_lp, key_padding_mask=kpm, need_weights=need_weights)[0]
        ref_out = ref_lp(x_lp, x_lp, x_lp, key_padding_mask=kpm, need_weights=need_weights)[0]
    assert out.dtype == dtype
    ours_err, ref_err = (out.double() - exact).abs().max(), (ref_out.double() - exact).abs().max()
    assert ref_err > 0 and ours_err <= 2 * ref_err, (ours_err, ref_err)


def test_eval_fast_path_matches_torch():
    """torch's eval/no-grad fast path (``_native_multi_head_attention``) gives the same numbers as ours."""
    ours, ref = make_pair()
    ours.eval(), ref.eval()
    x = torch.randn(B, T, D)
    kpm = torch.arange(T)[None, :] >= torch.tensor([T, 5, 3])[:, None]
    with torch.no_grad():
        out, _ = ours(x, key_padding_mask=kpm)
        ref_out, _ = ref(x, x, x, key_padding_mask=kpm, need_weights=False)
    live = ~kpm  # the fast path may zero padded query positions (nested tensors)
    torch.testing.assert_close(out[live], ref_out[live])


# --------------------------------------------------------------------------- fully-masked rows


def _dead_masks(kind: str):
    """key_padding_mask with batch row 1 fully padded → every query of row 1 is dead."""
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1] = True
    kpm[2, 4:] = True
    dead = kpm.all(-1, keepdim=True).expand(B, T)
    if kind == "float":
        kpm = torch.zeros(B, T).masked_fill(kpm, float("-inf"))
    return kpm, dead


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_padded_rows_match_torch_elsewhere(kind, need_weights):
    ours, ref = make_pair()
    kpm, dead = _dead_masks(kind)
    run_pair(
        ours, ref, torch.randn(B, T, D), dead=dead, ours_kw={"key_padding_mask": kpm, "need_weights": need_weights}
    )


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_attn_mask_rows_finite(kind, need_weights):
    """Rows 2 and 5 of a 2-D attn_mask block every key; nn.MultiheadAttention gives NaN there."""
    ours, ref = make_pair()
    am = torch.rand(T, T) < 0.3
    am[:, 0] = False
    am[[2, 5]] = True
    dead = torch.zeros(B, T, dtype=torch.bool)
    dead[:, [2, 5]] = True
    if kind == "float":
        am = torch.randn(T, T).masked_fill(am, float("-inf"))
    run_pair(ours, ref, torch.randn(B, T, D), dead=dead, ours_kw={"attn_mask": am, "need_weights": need_weights})


@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_zero_output_and_finite_grads(kind, need_weights):
    """The attention core gives exactly zeros in a dead row (output = out_proj.bias) and finite gradients that do
    not leak into other rows: row 0's gradient equals running row 0 alone."""
    mha = randomize_(MultiHeadAttention(D, H))
    kpm, dead = _dead_masks(kind)
    x = leaf(torch.randn(B, T, D))
    out, w = mha(x, key_padding_mask=kpm, need_weights=need_weights)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[dead], mha.out_proj.bias.expand(int(dead.sum()), D), rtol=0, atol=0)
    if need_weights:
        assert torch.isfinite(w).all() and (w[1] == 0).all()
        torch.testing.assert_close(w[0].sum(-1), torch.ones(T))
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in mha.parameters())
    assert (x.grad[1] == 0).all(), "a fully padded row has no path from its keys/values/queries to the output"
    x0 = leaf(x[:1])
    out0, _ = mha(x0, key_padding_mask=kpm[:1], need_weights=need_weights)
    out0.square().sum().backward()
    torch.testing.assert_close(x.grad[:1], x0.grad)


def test_causal_query_longer_than_keys_gives_dead_rows():
    """Bottom-right causal alignment with T_q > T_k: the first T_q − T_k queries see no key → zeros, finite
    grads."""
    mha = randomize_(MultiHeadAttention(D, H))
    q, kv = leaf(torch.randn(B, T, D)), leaf(torch.randn(B, S, D))
    for need_weights in (False, True):
        out, _ = mha(q, kv, kv, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(out[:, : T - S], mha.out_proj.bias.expand(B, T - S, D), rtol=0, atol=0)
        out.sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()


# --------------------------------------------------------------------------- properties (hypothesis)

_small = settings(max_examples=12)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@_small
@given(seed=st.integers(0, 2**16), t=st.integers(2, 9), cut=st.integers(1, 8), need_weights=st.booleans())
def test_causal_prefix_unchanged_by_future_tokens(seed, t, cut, need_weights):
    cut = min(cut, t - 1)
    g = _gen(seed)
    mha = MultiHeadAttention(D, H)
    x = torch.randn(2, t, D, generator=g)
    y = x.clone()
    y[:, cut:] = torch.randn(2, t - cut, D, generator=g) * 10
    with torch.no_grad():
        a, _ = mha(x, is_causal=True, need_weights=need_weights)
        b, _ = mha(y, is_causal=True, need_weights=need_weights)
    torch.testing.assert_close(a[:, :cut], b[:, :cut])
    assert not torch.allclose(a[:, cut:], b[:, cut:])  # the future positions did change: the test can see it


@_small
@given(seed=st.integers(0, 2**16), lengths=st.lists(st.integers(1, 8), min_size=1, max_size=3), causal=st.booleans())
def test_padded_tokens_do_not_change_real_positions(seed, lengths, causal):
    g = _gen(seed)
    t = 8
    mha = MultiHeadAttention(D, H)
    kpm = torch.arange(t)[None, :] >= torch.tensor(lengths)[:, None]
    x = torch.randn(len(lengths), t, D, generator=g)
    y = torch.where(kpm[..., None], torch.randn(x.shape, generator=g) * 100, x)
    with torch.no_grad():
        a, _ = mha(x, key_padding_mask=kpm, is_causal=causal)
        b, _ = mha(y, key_padding_mask=kpm, is_causal=causal)
    torch.testing.assert_close(a[~kpm], b[~kpm])


@_small
@given(
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(["bool", "float"]),
    causal=st.booleans(),
    need_weights=st.booleans(),
)
def test_all_false_padding_mask_equals_no_mask(seed, kind, causal, need_weights):
    g = _gen(seed)
    mha = MultiHeadAttention(D, H)
    x = torch.randn(2, T, D, generator=g)
    kpm = torch.zeros(2, T, dtype=torch.bool) if kind == "bool" else torch.zeros(2, T)
    with torch.no_grad():
        a, wa = mha(x, key_padding_mask=kpm, is_causal=causal, need_weights=need_weights)
        b, wb = mha(x, is_causal=causal, need_weights=need_weights)
    torch.testing.assert_close(a, b)
    if need_weights:
        torch.testing.assert_close(wa, wb)


@_small
@given(seed=st.integers(0, 2**16), s=st.integers(1, 9))
def test_permuting_keys_with_values_leaves_output_unchanged(seed, s):
    g = _gen(seed)
    mha = MultiHeadAttention(D, H, kdim=KDIM, vdim=VDIM)
    q, k, v = (
        torch.randn(2, T, D, generator=g),
        torch.randn(2, s, KDIM, generator=g),
        torch.randn(2, s, VDIM, generator=g),
    )
    kpm = torch.rand(2, s, generator=g) < 0.3
    kpm[:, 0] = False
    perm = torch.randperm(s, generator=g)
    with torch.no_grad():
        a, wa = mha(q, k, v, key_padding_mask=kpm, need_weights=True)
        b, wb = mha(q, k[:, perm], v[:, perm], key_padding_mask=kpm[:, perm], need_weights=True)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(wa[..., perm], wb)


@_small
@given(seed=st.integers(0, 2**16), row=st.integers(0, 2), causal=st.booleans())
def test_batch_row_equals_running_it_alone(seed, row, causal):
    g = _gen(seed)
    mha = MultiHeadAttention(D, H)
    x = torch.randn(3, T, D, generator=g)
    kpm = torch.arange(T)[None, :] >= torch.tensor([T, 3, 5])[:, None]
    with torch.no_grad():
        full, _ = mha(x, key_padding_mask=kpm, is_causal=causal)
        alone, _ = mha(x[row : row + 1], key_padding_mask=kpm[row : row + 1], is_causal=causal)
    torch.testing.assert_close(full[row : row + 1], alone)


# --------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("chunks", [[1] * T, [3, 1, 3], [2, 5]], ids=["tokens", "3-1-3", "2-5"])
def test_kv_cache_incremental_equals_full_causal(chunks):
    mha = randomize_(MultiHeadAttention(D, H))
    x = torch.randn(B, T, D)
    with torch.no_grad():
        full, _ = mha(x, is_causal=True)
        cache = KVCache()
        outs, start = [], 0
        for n in chunks:
            o, _ = mha(x[:, start : start + n], is_causal=True, kv_cache=cache)
            outs.append(o)
            start += n
            assert len(cache) == start
    torch.testing.assert_close(torch.cat(outs, dim=1), full)


def test_kv_cache_with_padding_mask_over_cached_keys():
    """key_padding_mask covers the cached keys too (B, cached + new)."""
    mha = randomize_(MultiHeadAttention(D, H))
    x = torch.randn(B, T, D)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, 1] = True  # a padded token in the middle of row 1
    kpm[2, 3:5] = True
    with torch.no_grad():
        full, _ = mha(x, key_padding_mask=kpm, is_causal=True)
        cache = KVCache()
        outs = [
            mha(x[:, t : t + 1], key_padding_mask=kpm[:, : t + 1], is_causal=True, kv_cache=cache)[0] for t in range(T)
        ]
    torch.testing.assert_close(torch.cat(outs, dim=1), full)


def test_static_cross_cache_reuses_memory_projection():
    mha = randomize_(MultiHeadAttention(D, H, kdim=KDIM, vdim=VDIM))
    q, mem_k, mem_v = torch.randn(B, T, D), torch.randn(B, S, KDIM), torch.randn(B, S, VDIM)
    kpm = torch.tensor([[False] * S, [False] * 3 + [True] * 2, [False] + [True] * (S - 1)])
    with torch.no_grad():
        full, _ = mha(q, mem_k, mem_v, key_padding_mask=kpm)
        cache = KVCache(static=True)
        outs = []
        for t in range(T):
            # after the first step the memory passed is ignored: give garbage to prove it
            k, v = (mem_k, mem_v) if t == 0 else (torch.full_like(mem_k, 1e3), torch.full_like(mem_v, -1e3))
            outs.append(mha(q[:, t : t + 1], k, v, key_padding_mask=kpm, kv_cache=cache)[0])
            assert len(cache) == S
    torch.testing.assert_close(torch.cat(outs, dim=1), full)


def test_kv_cache_gradients_flow_to_earlier_steps():
    mha = MultiHeadAttention(D, H)
    x = leaf(torch.randn(1, 4, D))
    cache = KVCache()
    out = torch.cat([mha(x[:, t : t + 1], is_causal=True, kv_cache=cache)[0] for t in range(4)], 1)
    out[:, -1].sum().backward()
    assert (x.grad[0, 0] != 0).any(), "the last step depends on the first token through the cache"
    x2 = leaf(x)
    mha(x2, is_causal=True)[0][:, -1].sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


# --------------------------------------------------------------------------- dropout and modes


def test_dropout_active_in_training_only():
    mha = MultiHeadAttention(D, H, dropout=0.5)
    ref = MultiHeadAttention(D, H)
    ref.load_state_dict(mha.state_dict())
    x = torch.randn(B, T, D)
    with torch.no_grad():
        a, b = mha(x)[0], mha(x)[0]
        assert not torch.allclose(a, b)
        mha.eval()
        torch.testing.assert_close(mha(x)[0], ref(x)[0])
        torch.manual_seed(3)
        _, w1 = mha.train()(x, need_weights=True)
        torch.manual_seed(3)
        _, w2 = mha(x, need_weights=True)
    torch.testing.assert_close(w1, w2)  # same seed → same dropout mask


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "weights"])
def test_training_dropout_matches_torch_same_seed(need_weights):
    """With dropout > 0 in training both draw one dropout mask over the (B·H, T, S) weights from the global RNG
    (torch 2.13's SDPA and its explicit path alike), so the same seed gives the same output, the same returned
    weights (after dropout, as torch returns them) and the same gradients."""
    ref = randomize_(nn.MultiheadAttention(D, H, dropout=0.3, batch_first=True))
    ours = mha_from_torch(ref)
    assert ours.training and ref.training
    x = torch.randn(B, T, D)
    kpm = torch.arange(T)[None, :] >= torch.tensor([T, 5, 3])[:, None]
    torch.manual_seed(11)
    a, _ = ours(x, key_padding_mask=kpm)
    out = run_pair(ours, ref, x, ours_kw={"key_padding_mask": kpm, "need_weights": need_weights}, seed=12)
    assert not torch.allclose(out[0], a), "dropout is active: another mask gives another output"


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"d_model": 10, "n_heads": 3}, ValueError, r"d_model \(10\).*n_heads \(3\)"),
        ({"d_model": 0, "n_heads": 1}, ValueError, "d_model must be a positive int, got 0"),
        ({"d_model": 6, "n_heads": -2}, ValueError, "n_heads must be a positive int, got -2"),
        ({"d_model": 6.0, "n_heads": 2}, TypeError, "d_model must be a positive int"),
        ({"d_model": 6, "n_heads": 2, "kdim": 0}, ValueError, "kdim must be a positive int, got 0"),
        ({"d_model": 6, "n_heads": 2, "dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\), got 1.0"),
        ({"d_model": 6, "n_heads": 2, "dropout": -0.1}, ValueError, r"dropout must be in \[0, 1\), got -0.1"),
    ],
)
def test_bad_constructor_args(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MultiHeadAttention(**kwargs)


@pytest.fixture
def mha():
    return MultiHeadAttention(6, 2)


def test_integer_masks_rejected(mha):
    x = torch.randn(2, 4, 6)
    with pytest.raises(TypeError, match=r"key_padding_mask must be bool.*got dtype torch.int64"):
        mha(x, key_padding_mask=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match=r"attn_mask must be bool.*got dtype torch.int32"):
        mha(x, attn_mask=torch.zeros(4, 4, dtype=torch.int32))


@pytest.mark.parametrize("shape", [(4,), (2, 5), (3, 4), (4, 4, 1)], ids=str)
def test_wrong_padding_mask_shape(mha, shape):
    msg = f"key_padding_mask must have shape (batch, key_len) = (2, 4), got {tuple(shape)}"
    with pytest.raises(ValueError, match=re.escape(msg)):
        mha(torch.randn(2, 4, 6), key_padding_mask=torch.zeros(shape, dtype=torch.bool))


@pytest.mark.parametrize("shape", [(4, 5), (3, 4, 4), (2, 3, 4, 4), (3, 2, 4, 4), (2, 2, 4, 5), (4,)], ids=str)
def test_wrong_attn_mask_shape(mha, shape):
    with pytest.raises(
        ValueError, match=r"attn_mask must have shape \(4, 4\), \(4, 4, 4\) or \(2 or 1, 2 or 1, 4, 4\), got"
    ):
        mha(torch.randn(2, 4, 6), attn_mask=torch.zeros(shape, dtype=torch.bool))


def test_qkv_dtype_mismatch(mha):
    x = torch.randn(2, 4, 6)
    with pytest.raises(TypeError, match=r"key dtype torch.float64 does not match query dtype torch.float32"):
        mha(x, x.double(), x)
    with pytest.raises(TypeError, match=r"value dtype torch.float16 does not match query dtype torch.float32"):
        mha(x, x, x.half())


def test_qkv_device_mismatch(mha):
    x = torch.randn(2, 4, 6)
    with pytest.raises(ValueError, match=r"key device meta does not match query device cpu"):
        mha(x, torch.empty(2, 4, 6, device="meta"), x)


def test_query_must_be_3d(mha):
    with pytest.raises(ValueError, match=r"query must be 3-D \(batch, seq, features\), got shape \(4, 6\)"):
        mha(torch.randn(4, 6))
    with pytest.raises(ValueError, match=r"key must be 3-D .*got shape \(5, 6\)"):
        mha(torch.randn(2, 4, 6), torch.randn(5, 6), torch.randn(2, 5, 6))


def test_key_value_length_mismatch(mha):
    with pytest.raises(ValueError, match=r"key/value the length.*key \(2, 5, 6\), value \(2, 3, 6\)"):
        mha(torch.randn(2, 4, 6), torch.randn(2, 5, 6), torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"share the batch size.*query \(2, 4, 6\), key \(3, 5, 6\)"):
        mha(torch.randn(2, 4, 6), torch.randn(3, 5, 6), torch.randn(3, 5, 6))


def test_wrong_feature_size(mha):
    with pytest.raises(ValueError, match=r"query must have last dim 6, got shape \(2, 4, 5\)"):
        mha(torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match=r"key must have last dim 6, got shape \(2, 3, 7\)"):
        mha(torch.randn(2, 4, 6), torch.randn(2, 3, 7), torch.randn(2, 3, 6))


def test_non_tensor_input(mha):
    with pytest.raises(TypeError, match="query must be a torch.Tensor, got list"):
        mha([[1.0] * 6])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_query_dtype_must_match_the_weights(dtype):
    """A model cast with .to(dtype) and called on float32 input: a TypeError naming both dtypes (as the FFN's),
    not torch's matmul error; under autocast the mix is autocast's to cast."""
    mha = MultiHeadAttention(15, 3).to(dtype)
    x = torch.randn(2, 4, 15)
    with pytest.raises(TypeError, match=rf"q_weight dtype {dtype} does not match query dtype torch.float32"):
        mha(x)
    with pytest.raises(TypeError, match=rf"q_weight dtype {dtype} does not match query dtype torch.float32"):
        mha(x, need_weights=True, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    if dtype == torch.bfloat16:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert mha(x)[0].dtype == torch.bfloat16
