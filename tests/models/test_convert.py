"""GPT2.from_hf / Bert.from_hf from in-memory HF models and to_hf() back: equal outputs and gradients, and clear
errors for what cannot convert."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from sublayer.checkpoints import CheckpointError
from sublayer.checkpoints import bert as bert_keymap
from sublayer.checkpoints import gpt2 as gpt2_keymap
from sublayer.models import GPT2, Bert

from .conftest import N_LAYERS, VOCAB, make_hf_bert, make_hf_gpt2

transformers = pytest.importorskip("transformers")

# The conversion copies weights bit for bit (checked by the round trips below); what differs is only the order
# of fp32 sums in the kernels (which differs between SIMD widths, AVX2 vs AVX-512). Hidden states, logits and
# parameter gradients are held to assert_close's fp32 defaults (rtol 1.3e-6, atol 1e-5), everything to 1e-10 in
# float64.
TIGHT64 = {"atol": 1e-10, "rtol": 0.0}


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    params = {k for k, _ in b.named_parameters()}
    for k in params:
        assert torch.equal(sa[k], sb[k]), k


def _ids(b=3, t=7):
    return torch.randint(3, VOCAB, (b, t), generator=torch.Generator().manual_seed(5))


def _bert_batch():
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    types = torch.zeros_like(ids)
    types[:, 4:] = 1
    return ids, mask, types


def _grads(model):
    return {k: p.grad for k, p in model.named_parameters()}


def test_gpt2_from_hf_and_back():
    hf = make_hf_gpt2().train()  # dropout 0: train mode is deterministic, and the mode carries over
    ours = GPT2.from_hf(hf)
    assert ours.training and ours.lm_head.weight is ours.wte.weight  # tied, as in HF
    assert ours.wte.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()  # a copy
    x = _ids()
    out, ref = ours(x), hf(x).logits
    assert_close(out, ref)
    out.square().mean().backward(), ref.square().mean().backward()
    ours_grads = gpt2_keymap.to_hf(_grads(ours) | {"lm_head.weight": None}, N_LAYERS)
    hf_grads = {k.removeprefix("transformer."): p.grad for k, p in hf.named_parameters()}
    assert set(ours_grads) == set(hf_grads)
    for k, g in ours_grads.items():
        assert_close(g, hf_grads[k], msg=lambda m, k=k: f"{k}: {m}")

    back = ours.eval().to_hf()
    assert isinstance(back, transformers.GPT2LMHeadModel) and not back.training
    _same_state(back, hf)  # HF -> ours -> HF is exact
    assert back.lm_head.weight is back.transformer.wte.weight


@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_conversion_is_exact_in_float64(model):
    hf = (make_hf_gpt2() if model == "gpt2" else make_hf_bert()).double()
    ours = (GPT2 if model == "gpt2" else Bert).from_hf(hf)
    x = _ids()
    out, ref = (ours(x), hf(x).logits) if model == "gpt2" else (ours(x), hf(x).last_hidden_state)
    assert_close(out, ref, **TIGHT64)
    out.sum().backward(), ref.sum().backward()
    keymap = gpt2_keymap if model == "gpt2" else bert_keymap
    extra = {"lm_head.weight": None} if model == "gpt2" else {}
    ours_grads = keymap.to_hf(_grads(ours) | extra, N_LAYERS)
    hf_grads = {k.removeprefix("transformer."): p.grad for k, p in hf.named_parameters()}
    for k, g in ours_grads.items():
        if hf_grads[k] is not None or g is not None:  # the pooler gets no gradient from last_hidden_state
            assert_close(g, hf_grads[k], **TIGHT64, msg=lambda m, k=k: f"{k}: {m}")


def test_bert_from_hf_and_back():
    hf = make_hf_bert()
    ours = Bert.from_hf(hf)
    assert not ours.training and ours.pooler is not None
    ids, mask, types = _bert_batch()
    out = hf(ids, attention_mask=mask, token_type_ids=types)
    h, pooled = ours(ids, mask, types), ours.pooled(ids, mask, types)
    real = mask[..., None].bool()  # padded positions are zeros in ours (padding-free), HF's vectors there are unused
    assert_close(h * real, out.last_hidden_state * real)
    assert not h.masked_select(~real).any()
    assert_close(pooled, out.pooler_output)
    ((h * mask[..., None]).square().mean() + pooled.mean()).backward()
    ((out.last_hidden_state * mask[..., None]).square().mean() + out.pooler_output.mean()).backward()
    ours_grads = bert_keymap.to_hf(_grads(ours), N_LAYERS)
    hf_grads = dict(hf.named_parameters())
    assert set(ours_grads) == set(hf_grads)
    for k, g in ours_grads.items():
        assert_close(g, hf_grads[k].grad, msg=lambda m, k=k: f"{k}: {m}")

    back = ours.to_hf()
    assert isinstance(back, transformers.BertModel)
    _same_state(back, hf)


def test_bert_task_model_and_no_pooler_and_dtype():
    hf = make_hf_bert("BertForMaskedLM")  # bert. prefix, cls.* heads ignored, no pooler
    ours = Bert.from_hf(hf)
    assert ours.pooler is None
    ids, mask, types = _bert_batch()
    with torch.no_grad():
        real = mask[..., None].bool()  # ours: zeros at padding
        want = hf.bert(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        assert_close(ours(ids, mask, types) * real, want * real)
        back = ours.to_hf()
    assert back.pooler is None
    hf64 = make_hf_bert().double()
    assert Bert.from_hf(hf64).embeddings.word_embeddings.weight.dtype == torch.float64  # the HF model's dtype
    assert Bert.from_hf(hf64, dtype=torch.float32).embeddings.word_embeddings.weight.dtype == torch.float32


def test_unconvertible_models_get_clear_errors():
    with pytest.raises(TypeError, match="must be a Hugging Face PreTrainedModel .* got Linear"):
        GPT2.from_hf(torch.nn.Linear(3, 3))
    with pytest.raises(CheckpointError, match="BertModel.config: model_type must be 'gpt2'"):
        GPT2.from_hf(make_hf_bert())
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.config: unsupported activation_function 'quick_gelu'"):
        GPT2.from_hf(make_hf_gpt2(activation_function="quick_gelu"))
    with pytest.raises(CheckpointError, match=r"BertForSequenceClassification \(in memory\).*unexpected keys.*classifier"):
        Bert.from_hf(make_hf_bert("BertForSequenceClassification"))


def test_gpt2_from_a_headless_gpt2model():
    from .conftest import hf_gpt2_config

    torch.manual_seed(0)
    hf = transformers.GPT2Model(hf_gpt2_config()).eval()  # no lm_head: the tied head is the embedding
    ours = GPT2.from_hf(hf)
    x = _ids()
    with torch.no_grad():
        assert_close(ours(x), hf(x).last_hidden_state @ hf.wte.weight.t())
