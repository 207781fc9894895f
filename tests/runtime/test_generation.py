"""runtime.generation's thread fitting: decoding calls run on torch's threads less the CPUs other processes keep
busy, with the same results."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from sublayer.kernels import cpu
from sublayer.models import GPT2, GPT2Config, Llama, LlamaConfig, Transformer, fast_inference
from sublayer.runtime import generation

from tests.conftest import reference_decoding


@pytest.fixture
def two_threads(monkeypatch):
    """Two torch threads on two usable CPUs, the measured load restored afterwards."""
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu, "usable_cpus", lambda: 2.0)
    monkeypatch.setattr(cpu, "others_busy", lambda since: 0.0)  # a quiet machine, whatever else runs
    monkeypatch.setitem(generation._neighbours, "busy", 0.0)
    yield
    torch.set_num_threads(was)


@pytest.mark.parametrize(("busy", "want"), [(0.0, 2), (0.4, 2), (0.6, 1), (1.0, 1), (3.0, 1)])
def test_fitted_threads_leaves_busy_cpus_to_their_owners(busy, want, two_threads, monkeypatch):
    monkeypatch.setitem(generation._neighbours, "busy", busy)
    monkeypatch.delenv("SUBLAYER_FIT_THREADS", raising=False)
    with generation.fitted_threads() as n:
        assert n == want and torch.get_num_threads() == want
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("SUBLAYER_FIT_THREADS", "0")
    with generation.fitted_threads() as n:
        assert n == 2 and torch.get_num_threads() == 2


def test_fitted_threads_measures_each_long_call(two_threads, monkeypatch):
    seen = iter([1.0, 0.0])
    monkeypatch.setattr(cpu, "others_busy", lambda since: next(seen))
    with generation.fitted_threads() as n:  # quiet so far: 2 threads; a neighbour appears meanwhile
        time.sleep(generation._MEASURE_S)
    assert n == 2 and generation._neighbours["busy"] == 1.0
    with generation.fitted_threads() as n:  # so 1 thread; the neighbour has gone meanwhile
        time.sleep(generation._MEASURE_S)
    assert n == 1 and generation._neighbours["busy"] == 0.0
    with generation.fitted_threads() as n:  # too short to measure: the estimate stays
        pass
    assert n == 2 and generation._neighbours["busy"] == 0.0
    with pytest.raises(RuntimeError, match="inside"):  # restored on an error too
        monkeypatch.setitem(generation._neighbours, "busy", 1.0)
        with generation.fitted_threads():
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def _record_fits(monkeypatch) -> list[int]:
    fits, real = [], generation.fitted_threads

    @contextlib.contextmanager
    def spy():
        with real() as n:
            fits.append(n)
            yield n

    monkeypatch.setattr(generation, "fitted_threads", spy)
    return fits


@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
def test_generate_runs_fitted_with_the_same_tokens(kind, two_threads, monkeypatch):
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=101, d_model=32, n_layers=2, n_heads=4, max_positions=40, dropout=0.0,
                            embd_dropout=0.0, attn_dropout=0.0)).eval()  # fmt: skip
    lm = model if kind == "float32" else fast_inference(model, **({"quantize": "int8"} if kind == "int8" else {"dtype": torch.bfloat16}))
    ids = torch.randint(0, 101, (3, 7), generator=torch.Generator().manual_seed(1))
    fits = _record_fits(monkeypatch)
    quiet = lm.generate(ids, 9)
    monkeypatch.setitem(generation._neighbours, "busy", 1.0)
    monkeypatch.setattr(cpu, "others_busy", lambda since: 1.0)
    busy = lm.generate(ids, 9)
    assert fits == [2, 1] and torch.equal(busy, quiet)


def test_translate_runs_fitted_with_the_same_tokens(two_threads, monkeypatch):
    torch.manual_seed(0)
    m = Transformer(11, 13, d_model=14, n_heads=2, d_ff=22, n_layers=2, dropout=0.0, max_len=23).eval()
    src = torch.randint(3, 11, (3, 5), generator=torch.Generator().manual_seed(2))
    fits = _record_fits(monkeypatch)
    quiet = [m.translate(src, max_len=9, bos=1, eos=2, beam_size=k) for k in (1, 3)]
    monkeypatch.setitem(generation._neighbours, "busy", 1.0)
    monkeypatch.setattr(cpu, "others_busy", lambda since: 1.0)
    busy = [m.translate(src, max_len=9, bos=1, eos=2, beam_size=k) for k in (1, 3)]
    assert fits == [2, 2, 1, 1] and all(torch.equal(a, b) for a, b in zip(quiet, busy))


@pytest.mark.parametrize("kind", ["model", "float32", "bfloat16", "int8"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_on_an_empty_batch_gives_an_empty_result(kind, family):
    # as the model's forward gives (0, T, vocab): an empty (0, T + max_new_tokens) result, the arguments checked
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2(GPT2Config(vocab_size=11, d_model=15, n_layers=2, n_heads=3, d_ff=7, max_positions=13))
    else:
        model = Llama(LlamaConfig(vocab_size=11, d_model=12, n_layers=2, n_heads=3, n_kv_heads=1, d_ff=7,
                                  max_positions=13))  # fmt: skip
    model.eval()
    if kind == "model":
        lm = model
    else:
        lm = fast_inference(model, **({"quantize": "int8"} if kind == "int8" else {"dtype": getattr(torch, kind)}))
    empty = torch.zeros(0, 5, dtype=torch.long)
    assert lm(empty).shape == (0, 5, 11)
    for kw in ({}, {"eos_token_id": 2, "attention_mask": torch.ones_like(empty)}, {"do_sample": True, "top_k": 3}):
        out = lm.generate(empty, 3, **kw)
        assert out.shape == (0, 8) and out.dtype == torch.long
    with pytest.raises(ValueError, match="prompt length 5 \\+ max_new_tokens 11 exceeds max_positions=13"):
        lm.generate(empty, 11)


@pytest.mark.parametrize("root_training", [True, False])
def test_generate_runs_every_part_in_eval_mode_and_restores_each_flag(root_training):
    # a part kept in eval mode inside a training model (or left training inside an eval one) keeps its flag
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=53, d_model=15, n_layers=2, n_heads=3, d_ff=7, max_positions=13, dropout=0.9))
    ids = torch.randint(0, 53, (4, 5), generator=torch.Generator().manual_seed(1))
    want = model.eval().generate(ids, 4)
    model.train(root_training)
    model.blocks[0].train(not root_training)
    flags = [m.training for m in model.modules()]
    for run in (lambda f: f(), reference_decoding):  # no dropout anywhere: the eval model's tokens each time
        assert run(lambda: model.generate(ids, 4)).tolist() == want.tolist()
        assert [m.training for m in model.modules()] == flags


def test_generate_checks_the_generator_and_the_streamer_before_decoding():
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=11, d_model=15, n_layers=2, n_heads=3, d_ff=7, max_positions=13)).eval()
    ids = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(1))
    for sample in (False, True):  # greedy ignored a bad generator; sampling failed inside torch.multinomial
        with pytest.raises(TypeError, match="generator must be None or a torch.Generator, got 3"):
            model.generate(ids, 2, do_sample=sample, generator=3)
    with pytest.raises(TypeError, match=r"streamer must be None or an object with put\(ids\) and end\(\), got list"):
        model.generate(ids, 2, streamer=[])


@pytest.mark.parametrize("kind", ["model", "reference", "float32", "int8"])
def test_generate_reads_pad_ids_of_a_prompt_without_mask_as_padding(kind):
    # HF's generate: without attention_mask the pad id (when it is no end token) marks padding
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=37, d_model=18, n_layers=2, n_heads=3, n_kv_heads=1, d_ff=7,
                              max_positions=23, pad_token_id=0, eos_token_id=2)).eval()  # fmt: skip
    lm = model
    if kind in ("float32", "int8"):
        lm = fast_inference(model, **({"quantize": "int8"} if kind == "int8" else {"dtype": torch.float32}))
    run = reference_decoding if kind == "reference" else (lambda f: f())
    ids = torch.randint(3, 37, (3, 6), generator=torch.Generator().manual_seed(1))
    ids[0, :2] = 0
    ids[2, :1] = 0
    masked = run(lambda: lm.generate(ids, 5, attention_mask=(ids != 0).long(), eos_token_id=None, pad_token_id=0))
    assert run(lambda: lm.generate(ids, 5, eos_token_id=None)).tolist() == masked.tolist()  # the config's pad
    assert run(lambda: lm.generate(ids, 5, eos_token_id=None, pad_token_id=0)).tolist() == masked.tolist()
    # pad id equal to an end token: no padding is read (HF's rule), the prompt is taken whole
    whole = run(lambda: lm.generate(ids, 5, attention_mask=torch.ones_like(ids), eos_token_id=[2, 0]))
    assert run(lambda: lm.generate(ids, 5, eos_token_id=[2, 0])).tolist() == whole.tolist()
    ids[1] = 0
    with pytest.raises(ValueError, match="input_ids has a row of pad_token_id=0 only"):
        run(lambda: lm.generate(ids, 5))
