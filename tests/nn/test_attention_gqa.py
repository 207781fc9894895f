"""Grouped-query attention in MultiHeadAttention (``n_kv_heads``, ``head_dim``, ``rotary``): equal to full
multi-head attention with each key/value head's weights repeated for its group, forward and backward; the KV
cache keeps the key/value heads only; gradcheck; bad arguments."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import sublayer.functional as SF
from sublayer import KVCache, MultiHeadAttention, record_attention

from ._weights import randomize_

D, H, HD = 14, 6, 4  # head_dim given: 6 heads of 4 on a model size of 14
B, T = 3, 7


def _pair(n_kv: int, *, bias: bool = True, dtype=torch.float32):
    """(GQA module, equivalent full MHA with k/v weights repeated per group)."""
    gqa = randomize_(MultiHeadAttention(D, H, n_kv_heads=n_kv, head_dim=HD, bias=bias, dtype=dtype))
    full = MultiHeadAttention(D, H, head_dim=HD, bias=bias, dtype=dtype)
    with torch.no_grad():
        for name in ("q_proj", "out_proj"):
            getattr(full, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(full, name)
            dst.weight.copy_(src.weight.view(n_kv, HD, D).repeat_interleave(H // n_kv, 0).reshape(H * HD, D))
            if bias:
                dst.bias.copy_(src.bias.view(n_kv, HD).repeat_interleave(H // n_kv, 0).reshape(-1))
    return gqa, full


def _rotary(t: int, offset: int = 0, dtype=torch.float32):
    return SF.rotary_cos_sin(torch.arange(offset, offset + t)[None], HD, 100.0, dtype=dtype)


@pytest.mark.parametrize("n_kv", [1, 2, 3, 6])
def test_equals_full_attention_with_repeated_kv_weights(n_kv):
    gqa, full = _pair(n_kv)
    x = torch.randn(B, T, D)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, :2] = True
    kw = {"key_padding_mask": kpm, "is_causal": True, "rotary": _rotary(T)}
    out, ref = gqa(x, **kw)[0], full(x, **kw)[0]
    assert_close(out, ref)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    for name in ("q_proj", "out_proj"):
        assert_close(getattr(gqa, name).weight.grad, getattr(full, name).weight.grad)
    for name in ("k_proj", "v_proj"):  # a shared kv head gets the sum of its group's gradients
        want = getattr(full, name).weight.grad.view(n_kv, H // n_kv, HD, D).sum(1).reshape(n_kv * HD, D)
        assert_close(getattr(gqa, name).weight.grad, want)


@pytest.mark.parametrize("n_kv", [1, 2])
def test_kv_cache_holds_kv_heads_and_decoding_equals_full_causal(n_kv):
    gqa, _ = _pair(n_kv)
    gqa.eval()
    x = torch.randn(B, T, D)
    want = gqa(x, is_causal=True, rotary=_rotary(T))[0]
    cache = KVCache()
    steps = [gqa(x[:, :3], is_causal=True, kv_cache=cache, rotary=_rotary(3))[0]]
    for t in range(3, T):
        steps.append(gqa(x[:, t:t + 1], is_causal=True, kv_cache=cache, rotary=_rotary(1, t))[0])
    assert cache.k.shape == cache.v.shape == (B, n_kv, T, HD)
    assert_close(torch.cat(steps, 1), want)


def test_record_attention_gives_query_heads():
    gqa, full = _pair(2)
    x = torch.randn(B, T, D)
    with record_attention(gqa) as maps, torch.no_grad():
        out = gqa(x, is_causal=True, rotary=_rotary(T))[0]
    assert maps["attention"][0].shape == (B, H, T, T)
    assert_close(out, full(x, is_causal=True, rotary=_rotary(T))[0])


def test_gradcheck_float64():
    gqa, _ = _pair(2, dtype=torch.float64)
    x = torch.randn(2, 4, D, dtype=torch.float64, requires_grad=True)
    rotary = _rotary(4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: gqa(t, is_causal=True, rotary=rotary)[0], (x,))


def test_shapes_and_repr():
    m = MultiHeadAttention(D, H, n_kv_heads=2, head_dim=HD)
    assert m.q_proj.weight.shape == (H * HD, D) and m.k_proj.weight.shape == (2 * HD, D)
    assert m.out_proj.weight.shape == (D, H * HD)
    assert "n_kv_heads=2" in repr(m) and "head_dim=4" in repr(m)
    assert MultiHeadAttention(15, 3).n_kv_heads == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 15, "n_heads": 5, "n_kv_heads": 2}, r"n_heads \(5\) must be divisible by n_kv_heads \(2\)"),
        ({"d_model": 15, "n_heads": 5, "n_kv_heads": 0}, "n_kv_heads must be a positive int, got 0"),
        ({"d_model": 14, "n_heads": 6}, r"d_model \(14\) must be divisible by n_heads \(6\)"),
        ({"d_model": 14, "n_heads": 6, "head_dim": -4}, "head_dim must be a positive int, got -4"),
    ],
)
def test_bad_head_layout(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(**kwargs)
