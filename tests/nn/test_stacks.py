"""TransformerEncoder / TransformerDecoder stacks vs ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` (copied
weights, forward and backward), the single final norm of a pre-norm stack, layer copies and incremental decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sublayer import (
    DecoderBlock,
    EncoderBlock,
    LayerNorm,
    MultiHeadAttention,
    RMSNorm,
    TransformerDecoder,
    TransformerEncoder,
)

from ._weights import backward_both, copy_pairs, leaf, randomize_, stack_pairs

D, H, F, N = 15, 3, 11, 3
B, T, S = 3, 6, 5
TKPM = torch.arange(T)[None, :] >= torch.tensor([T, 4, 1])[:, None]
MKPM = torch.arange(S)[None, :] >= torch.tensor([S, 2, 3])[:, None]


def encoder_pair(norm_first, bias=True):
    ours = TransformerEncoder(EncoderBlock(D, H, F, norm_first=norm_first, bias=bias), N)
    layer = nn.TransformerEncoderLayer(D, H, F, dropout=0.0, batch_first=True, norm_first=norm_first, bias=bias)
    final = nn.LayerNorm(D, bias=bias) if norm_first else None
    ref = nn.TransformerEncoder(layer, N, norm=final, enable_nested_tensor=False)
    randomize_(ref)
    copy_pairs(stack_pairs(ours, ref))
    return ours, ref


def decoder_pair(norm_first):
    ours = TransformerDecoder(DecoderBlock(D, H, F, norm_first=norm_first, activation="gelu"), N)
    layer = nn.TransformerDecoderLayer(D, H, F, dropout=0.0, batch_first=True, norm_first=norm_first, activation="gelu")
    ref = nn.TransformerDecoder(layer, N, norm=nn.LayerNorm(D) if norm_first else None)
    randomize_(ref)
    copy_pairs(stack_pairs(ours, ref))
    return ours, ref


@pytest.mark.parametrize(
    ("norm_first", "bias"), [(False, True), (True, True), (True, False)], ids=["post", "pre", "pre-nobias"]
)
def test_encoder_stack_matches_torch(norm_first, bias):
    ours, ref = encoder_pair(norm_first, bias)
    if not bias:
        assert ours.norm.bias is None and not any(n.endswith("bias") for n, _ in ours.named_parameters())
    x = torch.randn(B, T, D)
    x1, x2 = leaf(x), leaf(x)
    out, ref_out = ours(x1, key_padding_mask=TKPM), ref(x2, src_key_padding_mask=TKPM)
    torch.testing.assert_close(out, ref_out)
    backward_both(out, ref_out, [(x1, x2)], stack_pairs(ours, ref))


def test_encoder_stack_matches_torch_nested_fast_path():
    """Post-norm, eval, no_grad: torch runs its nested-tensor fast path, padded positions come out as zeros."""
    ours, ref = encoder_pair(False)
    ours.eval(), ref.eval()
    x = torch.randn(B, T, D)
    with torch.no_grad():
        out, ref_out = ours(x, key_padding_mask=TKPM), ref(x, src_key_padding_mask=TKPM)
    torch.testing.assert_close(out[~TKPM], ref_out[~TKPM])


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_decoder_stack_matches_torch(norm_first):
    ours, ref = decoder_pair(norm_first)
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    x1, x2, m1, m2 = leaf(x), leaf(x), leaf(mem), leaf(mem)
    out = ours(x1, m1, tgt_key_padding_mask=TKPM, memory_key_padding_mask=MKPM)
    ref_out = ref(
        x2, m2, tgt_mask=torch.ones(T, T, dtype=torch.bool).triu(1), tgt_is_causal=True,
        tgt_key_padding_mask=TKPM, memory_key_padding_mask=MKPM,
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out)
    backward_both(out, ref_out, [(x1, x2), (m1, m2)], stack_pairs(ours, ref))


# --------------------------------------------------------------------------- the final norm


def _norms(module):
    return [m for m in module.modules() if isinstance(m, (LayerNorm, RMSNorm))]


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_pre_norm_stack_has_exactly_one_final_norm(kind, norm_first):
    block = (
        EncoderBlock(D, H, F, norm_first=norm_first)
        if kind == "encoder"
        else DecoderBlock(D, H, F, norm_first=norm_first)
    )
    per_block = len(_norms(block))
    stack = (TransformerEncoder if kind == "encoder" else TransformerDecoder)(block, N)
    assert len(stack.layers) == N
    assert len(_norms(stack)) == N * per_block + int(norm_first)
    assert (stack.norm is not None) == norm_first
    # the final norm is applied once, after the last layer (pytorch#24930: nn.Transformer once applied it twice)
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    args = (x,) if kind == "encoder" else (x, mem)
    with torch.no_grad():
        h = x
        for layer in stack.layers:
            h = layer(h) if kind == "encoder" else layer(h, mem)
        expected = stack.norm(h) if norm_first else h
        torch.testing.assert_close(stack(*args), expected)


def test_final_norm_override_and_rms():
    block = EncoderBlock(D, H, F, norm_first=True, norm="rms", eps=1e-4)
    stack = TransformerEncoder(block, 2)
    assert isinstance(stack.norm, RMSNorm) and stack.norm.eps == 1e-4
    assert TransformerEncoder(EncoderBlock(D, H, F, norm_first=True), 2, final_norm=False).norm is None
    forced = TransformerEncoder(EncoderBlock(D, H, F, eps=1e-3), 2, final_norm=True).norm
    assert isinstance(forced, LayerNorm) and forced.eps == 1e-3


def test_pre_norm_stack_equals_torch_with_final_layer_norm():
    """The pre-norm stack equals ``nn.TransformerEncoder(..., norm=LayerNorm)`` and differs without that norm."""
    ours, ref = encoder_pair(True)
    x = torch.randn(B, T, D)
    with torch.no_grad():
        out = ours(x, key_padding_mask=TKPM)
        torch.testing.assert_close(out, ref(x, src_key_padding_mask=TKPM))
        ref.norm = None
        assert not torch.allclose(out, ref(x, src_key_padding_mask=TKPM))


# --------------------------------------------------------------------------- layer copies


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_layers_are_independent_fresh_copies(kind):
    block = randomize_(EncoderBlock(D, H, F) if kind == "encoder" else DecoderBlock(D, H, F))
    before = {k: v.clone() for k, v in block.state_dict().items()}
    stack = (TransformerEncoder if kind == "encoder" else TransformerDecoder)(block, N)
    assert stack.layers[0] is block
    for k, v in stack.layers[0].state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    ptrs = [{p.data_ptr() for p in layer.parameters()} for layer in stack.layers]
    assert all(a.isdisjoint(b) for i, a in enumerate(ptrs) for b in ptrs[i + 1 :]), "layers share parameters"
    w0, w1 = stack.layers[0].self_attn.q_proj.weight, stack.layers[1].self_attn.q_proj.weight
    assert not torch.allclose(w0, w1), "copies are re-initialised, not clones of the block"


def test_copies_are_initialised_like_a_fresh_block():
    """Each copy gets the init of a newly built block: MultiHeadAttention's (xavier q/k/v, zero biases — the
    ``nn.MultiheadAttention`` init), ones/zeros norms; not ``nn.Linear``'s default overwriting it."""
    stack = TransformerEncoder(randomize_(EncoderBlock(D, H, F)), N)
    fresh = MultiHeadAttention(D, H)
    bound = (6 / (D + D)) ** 0.5  # xavier-uniform bound for a (D, D) weight
    for layer in list(stack.layers)[1:]:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            lin, ref = getattr(attn, name), getattr(fresh, name)
            assert (lin.bias == 0).all() and (ref.bias == 0).all(), f"{name}.bias not zero-initialised"
        w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        assert w.abs().max() <= bound and w.abs().max() > 1 / D**0.5, "q/k/v not xavier-initialised"
        norm = layer.attn_residual.norm
        assert (norm.weight == 1).all() and (norm.bias == 0).all()


