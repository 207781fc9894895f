"""BERT: parity with HF ``BertModel`` (hidden states with padding, pooler, gradients), ``embed``, config, checks."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer.checkpoints import bert as keymap
from sublayer.models import Bert, BertConfig

from .conftest import BERT_FF, MAX_POS, N_LAYERS, VOCAB, make_hf_bert

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ours(bert_folder) -> Bert:
    return Bert.from_pretrained(bert_folder).eval()


def _batch(b: int = 3, t: int = 7, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, t), generator=g)
    types = torch.randint(0, 2, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 4:] = 0
    mask[2, 6:] = 0
    return ids.masked_fill(mask == 0, 0), mask, types


def test_hidden_states_equal_hf_with_padding(ours, hf_bert):
    ids, mask, types = _batch()
    with torch.no_grad():
        got = ours(ids, mask, types)
        want = hf_bert(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    # Real positions equal HF's; padded positions are zeros (the layers run on the real tokens only, see
    # sublayer.models.padding_free), where HF computes vectors nothing should read.
    real = mask.bool()
    assert_close(got[real], want[real])
    assert_close(got[~real], torch.zeros_like(got[~real]))


def test_defaults_equal_hf_without_mask_or_types(ours, hf_bert):
    ids, _, _ = _batch()
    with torch.no_grad():
        assert_close(ours(ids), hf_bert(ids).last_hidden_state)


def test_pooler_equals_hf(ours, hf_bert):
    ids, mask, types = _batch()
    with torch.no_grad():
        assert_close(ours.pooled(ids, mask, types), hf_bert(ids, attention_mask=mask, token_type_ids=types).pooler_output)


def _hf_grads(hf, ids, mask, types) -> dict:
    out = hf(ids, attention_mask=mask, token_type_ids=types)
    ((out.last_hidden_state * mask[..., None]).square().sum() + out.pooler_output.sum()).backward()
    return {k: p.grad for k, p in hf.named_parameters()}


def test_gradients_equal_hf(bert_folder):
    model = Bert.from_pretrained(bert_folder).eval()
    ids, mask, types = _batch()
    ((model(ids, mask, types) * mask[..., None]).square().sum() + model.pooled(ids, mask, types).sum()).backward()
    ours = keymap.to_hf({k: p.grad for k, p in model.named_parameters()}, N_LAYERS)
    hf32 = _hf_grads(make_hf_bert(), ids, mask, types)
    hf64 = _hf_grads(make_hf_bert().double(), ids, mask, types)
    assert set(ours) == set(hf32)
    for k, g in ours.items():
        # Embedding-table gradients sum the squared-output loss over every token, with cancellation: HF's own fp32
        # gradient is ~1e-5 off the float64 truth there. Ours must be as close to the truth as HF's fp32 is (x4),
        # and within the fp32 defaults wherever HF's fp32 is.
        ref_err = (hf32[k].double() - hf64[k]).abs().max().item()
        assert_close(g.double(), hf64[k], rtol=1.3e-6, atol=max(1e-5, 4 * ref_err), msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("act", ["gelu_new", "relu"])
def test_other_activations_equal_hf(act, tmp_path):
    hf = make_hf_bert(hidden_act=act)
    hf.save_pretrained(tmp_path)
    model = Bert.from_pretrained(tmp_path).eval()
    assert model.config.activation == {"gelu_new": "gelu_tanh", "relu": "relu"}[act]
    ids, mask, types = _batch()
    real = mask.bool()  # padded positions are zeros (padding-free layers)
    with torch.no_grad():
        got = model(ids, mask, types)
        assert_close(got[real], hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state[real])


def test_embed_is_masked_mean_of_hf_states_normalised(ours, hf_bert):
    ids, mask, types = _batch()
    with torch.no_grad():
        h = hf_bert(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        got = ours.embed(ids, mask, types)
    m = mask[..., None].float()
    assert_close(got, F.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    assert_close(got.norm(dim=-1), torch.ones(3))


def test_embed_of_a_padded_row_equals_the_row_alone(ours):
    ids, mask, types = _batch()
    n = int(mask[0].sum())
    with torch.no_grad():
        assert_close(ours.embed(ids, mask, types)[0], ours.embed(ids[:1, :n], mask[:1, :n], types[:1, :n])[0])


def test_padded_tokens_do_not_change_real_outputs(ours):
    ids, mask, types = _batch()
    other = ids.masked_fill(mask == 0, 17)
    with torch.no_grad():
        a, b = ours(ids, mask, types), ours(other, mask, types)
    assert_close(a[mask.bool()], b[mask.bool()])


def test_embed_rejects_a_row_without_tokens(ours):
    ids, mask, types = _batch()
    mask[1] = 0
    with pytest.raises(ValueError, match="attention_mask has a row with no token"):
        ours.embed(ids, mask, types)


def test_pooled_without_pooler_raises(bert_folder):
    model = Bert(BertConfig(vocab_size=11, d_model=6, n_layers=1, n_heads=2, d_ff=7, max_positions=5), pooler=False)
    assert model.pooler is None and "pooler.dense.weight" not in model.state_dict()
    with pytest.raises(ValueError, match="this Bert has no pooler"):
        model.pooled(torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"token_type_ids": torch.full((3, 7), 2)}, ValueError, r"token_type_ids must lie in \[0, type_vocab_size=2\)"),
        (
            {"token_type_ids": torch.zeros(3, 6, dtype=torch.long)},
            ValueError,
            r"token_type_ids must have the shape of input_ids \(3, 7\), got \(3, 6\)",
        ),
        (
            {"attention_mask": torch.ones(2, 7)},
            ValueError,
            r"attention_mask must have the shape of input_ids \(3, 7\), got \(2, 7\)",
        ),
        ({"attention_mask": torch.full((3, 7), -1)}, ValueError, "attention_mask must hold only 0"),
        ({"input_ids": torch.full((3, 7), VOCAB)}, ValueError, rf"input_ids must lie in \[0, vocab_size={VOCAB}\)"),
        ({"input_ids": torch.ones(3, 7)}, TypeError, "input_ids must hold integer token ids"),
    ],
)
def test_forward_rejects_bad_inputs(ours, kwargs, exc, match):
    args = {"input_ids": _batch()[0]} | kwargs
    with pytest.raises(exc, match=match):
        ours(**args)


def test_dropouts_follow_bert():
    cfg = BertConfig(vocab_size=11, d_model=6, n_layers=2, n_heads=2, d_ff=7, max_positions=5, dropout=0.1, attn_dropout=0.2)
    model = Bert(cfg)
    for layer in model.encoder.layers:
        # attention_probs_dropout_prob on the weights, hidden_dropout_prob on residual branches, none in the FFN
        assert layer.self_attn.dropout == 0.2 and layer.ffn.dropout == 0.0
        assert layer.attn_residual.dropout == 0.1 and layer.ffn_residual.dropout == 0.1
    assert model.embeddings.dropout == 0.1


def test_config_from_hf_dict_maps_fields(hf_bert):
    cfg = BertConfig.from_hf_dict(hf_bert.config.to_dict())
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff) == (VOCAB, 15, N_LAYERS, 3, BERT_FF)
    assert (cfg.activation, cfg.eps, cfg.max_positions, cfg.type_vocab_size, cfg.pad_token_id) == ("gelu", 1e-12, MAX_POS, 2, 0)
    assert BertConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "roberta"}, "model_type must be 'bert' for BERT, got 'roberta'"),
        ({"hidden_act": "gelu_fast"}, "unsupported hidden_act 'gelu_fast'"),
        ({"position_embedding_type": "relative_key"}, "unsupported BERT option position_embedding_type='relative_key'"),
        ({"is_decoder": True}, "unsupported BERT option is_decoder=True"),
        ({"num_attention_heads": 4}, r"d_model \(15\) must be divisible by n_heads \(4\)"),
    ],
)
def test_config_from_hf_dict_rejects(hf_bert, change, match):
    with pytest.raises(ValueError, match=match):
        BertConfig.from_hf_dict(hf_bert.config.to_dict() | change)


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="unknown BertConfig keys: hidden_sise"):
        BertConfig.from_dict(dataclasses.asdict(BertConfig()) | {"hidden_sise": 3})
    with pytest.raises(ValueError, match=r"pad_token_id must be None or an int in \[0, vocab_size=5\), got 5"):
        BertConfig(vocab_size=5, pad_token_id=5)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        BertConfig(dropout=1.5)


@hsettings(max_examples=8)
@given(n=st.integers(1, 9), pad=st.integers(0, 5), seed=st.integers(0, 99))
def test_embed_invariant_to_right_padding(ours, n, pad, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (1, n + pad), generator=g)
    mask = torch.ones_like(ids)
    mask[:, n:] = 0
    with torch.no_grad():
        assert_close(ours.embed(ids, mask), ours.embed(ids[:, :n]))


def test_from_pretrained_is_in_eval_mode_and_embed_ignores_the_mode(tmp_path):
    """HF's from_pretrained returns eval; embedding the same text twice must give the same vector in any mode
    (the README's ``Bert.from_pretrained(...).embed(...)`` applied dropout: cosine 0.92)."""
    cfg = BertConfig(vocab_size=VOCAB, d_model=15, n_layers=1, n_heads=3, d_ff=BERT_FF, max_positions=MAX_POS,
                     dropout=0.3, attn_dropout=0.3)  # fmt: skip
    Bert(cfg).save_pretrained(tmp_path)
    model = Bert.from_pretrained(tmp_path)
    assert not any(m.training for m in model.modules())
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    first = model.embed(ids, mask)
    model.train()
    assert torch.equal(model.embed(ids, mask), first) and torch.equal(model.embed(ids, mask), first)
    assert model.training and all(m.training for m in model.modules())  # the mode is restored


def test_gradcheck_float64_with_padding():
    cfg = BertConfig(vocab_size=11, d_model=6, n_layers=1, n_heads=3, d_ff=5, max_positions=7, dropout=0.0,
                     attn_dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = Bert(cfg, dtype=torch.float64)
    names, params = zip(*[(n, p.detach().clone().requires_grad_(True)) for n, p in model.named_parameters()])
    x = torch.tensor([[1, 4, 7, 2], [3, 3, 9, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # right padding: the padding-free path runs

    def f(*ps):
        out = torch.func.functional_call(
            model, dict(zip(names, ps)), (x,), {"attention_mask": mask, "return_dict": True}
        )
        return out.last_hidden_state[mask.bool()], out.pooler_output

    assert torch.autograd.gradcheck(f, params, fast_mode=True)
