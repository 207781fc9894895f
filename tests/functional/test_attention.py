"""``sublayer.functional`` attention: gradcheck in float64, the core vs ``F.scaled_dot_product_attention``, the
bottom-right causal mask, mask combination in half precision and the KV cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from sublayer.functional import KVCache, attention, causal_mask, multi_head_attention

B, H, T, S, DH = 2, 2, 3, 5, 2  # head_dim 2 → d_model 4: gradcheck perturbs every input element, keep it tiny
D = H * DH
KDIM = 3
# REFERENCE.md §3: float64 only, eps 1e-6, atol 1e-5, rtol 1e-3. fast_mode checks a random projection uᵀJv of the
# Jacobian instead of every column: any wrong gradient still fails (with probability 1), at a fraction of the cost
# on CI's 2 cores.
GRADCHECK = {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-3, "fast_mode": True}


def f64(*shape, requires_grad=True):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=requires_grad)


def _padding(kind: str, b: int, t: int, *, dead_row: bool = False):
    kpm = torch.arange(t)[None, :] >= torch.tensor([t, 2][:b])[:, None]
    if dead_row:
        kpm[-1] = True
    if kind == "float":
        return torch.zeros(b, t, dtype=torch.float64).masked_fill(kpm, float("-inf"))
    return kpm


# --------------------------------------------------------------------------- gradcheck (float64)


def _mha_params(kdim=D, bias=True):
    ws = [f64(D, D), f64(D, kdim), f64(D, kdim), f64(D, D)]
    bs = [f64(D) if bias else None for _ in range(4)]
    return ws, bs


MHA_CASES = {
    "plain": {},
    "kpm_bool": {"key_padding_mask": "bool"},
    "kpm_float": {"key_padding_mask": "float"},
    "kpm_dead_row": {"key_padding_mask": "bool_dead"},
    "attn_bool_4d": {"attn_mask": "bool4d"},
    "attn_float_2d": {"attn_mask": "float2d"},
    "causal": {"is_causal": True},
    "causal_kpm_weights": {"is_causal": True, "key_padding_mask": "bool", "need_weights": True},
    "weights_per_head": {"need_weights": True, "average_attn_weights": False, "attn_mask": "float2d"},
}


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multi_head_attention_gradcheck(case):
    spec = dict(MHA_CASES[case])
    g = torch.Generator().manual_seed(7)
    query, key, value = f64(B, T, D), f64(B, S, KDIM), f64(B, S, KDIM)
    if spec.get("is_causal"):
        key, value = f64(B, T, KDIM), f64(B, T, KDIM)
    t_k = key.shape[1]
    kpm = spec.pop("key_padding_mask", None)
    if kpm is not None:
        spec["key_padding_mask"] = _padding(kpm.removesuffix("_dead"), B, t_k, dead_row=kpm.endswith("_dead"))
    am = spec.pop("attn_mask", None)
    if am == "bool4d":
        m = torch.rand(B, H, T, t_k, generator=g) < 0.4
        m[..., 0] = False
        spec["attn_mask"] = m
    elif am == "float2d":
        spec["attn_mask"] = torch.randn(T, t_k, generator=g, dtype=torch.float64)
    ws, bs = _mha_params(KDIM)

    def fn(q, k, v, wq, wk, wv, wo, bq, bk, bv, bo):
        out, w = multi_head_attention(q, k, v, H, wq, bq, wk, bk, wv, bv, wo, bo, **spec)
        return (out, w) if w is not None else out

    inputs = (query, key, value, *ws, *bs)
    assert gradcheck(fn, inputs, **GRADCHECK)
    out = fn(*inputs)
    assert torch.isfinite(out[0] if isinstance(out, tuple) else out).all()


@pytest.mark.parametrize(
    "case", ["kpm_bool", "kpm_float", "attn_bool_4d", "attn_float_3d", "causal_rect", "weights", "dead_rows", "scale"]
)
def test_attention_gradcheck(case):
    q, k, v = f64(B, H, T, DH), f64(B, H, S, DH), f64(B, H, S, DH + 1)  # d_v ≠ d_head is allowed
    kw: dict = {}
    if case.startswith("kpm"):
        kw["key_padding_mask"] = _padding(case[4:], B, S)
    elif case == "attn_bool_4d":
        m = torch.rand(1, H, T, S) < 0.5
        m[..., -1] = False
        kw["attn_mask"] = m
    elif case == "attn_float_3d":
        kw["attn_mask"] = torch.randn(B * H, T, S, dtype=torch.float64)
    elif case == "causal_rect":
        kw["is_causal"] = True  # T_q < T_k: bottom-right
    elif case == "weights":
        kw.update(need_weights=True, key_padding_mask=_padding("bool", B, S))
    elif case == "dead_rows":
        kw.update(key_padding_mask=_padding("float", B, S, dead_row=True), need_weights=True)
    elif case == "scale":
        kw["scale"] = 0.37

    def fn(q, k, v):
        out, w = attention(q, k, v, **kw)
        return (out, w) if w is not None else out

    assert gradcheck(fn, (q, k, v), **GRADCHECK)


# --------------------------------------------------------------------------- the core vs SDPA


def _sdpa_reference(q, k, v, allowed=None, additive=None, scale=None):
    """Masks given to SDPA explicitly (its math path): bool True = may attend, or additive float."""
    mask = additive
    if allowed is not None:
        mask = allowed if mask is None else mask.masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "weights"])
def test_attention_masks_match_sdpa(need_weights):
    q, k, v = f64(B, H, T, DH), f64(B, H, S, DH), f64(B, H, S, DH)
    kpm = _padding("bool", B, S)
    am = torch.rand(T, S) < 0.3
    am[:, 0] = False
    bias = torch.randn(B, 1, T, S, dtype=torch.float64)
    cases = [
        ({"key_padding_mask": kpm}, {"allowed": ~kpm[:, None, None]}),
        ({"key_padding_mask": _padding("float", B, S)}, {"additive": _padding("float", B, S)[:, None, None]}),
        ({"attn_mask": am}, {"allowed": ~am}),
        ({"attn_mask": bias}, {"additive": bias}),
        ({"attn_mask": bias, "key_padding_mask": kpm}, {"additive": bias, "allowed": ~kpm[:, None, None]}),
        ({"attn_mask": am, "key_padding_mask": kpm}, {"allowed": ~am & ~kpm[:, None, None]}),
        ({"is_causal": True}, {"allowed": causal_mask(T, S)}),
        ({"is_causal": True, "attn_mask": bias}, {"allowed": causal_mask(T, S), "additive": bias}),
        ({"scale": 0.1}, {"scale": 0.1}),
    ]
    for ours_kw, ref_kw in cases:
        out, w = attention(q, k, v, need_weights=need_weights, **ours_kw)
        torch.testing.assert_close(out, _sdpa_reference(q, k, v, **ref_kw), msg=lambda m, c=ours_kw: f"{c}: {m}")
        if need_weights:
            assert w.shape == (B, H, T, S)
            torch.testing.assert_close(w @ v, out)


def test_square_causal_sdpa_path_equals_explicit_mask():
    """The flash-kernel path (is_causal to SDPA) and the explicit bottom-right mask give the same numbers."""
    q, k, v = f64(B, H, T, DH), f64(B, H, T, DH), f64(B, H, T, DH)
    fast, _ = attention(q, k, v, is_causal=True)
    explicit, _ = attention(q, k, v, attn_mask=~causal_mask(T, T))
    with_weights, _ = attention(q, k, v, is_causal=True, need_weights=True)
    torch.testing.assert_close(fast, explicit)
    torch.testing.assert_close(fast, with_weights)


@settings(max_examples=15)
@given(t_q=st.integers(1, 8), extra=st.integers(0, 5))
def test_causal_mask_is_bottom_right_aligned(t_q, extra):
    t_k = t_q + extra
    m = causal_mask(t_q, t_k)
    assert m.dtype == torch.bool and m.shape == (t_q, t_k)
    assert torch.equal(m, torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=extra))
    assert m[-1].all(), "the last query sees every key"
    # a query block that continues a prefix gives the rows of the full causal pass
    q, k, v = (
        torch.randn(1, 2, t_k, 3, dtype=torch.float64),
        torch.randn(1, 2, t_k, 3, dtype=torch.float64),
        torch.randn(1, 2, t_k, 3, dtype=torch.float64),
    )
    full, _ = attention(q, k, v, is_causal=True)
    tail, _ = attention(q[..., extra:, :], k, v, is_causal=True)
    torch.testing.assert_close(tail, full[..., extra:, :])


def test_causal_mask_square_equals_tril():
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


# --------------------------------------------------------------------------- half precision and dead rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_min_masks_in_half_precision_stay_finite(dtype):
    """kpm and attn_mask both at finfo.min: their sum overflows to -inf in half precision; a row blocked only that
    way must still give finite numbers (zeros), and other rows the same as the boolean masks."""
    q = torch.randn(B, H, T, DH).to(dtype)
    k, v = torch.randn(B, H, S, DH).to(dtype), torch.randn(B, H, S, DH).to(dtype)
    lo = torch.finfo(dtype).min
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[:, -2:] = True
    am = torch.zeros(T, S, dtype=torch.bool)
    am[0, :-2] = True  # query 0: every key blocked by one mask or the other
    am[:, -1] = True  # last key blocked by both: finfo.min + finfo.min
    for need_weights in (False, True):
        out, w = attention(
            q, k, v, key_padding_mask=torch.zeros(B, S, dtype=dtype).masked_fill(kpm, lo),
            attn_mask=torch.zeros(T, S, dtype=dtype).masked_fill(am, lo), need_weights=need_weights,
        )  # fmt: skip
        ref, _ = attention(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[:, :, 1:], ref[:, :, 1:])


@pytest.mark.parametrize("need_weights", [False, True])
def test_dead_rows_give_zeros_and_zero_grads(need_weights):
    q, k, v = f64(B, H, T, DH), f64(B, H, S, DH), f64(B, H, S, DH)
    am = torch.zeros(T, S, dtype=torch.bool)
    am[2] = True
    out, w = attention(q, k, v, attn_mask=am, need_weights=need_weights)
    assert (out[:, :, 2] == 0).all()
    if need_weights:
        assert (w[:, :, 2] == 0).all()
        torch.testing.assert_close(
            w[:, :, [i for i in range(T) if i != 2]].sum(-1), torch.ones(B, H, T - 1, dtype=torch.float64)
        )
    out.sum().backward()
    assert (q.grad[:, :, 2] == 0).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_empty_keys_give_zeros():
    q, k, v = f64(B, H, T, DH), f64(B, H, 0, DH), f64(B, H, 0, DH)
    kpm = torch.zeros(B, 0, dtype=torch.bool)
    out, w = attention(q, k, v, key_padding_mask=kpm, need_weights=True)
    assert out.shape == (B, H, T, DH) and (out == 0).all() and w.shape == (B, H, T, 0)


# --------------------------------------------------------------------------- KVCache


def test_kv_cache_appends_and_reorders():
    c = KVCache()
    assert len(c) == 0 and not c.filled
    k1, v1 = torch.randn(2, H, 3, DH), torch.randn(2, H, 3, DH)
    k2, v2 = torch.randn(2, H, 1, DH), torch.randn(2, H, 1, DH)
    c.update(k1, v1)
    k, v = c.update(k2, v2)
    assert c.filled and len(c) == 4
    torch.testing.assert_close(k, torch.cat([k1, k2], 2), rtol=0, atol=0)
    torch.testing.assert_close(v, torch.cat([v1, v2], 2), rtol=0, atol=0)
    c.reorder(torch.tensor([1, 1]))
    torch.testing.assert_close(c.k, torch.cat([k1, k2], 2)[[1, 1]], rtol=0, atol=0)


def test_static_kv_cache_keeps_first_update_only_when_reused():
    c = KVCache(static=True)
    k1, v1 = torch.randn(2, H, 3, DH), torch.randn(2, H, 3, DH)
    c.update(k1, v1)
    assert len(c) == 3
    ws, bs = _mha_params()
    x = torch.randn(2, 1, D, dtype=torch.float64)
    mem = torch.randn(2, 3, D, dtype=torch.float64)
    c64 = KVCache(static=True)
    args = (ws[0], bs[0], ws[1], bs[1], ws[2], bs[2], ws[3], bs[3])
    first, _ = multi_head_attention(x, mem, mem, H, *args, kv_cache=c64)
    again, _ = multi_head_attention(x, mem * 0 + 9, mem * 0 - 9, H, *args, kv_cache=c64)
    torch.testing.assert_close(first, again)
    assert len(c64) == 3


# --------------------------------------------------------------------------- bad input (functional)


def test_functional_bad_arguments():
    ws, bs = _mha_params()
    x = torch.randn(B, T, D, dtype=torch.float64)
    args = (ws[0], bs[0], ws[1], bs[1], ws[2], bs[2], ws[3], bs[3])
    with pytest.raises(ValueError, match="n_heads must be a positive int, got 0"):
        multi_head_attention(x, None, None, 0, *args)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        multi_head_attention(x, None, None, H, *args, dropout=1.5)
    with pytest.raises(TypeError, match=r"attn_mask must be bool .* got dtype torch.uint8"):
        attention(torch.randn(1, 1, 2, 3), torch.randn(1, 1, 2, 3), torch.randn(1, 1, 2, 3),
                  attn_mask=torch.zeros(2, 2, dtype=torch.uint8))  # fmt: skip


@pytest.mark.parametrize("name", ["key_padding_mask", "attn_mask"])
def test_a_mask_on_another_device_names_the_mask_and_both_devices(name):
    q = torch.randn(2, 3, 4, 5)
    shape = (2, 4) if name == "key_padding_mask" else (4, 4)
    mask = torch.zeros(shape, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=rf"{name} device meta does not match query device cpu"):
        attention(q, q, q, **{name: mask})