# --------------------------------------------------------------------------- decoding with caches


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_decoder_stack_incremental_decoding_equals_full(norm_first):
    ours, _ = decoder_pair(norm_first)
    ours.eval()
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    with torch.no_grad():
        full = ours(x, mem, memory_key_padding_mask=MKPM)
        caches = ours.new_caches()
        assert len(caches) == N
        steps = [ours(x[:, t : t + 1], mem, memory_key_padding_mask=MKPM, caches=caches) for t in range(T)]
    torch.testing.assert_close(torch.cat(steps, 1), full)
    assert all(len(sc) == T and len(cc) == S for sc, cc in caches)


# --------------------------------------------------------------------------- bad input


def test_stack_bad_args():
    enc, dec = EncoderBlock(6, 2, 5), DecoderBlock(6, 2, 5)
    with pytest.raises(TypeError, match="block must be an EncoderBlock, got DecoderBlock"):
        TransformerEncoder(dec, 2)
    with pytest.raises(TypeError, match="block must be a DecoderBlock, got EncoderBlock"):
        TransformerDecoder(enc, 2)
    with pytest.raises(ValueError, match="n_layers must be a positive int, got 0"):
        TransformerEncoder(enc, 0)
    with pytest.raises(TypeError, match="n_layers must be a positive int, got 2.0"):
        TransformerDecoder(dec, 2.0)
    stack = TransformerDecoder(dec, 2)
    x = torch.randn(1, 3, 6)
    with pytest.raises(ValueError, match=r"caches must hold one pair per layer \(2\), got 1"):
        stack(x, x, caches=stack.new_caches()[:1])
