"""HF-shaped results: ``forward(..., labels=)`` / ``return_dict=True`` output objects (``.logits``, ``.loss``,
``.last_hidden_state``, ``.pooler_output``) equal to today's tensors and to HF's; ``generate(max_length=)`` with HF's
meaning; ``generate(streamer=)`` with HF's streamer protocol on the reference and the fast loop."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from sublayer.models import GPT2, Bert, Llama, fast_inference
from sublayer.models.outputs import BaseModelOutput, CausalLMOutput
from sublayer.models.quantized import quantize
from tests.conftest import reference_decoding

from .conftest import MAX_POS, VOCAB, make_hf_bert, make_hf_gpt2

transformers = pytest.importorskip("transformers")


def _ids(b: int = 3, t: int = 7, seed: int = 5) -> torch.Tensor:
    return torch.randint(3, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _mask(b: int = 3, t: int = 7) -> torch.Tensor:
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 5:] = 0
    mask[1, 3:] = 0
    return mask


@pytest.fixture(scope="module")
def hf_gpt2():
    return make_hf_gpt2()


@pytest.fixture(scope="module")
def gpt2(hf_gpt2):
    return GPT2.from_hf(hf_gpt2).eval()


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=10, intermediate_size=7, num_hidden_layers=2, num_attention_heads=5,
        num_key_value_heads=1, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


# ---- forward: output objects ----------------------------------------------------------------------------------


def test_return_dict_logits_equal_the_tensor_and_index_as_hf(gpt2):
    x, mask = _ids(), _mask()
    logits = gpt2(x, attention_mask=mask)
    out = gpt2(x, attention_mask=mask, return_dict=True)
    assert isinstance(out, CausalLMOutput) and out.loss is None
    assert torch.equal(out.logits, logits) and torch.equal(out["logits"], logits) and torch.equal(out[0], logits)
    assert len(out.to_tuple()) == 1 and out.keys() == ["logits"]
    with pytest.raises(KeyError, match="has no field 'loss' set"):
        out["loss"]


@pytest.mark.parametrize("padded", [False, True])
def test_labels_loss_equals_hf_value_and_gradients(hf_gpt2, padded):
    ours = GPT2.from_hf(hf_gpt2).eval()
    x = _ids()
    mask = _mask() if padded else None
    labels = x.masked_fill(mask == 0, -100) if padded else x
    out = ours(x, attention_mask=mask, labels=labels)
    want = hf_gpt2(x, attention_mask=mask, labels=labels)
    assert isinstance(out, CausalLMOutput) and out.logits is None  # the fused loss builds no logits
    assert_close(out.loss, want.loss)
    assert out[0] is out.loss  # HF's tuple order: loss first
    out.loss.backward()
    want.loss.backward()
    assert_close(ours.wte.weight.grad, hf_gpt2.transformer.wte.weight.grad, rtol=1e-4, atol=1e-5)
    assert_close(ours.blocks[0].ffn.fc1.weight.grad, hf_gpt2.transformer.h[0].mlp.c_fc.weight.grad.t(), rtol=1e-4,
                 atol=1e-5)  # fmt: skip
    hf_gpt2.zero_grad()


def test_llama_labels_and_return_dict_equal_hf():
    hf = _tiny_llama()
    ours = Llama.from_hf(hf).eval()
    x = _ids()
    with torch.no_grad():
        want = hf(x, labels=x)
        assert_close(ours(x, labels=x).loss, want.loss)
        assert_close(ours(x, return_dict=True).logits, want.logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prepare", ["fast", "int8"])
def test_prepared_forms_return_loss_and_logits(gpt2, prepare):
    prepared = fast_inference(gpt2, dtype=torch.float32) if prepare == "fast" else quantize(gpt2)
    x, mask = _ids(), _mask()
    labels = x.masked_fill(mask == 0, -100)
    logits = prepared(x, attention_mask=mask)
    out = prepared(x, attention_mask=mask, labels=labels)
    assert torch.equal(out.logits, logits) and torch.equal(prepared(x, return_dict=True).logits, prepared(x))
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    assert_close(out.loss, want)
    if prepare == "fast":  # the same numbers as the model's fused loss
        assert_close(out.loss, gpt2.loss(x, attention_mask=mask, labels=labels), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prepare", ["fp32", "bf16", "int8"])
def test_prepared_loss_counts_padded_positions_that_have_a_target(prepare):
    # as the model's loss (and HF's): with left padding the last pad predicts the first token; with labels=ids
    # and right padding the padded positions' labels count; a confident head makes a wrong logit there visible
    hf = _tiny_llama()
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)
    ours = Llama.from_hf(hf).eval()
    if prepare == "int8":
        prepared = quantize(ours)
    else:
        prepared = fast_inference(ours, dtype=torch.float32 if prepare == "fp32" else torch.bfloat16)
    x, right = _ids(), _mask()
    left = right.flip(1)
    tol = dict(rtol=1e-5, atol=1e-5) if prepare == "fp32" else dict(rtol=0, atol=0.1)
    for mask, labels in ((left, x.masked_fill(left == 0, -100)), (right, x)):
        with torch.no_grad():
            want = ours(x, attention_mask=mask, labels=labels).loss
            assert_close(want, hf(x, attention_mask=mask, labels=labels).loss, rtol=1e-5, atol=1e-5)
            assert_close(prepared(x, attention_mask=mask, labels=labels).loss, want, **tol)


@pytest.mark.parametrize("prepare", [None, "fast"])
def test_bad_labels_are_named(gpt2, prepare):
    model = gpt2 if prepare is None else fast_inference(gpt2, dtype=torch.float32)
    x = _ids()
    with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(3, 7\), got \(3, 6\)"):
        model(x, labels=x[:, :6])
    with pytest.raises(ValueError, match="no position has a target"):
        model(x, labels=torch.full_like(x, -100))
    with pytest.raises((ValueError, TypeError), match="labels"):
        model(x, labels=torch.full_like(x, VOCAB))


@pytest.mark.parametrize("left", [False, True])
def test_bert_return_dict_equals_hf(left):
    hf = make_hf_bert()
    ours = Bert.from_hf(hf).eval()
    x, mask = _ids(), _mask()
    if left:
        mask = mask.flip(1)
    out = ours(x, mask, return_dict=True)
    assert isinstance(out, BaseModelOutput)
    assert torch.equal(out.pooler_output, ours.pooled(x, mask))
    # left padding runs the padded position 0 too (the pooler reads it): other row packing, same values
    assert_close(out.last_hidden_state, ours(x, mask), rtol=0 if not left else 1e-5, atol=0 if not left else 1e-6)
    with torch.no_grad():
        want = hf(x, attention_mask=mask)
    real = mask.bool()[..., None]
    assert_close(out.last_hidden_state * real, want.last_hidden_state * real, rtol=1e-4, atol=1e-5)
    assert_close(out.pooler_output, want.pooler_output, rtol=1e-4, atol=1e-5)
    fast = fast_inference(ours, dtype=torch.float32)(x, mask, return_dict=True)
    assert torch.equal(fast.last_hidden_state, fast_inference(ours, dtype=torch.float32)(x, mask))
    assert_close(fast.last_hidden_state, out.last_hidden_state * real, rtol=1e-4, atol=1e-5)
    if not left:  # the fast path's pooler reads its (zero) hidden state at a padded position 0
        assert_close(fast.pooler_output, out.pooler_output, rtol=1e-4, atol=1e-5)
    no_pool = Bert(ours.config, pooler=False)
    out = no_pool(x, mask, return_dict=True)
    assert out.pooler_output is None and out.keys() == ["last_hidden_state"]


# ---- generate: max_length, streamer ---------------------------------------------------------------------------


def test_max_length_is_the_total_length_as_hf(gpt2, hf_gpt2):
    x = _ids(2, 4)
    got = gpt2.generate(x, max_length=9, eos_token_id=None)
    want = hf_gpt2.generate(x, max_length=9, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got.shape == (2, 9) and torch.equal(got, want)
    assert torch.equal(got, gpt2.generate(x, 5, eos_token_id=None))
    both = gpt2.generate(x, 3, max_length=9, eos_token_id=None)  # max_new_tokens wins, as HF
    want = hf_gpt2.generate(x, max_new_tokens=3, max_length=9, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert both.shape == (2, 7) and torch.equal(both, want)
    prepared = fast_inference(gpt2, dtype=torch.float32)
    assert torch.equal(prepared.generate(x, max_length=9, eos_token_id=None), got)


@pytest.mark.parametrize("bad", [4, 2, 7.5, True, "9"])
def test_max_length_errors(gpt2, bad):
    with pytest.raises(ValueError, match=rf"max_length must be an int > the prompt length 4 .*got {bad!r}"):
        gpt2.generate(_ids(2, 4), max_length=bad)
    with pytest.raises(ValueError, match=f"exceeds max_positions={MAX_POS}"):
        gpt2.generate(_ids(2, 4), max_length=MAX_POS + 1)


class Recorder:
    """HF's streamer protocol: every ``put`` and the ``end``."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, ids):
        assert not self.ended
        self.puts.append(ids.clone())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("loop", ["fast", "reference"])
@pytest.mark.parametrize("sample", [False, True])
def test_streamer_sees_every_token_as_made(gpt2, loop, sample):
    x = _ids(2, 4)
    rec = Recorder()

    def run():
        return gpt2.generate(x, 6, streamer=rec, do_sample=sample, generator=torch.Generator().manual_seed(3))

    out = run() if loop == "fast" else reference_decoding(run)
    assert rec.ended and torch.equal(rec.puts[0], x)
    assert torch.equal(torch.stack(rec.puts[1:], dim=1), out[:, 4:])
    if not sample:
        assert torch.equal(out, reference_decoding(lambda: gpt2.generate(x, 6)))


def test_hf_text_streamer_runs_on_our_generate(gpt2, capsys):
    from tests.models.conftest import word_tokenizer

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=word_tokenizer())
    streamer = transformers.TextStreamer(tok, skip_prompt=True)
    out = gpt2.generate(_ids(1, 3), 5, streamer=streamer, eos_token_id=None)
    assert capsys.readouterr().out.strip() == tok.decode(out[0, 3:]).strip()
