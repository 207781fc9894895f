"""Prepared weights are never stale: after any way a user changes weights, the next generate / translate /
fast_inference call equals a freshly built model's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from sublayer.models import GPT2, Bert, BertConfig, GPT2Config, Transformer, fast_inference
from sublayer.runtime import weights


def _gpt2() -> GPT2:
    torch.manual_seed(0)
    return GPT2(GPT2Config(vocab_size=53, max_positions=31, d_model=15, n_layers=2, n_heads=3, dropout=0.0,
                           embd_dropout=0.0, attn_dropout=0.0, bos_token_id=0, eos_token_id=None))  # fmt: skip


def _bert() -> Bert:
    torch.manual_seed(0)
    return Bert(BertConfig(vocab_size=53, d_model=15, n_layers=2, n_heads=3, d_ff=23, max_positions=31,
                           dropout=0.0, attn_dropout=0.0))  # fmt: skip


def _transformer() -> Transformer:
    torch.manual_seed(0)
    return Transformer(11, 13, d_model=14, n_heads=2, d_ff=22, n_layers=2, dropout=0.0, max_len=23)


def _train_step(model: torch.nn.Module, loss_fn, how: str) -> None:
    opt = {
        "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
        "adam_foreach": lambda p: torch.optim.Adam(p, lr=0.05, foreach=True),
        "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.5, fused=True),
        "sgd_loop": lambda p: torch.optim.SGD(p, lr=0.5, foreach=False),
    }[how](model.parameters())
    model.train()
    loss_fn(model).backward()
    opt.step()
    model.eval()


CHANGES = ["adamw_fused", "adam_foreach", "sgd_fused", "sgd_loop", "data_mul", "load_state_dict"]


def _change(model: torch.nn.Module, loss_fn, how: str) -> None:
    if how == "data_mul":
        for p in model.parameters():
            p.data.mul_(1.5)
    elif how == "load_state_dict":
        other = copy.deepcopy(model)
        for p in other.parameters():
            p.detach().add_(0.05)
        model.load_state_dict(other.state_dict())
    else:
        _train_step(model, loss_fn, how)


def _fresh(model: torch.nn.Module) -> torch.nn.Module:
    weights.clear_cache()
    return copy.deepcopy(model)


@pytest.mark.parametrize("how", CHANGES)
def test_generate_after_a_weight_change_equals_a_fresh_model(how):
    model = _gpt2().eval()
    ids = torch.randint(0, 53, (2, 4), generator=torch.Generator().manual_seed(1))
    model.generate(ids, 6)  # builds the prepared weights
    _change(model, lambda m: m.loss(ids), how)
    got = model.generate(ids, 6)
    assert torch.equal(got, _fresh(model).generate(ids, 6))


@pytest.mark.parametrize("how", CHANGES)
def test_translate_after_a_weight_change_equals_a_fresh_model(how):
    model = _transformer().eval()
    src = torch.randint(3, 11, (2, 5), generator=torch.Generator().manual_seed(2))
    tgt = torch.randint(3, 13, (2, 6), generator=torch.Generator().manual_seed(3))
    model.translate(src, 6, bos=1, eos=2)
    _change(model, lambda m: m.loss(src, tgt, tgt), how)
    got = model.translate(src, 6, bos=1, eos=2)
    assert torch.equal(got, _fresh(model).translate(src, 6, bos=1, eos=2))


@pytest.mark.parametrize("how", CHANGES)
def test_fast_inference_after_a_weight_change_equals_a_fresh_model(how):
    ids = torch.randint(0, 53, (2, 5), generator=torch.Generator().manual_seed(4))
    gpt2, bert = _gpt2().eval(), _bert().eval()
    fast_g, fast_b = fast_inference(gpt2, dtype=torch.float32), fast_inference(bert, dtype=torch.float32)
    fast_g(ids), fast_b(ids)
    _change(gpt2, lambda m: m.loss(ids), how)
    _change(bert, lambda m: m(ids).square().mean(), how)
    assert_close(fast_g(ids), fast_inference(_fresh(gpt2), dtype=torch.float32)(ids))
    assert_close(fast_b(ids), fast_inference(_fresh(bert), dtype=torch.float32)(ids))


def test_generate_under_inference_mode():
    model = _gpt2().eval()
    ids = torch.randint(0, 53, (2, 4), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, 5)
    with torch.inference_mode():
        assert torch.equal(model.generate(ids, 5), want)
        made = _gpt2().eval()  # parameters made under inference_mode are inference tensors
        assert torch.equal(made.generate(ids, 5), want)
    assert torch.equal(model.generate(ids, 5), want)


def test_a_prepared_form_is_built_once_and_rebuilt_after_a_change():
    model = torch.nn.Linear(3, 5)
    built = []

    def build(m):
        built.append(1)
        return m.weight.detach().clone()

    for _ in range(3):
        weights.prepared(model, "k", build)
    assert len(built) == 1
    with torch.no_grad():
        model.weight[0, 0] += 1  # in place: the version counter
    assert_close(weights.prepared(model, "k", build), model.weight.detach())
    model.weight.data.mul_(2)  # through .data: the samples
    assert_close(weights.prepared(model, "k", build), model.weight.detach())
    assert len(built) == 3


def test_kept_samples_follow_the_storage_and_layout():
    """The sample views kept between calls read the storage as it is now; a ``.data`` swapped for the same storage
    transposed or for a new one, and a non-contiguous parameter written through ``.data``, are noticed too."""
    model = torch.nn.Linear(5, 5)

    def build(m):
        return m.weight.detach().clone()

    weights.prepared(model, "k", build)
    model.weight.data = model.weight.data.t()  # same storage and shape, other strides
    assert_close(weights.prepared(model, "k", build), model.weight.detach())
    model.weight.data = torch.randn(5, 5)  # a new storage
    assert_close(weights.prepared(model, "k", build), model.weight.detach())
    model.weight.data = torch.randn(5, 5).t()  # not contiguous: sampled anew each call
    weights.prepared(model, "k", build)
    model.weight.data.mul_(3)
    assert_close(weights.prepared(model, "k", build), model.weight.detach())


def test_inference_tensors_written_in_a_few_elements_are_noticed():
    """Inference tensors keep no version counter: a write to one column, which no sample position reads, is still
    seen by ``generate`` and ``fast_inference`` (the checksum)."""
    ids = torch.randint(0, 53, (2, 4), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model = _gpt2().eval()
        fast = fast_inference(model, dtype=torch.float32)
        fast(ids), model.generate(ids, 5)  # prepared
        for blk in model.blocks:
            blk.ffn.fc2.weight[:, 5] *= 40.0
        model.lm_head.weight[7] *= 40.0
        assert_close(fast(ids), model(ids))
        assert torch.equal(model.generate(ids, 5), _fresh(model).generate(ids, 5))


def test_a_norm_eps_set_after_the_first_call_is_used():
    model = _gpt2().eval()
    ids = torch.randint(0, 53, (2, 4), generator=torch.Generator().manual_seed(1))
    fast = fast_inference(model, dtype=torch.float32)
    fast(ids), model.generate(ids, 5)
    for m in model.modules():
        if hasattr(m, "eps"):
            m.eps = 10.0
    assert_close(fast(ids), model(ids))
    assert torch.equal(model.generate(ids, 5), _fresh(model).generate(ids, 5))


def test_an_ffn_activation_set_after_the_first_call_is_used():
    model = _gpt2().eval()
    ids = torch.randint(0, 53, (2, 4), generator=torch.Generator().manual_seed(1))
    fast = fast_inference(model, dtype=torch.float32)
    fast(ids), model.generate(ids, 5)
    for block in model.blocks:
        block.ffn.activation = "relu"
    assert_close(fast(ids), model(ids))
    assert torch.equal(model.generate(ids, 5), _fresh(model).generate(ids, 5))


def test_pinned_checks_each_form_once_per_block():
    """Inside ``pinned`` (one generate call) a form is checked once; the next call sees the change."""
    model = torch.nn.Linear(3, 5)

    def build(m):
        return m.weight.detach().clone()

    with weights.pinned():
        first = weights.prepared(model, "k", build)
        with torch.no_grad():
            model.weight.add_(1.0)
        assert weights.prepared(model, "k", build) is first
    assert_close(weights.prepared(model, "k", build), model.weight.detach())


def test_pinned_stamps_a_module_once_for_all_its_forms(monkeypatch):
    """Two prepared forms of one model in one block (a generate's prompt and steps) read its stamp once."""
    model, other = torch.nn.Linear(3, 5), torch.nn.Linear(3, 5)
    calls = []
    real = weights.stamp
    monkeypatch.setattr(weights, "stamp", lambda m: calls.append(m) or real(m))
    with weights.pinned():
        for key in ("a", "b", "a"):
            weights.prepared(model, key, lambda m: m.weight.detach().clone())
        weights.prepared(other, "a", lambda m: m.weight.detach().clone())
    assert calls == [model, other]
    weights.prepared(model, "a", lambda m: None)  # outside a block: stamped on every use
    assert calls == [model, other, model]


def test_a_streamer_that_changes_weights_is_seen_by_what_it_calls():
    """generate checks each prepared form once, but a call from its streamer sees the weights the streamer wrote."""
    model = _gpt2().eval()
    fast = fast_inference(model, dtype=torch.float32)
    ids = torch.randint(0, 53, (1, 4), generator=torch.Generator().manual_seed(1))
    seen = []

    class Streamer:
        def put(self, value):
            if value.dim() == 1 and not seen:
                with torch.no_grad():
                    model.blocks[0].ffn.fc1.weight.mul_(-1.0)
                seen.append((fast(ids) - model(ids)).abs().max().item())

        def end(self):
            pass

    model.generate(ids, 3, streamer=Streamer())
    assert seen and seen[0] < 1e-5
