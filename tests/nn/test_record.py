"""record_attention: per-layer, per-head maps out of blocks, stacks and models, without changing their outputs."""

from __future__ import annotations

import pytest
import torch

from sublayer import DecoderBlock, EncoderBlock, MultiHeadAttention, PositionWiseFFN, TransformerEncoder, record_attention

D, H, B, T, S = 15, 3, 2, 7, 5


def test_encoder_stack_maps_are_per_layer_per_head_and_match_the_attention():
    enc = TransformerEncoder(EncoderBlock(D, H, 11), 2).eval()
    x = torch.randn(B, T, D)
    pad = torch.arange(T)[None] >= torch.tensor([T, 4])[:, None]
    plain = enc(x, key_padding_mask=pad)
    with record_attention(enc) as maps:
        out = enc(x, key_padding_mask=pad)
    torch.testing.assert_close(out, plain)  # recording does not change the result
    assert list(maps) == ["layers.0.self_attn", "layers.1.self_attn"]
    w0 = maps["layers.0.self_attn"][0]
    assert w0.shape == (B, H, T, T) and not w0.requires_grad
    torch.testing.assert_close(w0.sum(-1), torch.ones(B, H, T))
    assert (w0[1, :, :, 4:] == 0).all()  # padded keys get no weight
    # the first layer's map is the weights its attention gives on the stack's input
    ref = enc.layers[0].self_attn(x, key_padding_mask=pad, need_weights=True, average_attn_weights=False)[1]
    torch.testing.assert_close(w0, ref)


def test_decoder_block_records_self_and_cross_attention_and_keeps_callers_request():
    blk = DecoderBlock(D, H, 11).eval()
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    with record_attention(blk) as maps:
        blk(x, mem)
        # a caller that asked for averaged weights still gets them averaged
        out, avg = blk.self_attn(x, need_weights=True)
        _, none = blk.self_attn(x)
    assert set(maps) == {"self_attn", "cross_attn"}
    assert maps["cross_attn"][0].shape == (B, H, T, S)
    self_w = maps["self_attn"][0]
    assert torch.triu(self_w[0, 0], diagonal=1).abs().max() == 0  # causal
    assert avg.shape == (B, T, T) and none is None and len(maps["self_attn"]) == 3
    # hooks are gone after the block
    assert not blk.self_attn._forward_hooks and not blk.self_attn._forward_pre_hooks


def test_record_keeps_graph_when_asked():
    mha = MultiHeadAttention(D, H)
    x = torch.randn(B, T, D, requires_grad=True)
    with record_attention(mha, detach=False) as maps:
        mha(x)
    maps["attention"][0][..., 0].sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_record_rejects_bad_modules():
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        with record_attention("encoder"):
            pass
    with pytest.raises(ValueError, match="PositionWiseFFN.*no sublayer MultiHeadAttention"):
        with record_attention(PositionWiseFFN(D, 11)):
            pass


def test_transformer_model_cross_attention_equals_its_own_accessor():
    from sublayer.models import Transformer

    model = Transformer(11, 13, d_model=D, n_heads=H, d_ff=7, n_layers=2, dropout=0.0).eval()
    src, tgt = torch.randint(0, 11, (B, S)), torch.randint(0, 13, (B, T))
    pad = torch.arange(S)[None] >= torch.tensor([S, 2])[:, None]
    with record_attention(model) as maps:
        logits = model(src, tgt, src_key_padding_mask=pad)
    assert logits.shape == (B, T, 13)
    cross = [maps[f"decoder.layers.{i}.cross_attn"][0] for i in range(2)]
    for got, want in zip(cross, model.cross_attention_weights(src, tgt, src_key_padding_mask=pad), strict=True):
        torch.testing.assert_close(got, want)
    assert maps["encoder.layers.0.self_attn"][0].shape == (B, H, S, S)
