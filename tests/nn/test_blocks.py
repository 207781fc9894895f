"""EncoderBlock / DecoderBlock vs ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` (batch_first, dropout
0, copied weights): post- and pre-norm, relu and gelu, eval and train, padding masks, forward and backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sublayer import AddNorm, DecoderBlock, EncoderBlock, KVCache, LayerNorm, PreNormResidual, RMSNorm

from ._weights import (
    backward_both,
    copy_pairs,
    decoder_layer_pairs,
    encoder_layer_pairs,
    leaf,
    randomize_,
)

D, H, F = 15, 3, 11
B, T, S = 3, 7, 5
LENGTHS, MEM_LENGTHS = [T, 5, 2], [S, 1, 3]  # right padding; every row keeps at least one real token


def padding(lengths, t):
    return torch.arange(t)[None, :] >= torch.tensor(lengths)[:, None]  # True = padding


def encoder_pair(norm_first=False, activation="relu", bias=True):
    ref = nn.TransformerEncoderLayer(
        D, H, F, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first, bias=bias
    )
    randomize_(ref)
    ours = EncoderBlock(D, H, F, activation=activation, norm_first=norm_first, bias=bias)
    copy_pairs(encoder_layer_pairs(ours, ref))
    return ours, ref


def decoder_pair(norm_first=False, activation="relu", bias=True):
    ref = nn.TransformerDecoderLayer(
        D, H, F, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first, bias=bias
    )
    randomize_(ref)
    ours = DecoderBlock(D, H, F, activation=activation, norm_first=norm_first, bias=bias)
    copy_pairs(decoder_layer_pairs(ours, ref))
    return ours, ref


# --------------------------------------------------------------------------- encoder


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_encoder_block_matches_torch(norm_first, activation, mode):
    ours, ref = encoder_pair(norm_first, activation)
    ours.train(mode == "train"), ref.train(mode == "train")
    x = torch.randn(B, T, D)
    kpm = padding(LENGTHS, T)
    x1, x2 = leaf(x), leaf(x)
    out = ours(x1, key_padding_mask=kpm)
    ref_out = ref(x2, src_key_padding_mask=kpm)  # grad enabled: torch's slow (reference) path
    torch.testing.assert_close(out, ref_out)
    backward_both(out, ref_out, [(x1, x2)], encoder_layer_pairs(ours, ref))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_encoder_block_matches_torch_eval_fast_path(norm_first):
    """Under no_grad in eval torch takes its fused fast path (nested tensors), which zeroes or garbles padded query
    positions (pytorch#86120, #118628): compare the real positions only."""
    ours, ref = encoder_pair(norm_first, "relu")
    ours.eval(), ref.eval()
    x = torch.randn(B, T, D)
    kpm = padding(LENGTHS, T)
    with torch.no_grad():
        out, ref_out = ours(x, key_padding_mask=kpm), ref(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(out[~kpm], ref_out[~kpm])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_encoder_block_half_precision_error_within_torch_error(norm_first, dtype):
    """Low precision: our error against torch's float64 layer must stay within 2× the error of torch's own layer
    run in the same precision (REFERENCE.md §3) — no magic tolerance."""
    ref = nn.TransformerEncoderLayer(D, H, F, dropout=0.0, batch_first=True, norm_first=norm_first, dtype=torch.float64)
    randomize_(ref)
    ours = EncoderBlock(D, H, F, norm_first=norm_first, dtype=torch.float64)
    copy_pairs(encoder_layer_pairs(ours, ref))
    x = torch.randn(B, T, D, dtype=torch.float64)
    kpm = padding(LENGTHS, T)
    with torch.no_grad():
        exact = ref(x, src_key_padding_mask=kpm)
        ref_lp, ours_lp, x_lp = copy.deepcopy(ref).to(dtype), copy.deepcopy(ours).to(dtype), x.to(dtype)
        ref_out = ref_lp(x_lp, src_key_padding_mask=kpm)
        out = ours_lp(x_lp, key_padding_mask=kpm)
    assert out.dtype == dtype
    real = ~kpm  # torch's no-grad fast path may zero padded positions
    ours_err = (out.double() - exact)[real].abs().max()
    ref_err = (ref_out.double() - exact)[real].abs().max()
    assert ref_err > 0 and ours_err <= 2 * ref_err, (ours_err, ref_err)


@pytest.mark.parametrize("kind", ["bool_mask", "float_mask", "causal"])
def test_encoder_block_attn_mask_matches_torch(kind):
    ours, ref = encoder_pair(True, "gelu")
    x = torch.randn(B, T, D)
    tri = torch.ones(T, T, dtype=torch.bool).triu(1)
    x1, x2 = leaf(x), leaf(x)
    if kind == "bool_mask":
        m = torch.rand(T, T) < 0.4
        m.fill_diagonal_(False)
        out, ref_out = ours(x1, attn_mask=m), ref(x2, src_mask=m)
    elif kind == "float_mask":
        m = torch.randn(T, T)
        out, ref_out = ours(x1, attn_mask=m), ref(x2, src_mask=m)
    else:
        out, ref_out = ours(x1, is_causal=True), ref(x2, src_mask=tri, is_causal=True)
    torch.testing.assert_close(out, ref_out)
    backward_both(out, ref_out, [(x1, x2)], encoder_layer_pairs(ours, ref))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_encoder_block_rms_norm_matches_torch_with_rmsnorm(norm_first):
    """norm="rms": the same as torch's layer with its two norms swapped for ``nn.RMSNorm`` (same eps)."""
    ref = nn.TransformerEncoderLayer(D, H, F, dropout=0.0, batch_first=True, norm_first=norm_first)
    ref.norm1, ref.norm2 = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
    randomize_(ref)
    ours = EncoderBlock(D, H, F, norm_first=norm_first, norm="rms", eps=1e-6)
    assert isinstance(ours.attn_residual.norm, RMSNorm) and ours.attn_residual.norm.eps == 1e-6
    copy_pairs(encoder_layer_pairs(ours, ref))
    x = torch.randn(B, T, D)
    x1, x2 = leaf(x), leaf(x)
    kpm = padding(LENGTHS, T)
    out, ref_out = ours(x1, key_padding_mask=kpm), ref(x2, src_key_padding_mask=kpm)
    torch.testing.assert_close(out, ref_out)
    backward_both(out, ref_out, [(x1, x2)], encoder_layer_pairs(ours, ref))


def test_encoder_block_padding_invariance_and_batch_row():
    block = randomize_(EncoderBlock(D, H, F, norm_first=True))
    kpm = padding(LENGTHS, T)
    x = torch.randn(B, T, D)
    y = torch.where(kpm[..., None], 50 * torch.randn(B, T, D), x)
    with torch.no_grad():
        a, b = block(x, key_padding_mask=kpm), block(y, key_padding_mask=kpm)
        alone = block(x[1:2], key_padding_mask=kpm[1:2])
    torch.testing.assert_close(a[~kpm], b[~kpm])
    torch.testing.assert_close(a[1:2], alone)


# --------------------------------------------------------------------------- decoder


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_decoder_block_matches_torch(norm_first, activation, mode):
    ours, ref = decoder_pair(norm_first, activation)
    ours.train(mode == "train"), ref.train(mode == "train")
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    tkpm, mkpm = padding(LENGTHS, T), padding(MEM_LENGTHS, S)
    x1, x2, m1, m2 = leaf(x), leaf(x), leaf(mem), leaf(mem)
    out = ours(x1, m1, tgt_key_padding_mask=tkpm, memory_key_padding_mask=mkpm)
    ref_out = ref(
        x2, m2, tgt_mask=torch.ones(T, T, dtype=torch.bool).triu(1), tgt_is_causal=True,
        tgt_key_padding_mask=tkpm, memory_key_padding_mask=mkpm,
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out)
    backward_both(out, ref_out, [(x1, x2), (m1, m2)], decoder_layer_pairs(ours, ref))


@pytest.mark.parametrize("kind", ["encoder-post", "decoder-pre"])
def test_no_bias_blocks_match_torch(kind):
    """``bias=False`` as in torch: no bias in any linear nor in the LayerNorms."""
    enc = kind.startswith("encoder")
    ours, ref = encoder_pair(False, bias=False) if enc else decoder_pair(True, bias=False)
    assert not any(n.endswith("bias") for n, _ in ours.named_parameters())
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    x, mem = leaf(torch.randn(B, T, D)), torch.randn(B, S, D)
    x2 = leaf(x)
    kpm = padding(LENGTHS, T)
    if enc:
        out, ref_out = ours(x, key_padding_mask=kpm), ref(x2, src_key_padding_mask=kpm)
        pairs = encoder_layer_pairs(ours, ref)
    else:
        tri = torch.ones(T, T, dtype=torch.bool).triu(1)
        out, ref_out = ours(x, mem, tgt_key_padding_mask=kpm), ref(x2, mem, tgt_mask=tri, tgt_key_padding_mask=kpm)
        pairs = decoder_layer_pairs(ours, ref)
    torch.testing.assert_close(out, ref_out)
    backward_both(out, ref_out, [(x, x2)], pairs)


def test_decoder_self_attention_is_causal():
    block = randomize_(DecoderBlock(D, H, F))
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    y = x.clone()
    y[:, 4:] += 10 * torch.randn(B, T - 4, D)
    with torch.no_grad():
        a, b = block(x, mem), block(y, mem)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("chunks", [[1] * T, [4, 3]], ids=["tokens", "chunks"])
def test_decoder_block_incremental_decoding_equals_full(norm_first, chunks):
    block = randomize_(DecoderBlock(D, H, F, norm_first=norm_first)).eval()
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    mkpm = padding(MEM_LENGTHS, S)
    with torch.no_grad():
        full = block(x, mem, memory_key_padding_mask=mkpm)
        sc, cc = KVCache(), KVCache(static=True)
        outs, start = [], 0
        for n in chunks:
            outs.append(block(x[:, start : start + n], mem, memory_key_padding_mask=mkpm,
                              self_attn_cache=sc, cross_attn_cache=cc))  # fmt: skip
            start += n
        assert len(sc) == T and len(cc) == S
    torch.testing.assert_close(torch.cat(outs, 1), full)


def test_decoder_block_memory_dim():
    block = DecoderBlock(D, H, F, memory_dim=7)
    assert block.cross_attn.kdim == block.cross_attn.vdim == 7
    assert block.cross_attn.k_proj.weight.shape == (D, 7)
    out = block(torch.randn(B, T, D), torch.randn(B, S, 7))
    assert out.shape == (B, T, D)
    with pytest.raises(ValueError, match=r"key must have last dim 7, got shape \(3, 5, 15\)"):
        block(torch.randn(B, T, D), torch.randn(B, S, D))


# --------------------------------------------------------------------------- structure, dropout, bad input


@pytest.mark.parametrize("cls", [EncoderBlock, DecoderBlock])
def test_residual_wiring_follows_norm_first(cls):
    post, pre = cls(D, H, F, eps=1e-3), cls(D, H, F, norm_first=True, eps=1e-3)
    residuals = [n for n, _ in post.named_children() if n.endswith("residual")]
    assert len(residuals) == (2 if cls is EncoderBlock else 3)
    for name in residuals:
        assert isinstance(getattr(post, name), AddNorm) and isinstance(getattr(pre, name), PreNormResidual)
        for blk in (post, pre):
            norm = getattr(blk, name).norm
            assert isinstance(norm, LayerNorm) and norm.eps == 1e-3


@pytest.mark.parametrize("cls", [EncoderBlock, DecoderBlock])
def test_dropout_only_in_training(cls):
    block = cls(D, H, F, dropout=0.3)
    plain = cls(D, H, F)
    plain.load_state_dict(block.state_dict())
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    args = (x,) if cls is EncoderBlock else (x, mem)
    with torch.no_grad():
        assert not torch.allclose(block(*args), block(*args))
        block.eval(), plain.eval()
        torch.testing.assert_close(block(*args), plain(*args))


@pytest.mark.parametrize("cls", [EncoderBlock, DecoderBlock])
@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((10, 4), {}, ValueError, r"d_model \(10\) must be divisible by n_heads \(4\)"),
        ((0, 1), {}, ValueError, "d_model must be a positive int, got 0"),
        ((8, 0), {}, ValueError, "n_heads must be a positive int, got 0"),
        ((8, 2, -4), {}, ValueError, "d_ff must be a positive int, got -4"),
        ((8, 2), {"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\), got 1.0"),
        ((8, 2), {"norm": "batch"}, ValueError, "unknown norm 'batch'; choose one of: layer, rms"),
        ((8, 2), {"activation": "tanh"}, ValueError, "unknown activation 'tanh'; choose one of: relu, gelu"),
        ((8, 2), {"eps": 0.0}, ValueError, "eps must be > 0, got 0.0"),
    ],
    ids=["divisible", "d_model", "n_heads", "d_ff", "dropout", "norm", "activation", "eps"],
)
def test_bad_block_args(cls, args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cls(*args, **kwargs)


def test_block_bad_forward_input():
    enc, dec = EncoderBlock(6, 2, 5), DecoderBlock(6, 2, 5)
    x = torch.randn(2, 4, 6)
    with pytest.raises(
        ValueError, match=r"key_padding_mask must have shape \(batch, key_len\) = \(2, 4\), got \(2, 3\)"
    ):
        enc(x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be bool"):
        dec(x, x, memory_key_padding_mask=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"share the batch size"):
        dec(x, torch.randn(3, 4, 6))
