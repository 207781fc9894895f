"""Blocks built from our pieces vs Hugging Face transformers (tiny random configs, copied weights, eval, dropout 0):
a GPT-2-style pre-norm block vs ``GPT2Block`` and a post-norm ``EncoderBlock`` vs ``BertLayer``; forward and
backward. HF's attention masks are built by HF's own mask builders (what ``GPT2Model``/``BertModel`` call)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, GPT2Config  # noqa: E402
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask  # noqa: E402
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402

from sublayer import EncoderBlock, MultiHeadAttention, PositionWiseFFN, PreNormResidual  # noqa: E402

from ._weights import (  # noqa: E402
    backward_both,
    bert_layer_pairs,
    copy_pairs,
    copy_views,
    gpt2_block_pairs,
    randomize_,
)

D, H, F = 15, 3, 11
B, T = 3, 6
LENGTHS = [T, 4, 1]


class GPT2StyleBlock(nn.Module):
    """GPT-2's block from our pieces: ``x + attn(ln_1(x))`` (causal), then ``x + mlp(ln_2(x))`` (gelu_tanh)."""

    def __init__(self, d_model, n_heads, d_ff, eps=1e-5):
        super().__init__()
        self.attn_residual = PreNormResidual(d_model, eps=eps)
        self.attn = MultiHeadAttention(d_model, n_heads)
        self.ffn_residual = PreNormResidual(d_model, eps=eps)
        self.ffn = PositionWiseFFN(d_model, d_ff, activation="gelu_tanh")

    def forward(self, x, key_padding_mask=None):
        x = self.attn_residual(x, lambda h: self.attn(h, key_padding_mask=key_padding_mask, is_causal=True)[0])
        return self.ffn_residual(x, self.ffn)


def gpt2_pair(impl):
    cfg = GPT2Config(
        n_embd=D, n_head=H, n_inner=F, n_layer=1, n_positions=16, vocab_size=11, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0, activation_function="gelu_new", attn_implementation=impl,
    )  # fmt: skip
    ref = randomize_(GPT2Block(cfg, layer_idx=0)).eval()
    ours = GPT2StyleBlock(D, H, F, eps=cfg.layer_norm_epsilon).eval()
    copy_views(gpt2_block_pairs(ours, ref))
    return ours, ref, cfg


@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpt2_style_block_matches_hf_gpt2block(impl, padding):
    ours, ref, cfg = gpt2_pair(impl)
    x = torch.randn(B, T, D)
    kpm = torch.arange(T)[None, :] >= torch.tensor(LENGTHS)[:, None] if padding else None
    # the mask GPT2Model builds (attention_mask 1 = token, 0 = pad); None lets SDPA use is_causal
    hf_mask = create_causal_mask(
        config=cfg, inputs_embeds=x, attention_mask=None if kpm is None else (~kpm).long(), past_key_values=None,
        position_ids=torch.arange(T)[None].expand(B, T),
    )  # fmt: skip
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = ours(x1, key_padding_mask=kpm)
    ref_out = ref(x2, attention_mask=hf_mask)
    ref_out = ref_out[0] if isinstance(ref_out, tuple) else ref_out
    torch.testing.assert_close(out, ref_out)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref_out * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    for name, p, hf_grad in gpt2_block_pairs(ours, ref, grad=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, hf_grad, msg=lambda m, n=name: f"{n}: {m}")


def test_gpt2_block_weight_split_is_exact():
    """c_attn (Conv1D, (d, 3d)) packs q, k, v along its output: our q/k/v projections are its column blocks."""
    ours, ref, _ = gpt2_pair("eager")
    x = torch.randn(B, T, D)
    with torch.no_grad():
        fused = ref.attn.c_attn(x)
        ours_qkv = torch.cat([ours.attn.q_proj(x), ours.attn.k_proj(x), ours.attn.v_proj(x)], -1)
        torch.testing.assert_close(ours_qkv, fused)
        torch.testing.assert_close(ours.ffn(x), ref.mlp(x))


def bert_pair(impl):
    cfg = BertConfig(
        hidden_size=D, num_attention_heads=H, intermediate_size=F, num_hidden_layers=1, vocab_size=11,
        hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=impl,
    )  # fmt: skip
    ref = randomize_(BertLayer(cfg)).eval()
    ours = EncoderBlock(D, H, F, activation="gelu", eps=cfg.layer_norm_eps).eval()
    assert cfg.layer_norm_eps == 1e-12
    copy_pairs(bert_layer_pairs(ours, ref))
    return ours, ref, cfg


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_post_norm_encoder_block_matches_hf_bertlayer(impl):
    ours, ref, cfg = bert_pair(impl)
    x = torch.randn(B, T, D)
    kpm = torch.arange(T)[None, :] >= torch.tensor(LENGTHS)[:, None]
    # what BertModel does: a (B, T) 1/0 attention_mask → HF's 4-D mask (additive for eager, bool for sdpa)
    hf_mask = create_bidirectional_mask(config=cfg, inputs_embeds=x, attention_mask=(~kpm).long())
    assert hf_mask is not None and hf_mask.shape == (B, 1, T, T)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = ours(x1, key_padding_mask=kpm)
    ref_out = ref(x2, attention_mask=hf_mask)
    ref_out = ref_out[0] if isinstance(ref_out, tuple) else ref_out
    torch.testing.assert_close(out, ref_out)
    backward_both(out, ref_out, [(x1, x2)], bert_layer_pairs(ours, ref))


def test_bert_extended_mask_as_our_additive_attn_mask():
    """HF's additive (B, 1, T, T) eager mask (finfo.min at padding) works directly as our float attn_mask."""
    ours, ref, cfg = bert_pair("eager")
    x = torch.randn(B, T, D)
    kpm = torch.arange(T)[None, :] >= torch.tensor(LENGTHS)[:, None]
    hf_mask = create_bidirectional_mask(config=cfg, inputs_embeds=x, attention_mask=(~kpm).long())
    assert hf_mask.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(ours(x, attn_mask=hf_mask), ref(x, attention_mask=hf_mask))
