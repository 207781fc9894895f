"""EncoderBlock.from_torch / DecoderBlock.from_torch: live torch layers converted, outputs and gradients equal
(max abs difference <= 1e-6 in fp32), and clear errors for what cannot convert."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sublayer import DecoderBlock, EncoderBlock

from ._weights import assert_grads_close, decoder_layer_pairs, encoder_layer_pairs, leaf, randomize_

D, H, F = 15, 3, 11
B, T, S = 3, 7, 5
TOL = {"atol": 1e-6, "rtol": 0.0}  # the target: max abs difference <= 1e-6 (fp32)
# Parameter gradients are sums over B·T positions of O(1) terms: summation order alone moves them by a few fp32
# ulps of their magnitude (~1e-6 absolute at |grad| ~ 3), so they are held to assert_close's fp32 defaults here,
# and to 1e-12 in float64 (test_conversion_is_exact_in_float64), where no rounding can hide a mapping error.


def padding(lengths, t):
    return torch.arange(t)[None, :] >= torch.tensor(lengths)[:, None]


def backward_both(out, ref_out, inputs, pairs):
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref_out * g).sum().backward()
    for a, b in inputs:
        torch.testing.assert_close(a.grad, b.grad, **TOL)
    assert_grads_close(pairs, **(TOL if out.dtype == torch.float64 else {}))


@pytest.mark.parametrize(
    "norm_first, activation, bias",
    [(False, "relu", True), (True, "gelu", True), (False, nn.GELU(approximate="tanh"), False), (True, nn.SiLU(), True)],
)
def test_encoder_layer_converts(norm_first, activation, bias):
    ref = nn.TransformerEncoderLayer(
        D, H, F, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first, bias=bias
    )
    randomize_(ref)
    ours = EncoderBlock.from_torch(ref)
    assert ours.norm_first == norm_first and ours.training == ref.training
    assert ours.self_attn.q_proj.weight.data_ptr() != ref.self_attn.in_proj_weight.data_ptr()  # copied
    x = torch.randn(B, T, D)
    pad = padding([T, 4, 2], T)
    xa, xb = leaf(x), leaf(x)
    out = ours(xa, key_padding_mask=pad)
    ref_out = ref(xb, src_key_padding_mask=pad)
    torch.testing.assert_close(out, ref_out, **TOL)
    backward_both(out, ref_out, [(xa, xb)], encoder_layer_pairs(ours, ref))


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_converts(norm_first):
    ref = nn.TransformerDecoderLayer(D, H, F, dropout=0.0, batch_first=True, norm_first=norm_first, activation="gelu")
    randomize_(ref)
    ours = DecoderBlock.from_torch(ref)
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    mpad = padding([S, 1, 3], S)
    xa, xb, ma, mb = leaf(x), leaf(x), leaf(mem), leaf(mem)
    out = ours(xa, ma, memory_key_padding_mask=mpad)
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    ref_out = ref(xb, mb, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mpad)
    torch.testing.assert_close(out, ref_out, **TOL)
    backward_both(out, ref_out, [(xa, xb), (ma, mb)], decoder_layer_pairs(ours, ref))


@pytest.mark.parametrize("decoder", [False, True])
def test_conversion_is_exact_in_float64(decoder):
    kw = {"dropout": 0.0, "batch_first": True, "dtype": torch.float64, "norm_first": decoder}
    ref = randomize_(nn.TransformerDecoderLayer(D, H, F, **kw) if decoder else nn.TransformerEncoderLayer(D, H, F, **kw))
    ours = (DecoderBlock if decoder else EncoderBlock).from_torch(ref)
    x, mem = leaf(torch.randn(B, T, D, dtype=torch.float64)), torch.randn(B, S, D, dtype=torch.float64)
    xr = leaf(x)
    if decoder:
        out, ref_out = ours(x, mem), ref(xr, mem, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T))
        pairs = decoder_layer_pairs(ours, ref)
    else:
        out, ref_out = ours(x), ref(xr)
        pairs = encoder_layer_pairs(ours, ref)
    tight = {"atol": 1e-12, "rtol": 0.0}
    torch.testing.assert_close(out, ref_out, **tight)
    g = torch.randn_like(out)
    (out * g).sum().backward(), (ref_out * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **tight)
    assert_grads_close(pairs, **tight)


def test_eval_mode_dtype_and_dropout_carry_over():
    ref = nn.TransformerEncoderLayer(D, H, F, dropout=0.25, batch_first=True, dtype=torch.float64).eval()
    ours = EncoderBlock.from_torch(ref)
    assert not ours.training and ours.self_attn.q_proj.weight.dtype == torch.float64
    assert ours.self_attn.dropout == 0.25 and ours.ffn.dropout == 0.25 and ours.attn_residual.dropout == 0.25


def test_unconvertible_layers_name_what_differs():
    with pytest.raises(ValueError, match="activation .*leaky_relu.* no sublayer equivalent"):
        EncoderBlock.from_torch(nn.TransformerEncoderLayer(D, H, F, activation=nn.functional.leaky_relu))
    ref = nn.TransformerEncoderLayer(D, H, F)
    ref.linear1.bias = None  # bias-less mismatch
    with pytest.raises(ValueError, match="biases for .*ffn.fc2.bias.* but none for ffn.fc1.bias"):
        EncoderBlock.from_torch(ref)
    ref = nn.TransformerEncoderLayer(D, H, F)
    ref.norm2.eps = 1e-6
    with pytest.raises(ValueError, match=r"one norm eps .*norm1.eps=1e-05, norm2.eps=1e-06"):
        EncoderBlock.from_torch(ref)
    ref = nn.TransformerEncoderLayer(D, H, F, dropout=0.1)
    ref.dropout2.p = 0.3
    with pytest.raises(ValueError, match="one dropout probability .*dropout2.p=0.3"):
        EncoderBlock.from_torch(ref)
    ref = nn.TransformerEncoderLayer(D, H, F)
    ref.self_attn = nn.MultiheadAttention(D, H, add_bias_kv=True)
    with pytest.raises(ValueError, match="self_attn has add_bias_kv=True"):
        EncoderBlock.from_torch(ref)
    with pytest.raises(TypeError, match="DecoderBlock.from_torch needs an nn.TransformerDecoderLayer"):
        DecoderBlock.from_torch(nn.TransformerEncoderLayer(D, H, F))
    with pytest.raises(TypeError, match="EncoderBlock.from_torch needs an nn.TransformerEncoderLayer"):
        EncoderBlock.from_torch(nn.Linear(3, 3))


def test_decoder_layer_with_another_memory_size_converts():
    """A cross-attention with kdim = vdim != d_model converts to a DecoderBlock with that memory_dim."""
    ref = nn.TransformerDecoderLayer(D, H, F, dropout=0.0, batch_first=True)
    ref.multihead_attn = nn.MultiheadAttention(D, H, kdim=7, vdim=7, batch_first=True, dropout=0.0)
    randomize_(ref)
    ours = DecoderBlock.from_torch(ref)
    x, mem = torch.randn(B, T, D), torch.randn(B, S, 7)
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    torch.testing.assert_close(ours(x, mem), ref(x, mem, tgt_mask=causal, tgt_is_causal=True), **TOL)


def test_attention_shapes_a_block_cannot_hold_are_named():
    ref = nn.TransformerDecoderLayer(D, H, F, dropout=0.0)
    ref.multihead_attn = nn.MultiheadAttention(D, 5, dropout=0.0)  # 5 heads beside self_attn's 3: no silent 3
    with pytest.raises(ValueError, match="one number of heads .*self_attn.num_heads=3, multihead_attn.num_heads=5"):
        DecoderBlock.from_torch(ref)
    ref.multihead_attn = nn.MultiheadAttention(D, H, kdim=7, vdim=13, dropout=0.0)
    with pytest.raises(ValueError, match="multihead_attn has kdim=7 and vdim=13: .*one memory size"):
        DecoderBlock.from_torch(ref)
    ref = nn.TransformerEncoderLayer(D, H, F, dropout=0.0)
    ref.self_attn = nn.MultiheadAttention(D, H, kdim=7, vdim=7, dropout=0.0)
    with pytest.raises(ValueError, match=r"self_attn has kdim=7 and vdim=7: .*d_model=15"):
        EncoderBlock.from_torch(ref)
