"""Hooks on the linears and norms inside sublayer's modules see every call: the modules then call them instead of
reading their weights into the fused kernels, with the same results."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import sublayer as sl
from sublayer.functional.packing import PackedBatch
from sublayer.nn.hooks import hooked


def _probe(calls: list, scale: float = 1.0):
    def hook(mod, args, out):
        calls.append(tuple(out.shape))
        return out * scale

    return hook


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_ffn_calls_its_hooked_linears(activation):
    torch.manual_seed(0)
    ffn = sl.PositionWiseFFN(7, 11, activation=activation)
    x = torch.randn(3, 5, 7, requires_grad=True)
    want = ffn(x)
    (gw,) = torch.autograd.grad(want.square().sum(), x)
    calls: list = []
    handle = ffn.fc1.register_forward_hook(_probe(calls))
    got = ffn(x)
    (gg,) = torch.autograd.grad(got.square().sum(), x)
    assert calls == [(3, 5, 22 if activation == "swiglu" else 11)]
    assert_close(got, want)
    assert_close(gg, gw)
    handle.remove()
    handle = ffn.fc2.register_forward_hook(_probe(calls, 2.0))
    assert_close(ffn(x), 2.0 * want)
    handle.remove()


def test_attention_calls_its_hooked_projections():
    torch.manual_seed(0)
    attn = sl.MultiHeadAttention(15, n_heads=3).eval()
    x, mem = torch.randn(2, 5, 15), torch.randn(2, 7, 15)
    pad = torch.tensor([[False] * 5, [True] * 2 + [False] * 3])
    want_self = attn(x, key_padding_mask=pad, is_causal=True)[0]
    want_cross = attn(x, mem, mem)[0]
    calls: list = []
    handles = [getattr(attn, n).register_forward_hook(_probe(calls)) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    assert_close(attn(x, key_padding_mask=pad, is_causal=True)[0], want_self)
    assert calls == [(2, 5, 15)] * 4
    assert_close(attn(x, mem, mem)[0], want_cross)
    assert calls[4:] == [(2, 5, 15), (2, 7, 15), (2, 7, 15), (2, 5, 15)]
    pk = PackedBatch(pad)
    packed = pk.unpack(attn(pk.pack(x), packing=pk, is_causal=True)[0])
    assert_close(packed, want_self.masked_fill(pad[..., None], 0))
    assert len(calls) == 12
    handles[3].remove()
    handles.append(attn.out_proj.register_forward_hook(_probe(calls, -1.0)))
    assert_close(attn(x, mem, mem)[0], -want_cross)
    for h in handles:
        h.remove()


def test_add_norm_calls_its_hooked_norm():
    torch.manual_seed(0)
    add_norm = sl.AddNorm(7)
    x, y = torch.randn(3, 5, 7), torch.randn(3, 5, 7)
    want = add_norm(x, y)
    calls: list = []
    handle = add_norm.norm.register_forward_hook(_probe(calls, 3.0))
    assert_close(add_norm(x, y), 3.0 * want)
    assert calls == [(3, 5, 7)]
    handle.remove()


def test_hooked():
    lin = torch.nn.Linear(3, 5)
    seq = torch.nn.Sequential(lin)
    assert not hooked(seq)
    h = lin.register_forward_pre_hook(lambda m, a: None)
    assert hooked(seq) and hooked(lin)
    h.remove()
    h = lin.register_full_backward_hook(lambda m, gi, go: None)
    assert not hooked(seq) and hooked(seq, backward=True)
    h.remove()
    h = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    assert hooked()
    h.remove()


def test_backward_hooks_on_the_children_fire():
    """A full backward hook on ``ffn.fc1``, a projection or the norm of Add & Norm (a gradient probe) fires as on
    ``nn.Linear`` called in a plain FFN: the modules call the hooked children, with the same gradients."""
    torch.manual_seed(0)
    ffn, attn, add_norm = sl.PositionWiseFFN(15, 11), sl.MultiHeadAttention(15, 3), sl.AddNorm(15)
    x = torch.randn(2, 5, 15, requires_grad=True)

    def loss() -> torch.Tensor:
        h = ffn(x)
        return add_norm(h, attn(h)[0]).square().sum()

    (want,) = torch.autograd.grad(loss(), x)
    seen: list = []
    for mod in (ffn.fc1, attn.q_proj, attn.out_proj, add_norm.norm):
        mod.register_full_backward_hook(lambda m, gi, go: seen.append(tuple(go[0].shape)))
    (got,) = torch.autograd.grad(loss(), x)
    assert sorted(seen) == sorted([(2, 5, 11), (2, 5, 15), (2, 5, 15), (2, 5, 15)])
    assert_close(got, want)
