"""One rule for every fast path: a hook on any module it would replace sends the call to the reference path."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from sublayer import record_attention
from sublayer.models import GPT2, GPT2Config, Transformer
from sublayer.runtime import rules

from tests.conftest import reference_decoding


def _gpt2() -> GPT2:
    torch.manual_seed(0)
    return GPT2(GPT2Config(vocab_size=53, max_positions=31, d_model=15, n_layers=2, n_heads=3, dropout=0.0,
                           embd_dropout=0.0, attn_dropout=0.0, bos_token_id=0, eos_token_id=None)).eval()  # fmt: skip


def _steer(mod, args, out):
    return out + 0.3 * torch.arange(out.shape[-1], dtype=out.dtype)


def test_generate_records_every_attention_call():
    model = _gpt2()
    ids = torch.randint(0, 53, (2, 3), generator=torch.Generator().manual_seed(1))
    with record_attention(model) as maps:
        model.generate(ids, 6)
    assert [len(v) for v in maps.values()] == [6, 6]  # the prompt, then 5 steps, in each of the 2 layers


def test_a_steering_hook_on_a_block_changes_generate_as_in_the_reference_loop():
    model = _gpt2()
    ids = torch.randint(0, 53, (2, 3), generator=torch.Generator().manual_seed(1))
    plain = model.generate(ids, 8)
    handle = model.blocks[0].register_forward_hook(_steer)
    try:
        assert rules.has_hooks(model) and not rules.fast_path_allowed(model)
        steered = model.generate(ids, 8)
        assert torch.equal(steered, reference_decoding(lambda: model.generate(ids, 8)))
    finally:
        handle.remove()
    assert not torch.equal(plain, steered)
    assert torch.equal(model.generate(ids, 8), plain)


def test_a_steering_hook_on_a_decoder_layer_changes_translate_as_in_the_reference_steps():
    torch.manual_seed(0)
    model = Transformer(11, 13, d_model=14, n_heads=2, d_ff=22, n_layers=2, dropout=0.0, max_len=23).eval()
    src = torch.randint(3, 11, (3, 5), generator=torch.Generator().manual_seed(2))
    for beam in (1, 3):
        plain = model.translate(src, 8, bos=1, eos=2, beam_size=beam)
        calls = []
        handles = [model.decoder.layers[0].register_forward_hook(_steer),
                   model.encoder.layers[1].register_forward_hook(lambda m, a, o: calls.append(1))]  # fmt: skip
        try:
            steered = model.translate(src, 8, bos=1, eos=2, beam_size=beam)
            assert calls == [1]  # the encoder layer ran its own forward, once
            assert torch.equal(steered, reference_decoding(lambda: model.translate(src, 8, bos=1, eos=2, beam_size=beam)))
        finally:
            for h in handles:
                h.remove()
        assert not torch.equal(plain, steered)


def test_global_hooks_count():
    model = _gpt2()
    assert rules.fast_path_allowed(model)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert not rules.fast_path_allowed(model)
    finally:
        handle.remove()


@pytest.mark.parametrize("kw", [{"dtype": torch.float32}, {"dtype": torch.bfloat16}, {"quantize": "int8"}])
def test_fast_inference_steps_aside_for_hooks(kw):
    """A steering hook on a block (and a probe on an FFN) changes fast_inference's logits and tokens as the model's."""
    from sublayer.models import Bert, BertConfig, Llama, LlamaConfig, fast_inference

    torch.manual_seed(0)
    llama = Llama(LlamaConfig(vocab_size=53, max_positions=31, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2,
                              d_ff=22, eos_token_id=None)).eval()  # fmt: skip
    ids = torch.randint(0, 53, (2, 5), generator=torch.Generator().manual_seed(1))
    for model in (_gpt2(), llama):
        fast = fast_inference(model, **kw)
        plain = fast.generate(ids, 6)
        calls = []
        handles = [model.blocks[0].register_forward_hook(_steer),
                   model.blocks[1].ffn.register_forward_hook(lambda m, a, o: calls.append(1))]  # fmt: skip
        try:
            assert_close(fast(ids), model(ids))
            assert len(calls) == 2
            assert_close(fast(ids, labels=ids).loss, model(ids, labels=ids).loss)
            steered = fast.generate(ids, 6)
            assert torch.equal(steered, reference_decoding(lambda: model.generate(ids, 6)))
        finally:
            for h in handles:
                h.remove()
        assert not torch.equal(plain, steered)
    bert = Bert(BertConfig(vocab_size=53, d_model=15, n_layers=2, n_heads=3, d_ff=23, max_positions=31)).eval()
    fast = fast_inference(bert, **kw)
    mask = torch.tensor([[1] * 5, [0, 1, 1, 1, 1]])
    handle = bert.encoder.layers[0].register_forward_hook(_steer)
    try:
        assert_close(fast(ids, mask), bert(ids, mask))
        assert_close(fast.embed(ids, mask), bert.embed(ids, mask))
    finally:
        handle.remove()
