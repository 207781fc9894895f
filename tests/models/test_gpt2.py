"""GPT-2: parity with HF ``GPT2LMHeadModel`` (logits, gradients, greedy ``generate``), sampling, config, checks."""

from __future__ import annotations

import dataclasses
import json

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
import pytest
import torch
from torch.testing import assert_close

from sublayer.checkpoints import CheckpointError
from sublayer.checkpoints import gpt2 as keymap
from sublayer.models import GPT2, GPT2Config
from sublayer.runtime.generation import filtered_probs
from tests.conftest import LossForward

from .conftest import EOS, MAX_POS, N_LAYERS, PAD, VOCAB, make_hf_gpt2

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ours(gpt2_folder) -> GPT2:
    return GPT2.from_pretrained(gpt2_folder).eval()


def _ids(b: int = 3, t: int = 7, seed: int = 5) -> torch.Tensor:
    # ids >= 3: no special token in prompts (HF's generate treats pad ids in the prompt as padding).
    return torch.randint(3, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


# ---- parity with Hugging Face --------------------------------------------------------------------------------


def test_logits_equal_hf(ours, hf_gpt2):
    x = _ids()
    with torch.no_grad():
        assert_close(ours(x), hf_gpt2(x).logits)


def test_logits_equal_hf_with_padding_at_real_positions(ours, hf_gpt2):
    x = _ids()
    mask = torch.ones_like(x)
    mask[0, 5:] = 0  # right padding
    mask[1, :2] = 0  # left padding
    with torch.no_grad():
        got = ours(x, attention_mask=mask)
        want = hf_gpt2(x, attention_mask=mask).logits
    # Only real query positions are defined: a left-padded query row whose every visible key is padding gives
    # zeros in our attention (finite), while HF attends somewhere arbitrary.
    real = mask.bool()
    assert_close(got[real], want[real])


def test_gradients_equal_hf(gpt2_folder, hf_gpt2):
    model = GPT2.from_pretrained(gpt2_folder).eval()
    hf = make_hf_gpt2()
    x = _ids()
    (model(x).square().mean()).backward()
    (hf(x).logits.square().mean()).backward()
    ours_grads = keymap.to_hf({k: p.grad for k, p in model.named_parameters()} | {"lm_head.weight": None}, N_LAYERS)
    hf_grads = {k.removeprefix("transformer."): p.grad for k, p in hf.named_parameters()}
    assert set(ours_grads) == set(hf_grads)
    for k, g in ours_grads.items():
        assert_close(g, hf_grads[k], msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_logits_equal_hf_other_activations(activation, tmp_path):
    hf = make_hf_gpt2(activation_function=activation, n_inner=11)
    hf.save_pretrained(tmp_path)
    model = GPT2.from_pretrained(tmp_path).eval()
    assert model.config.activation == activation and model.config.d_ff == 11
    x = _ids()
    with torch.no_grad():
        assert_close(model(x), hf(x).logits)


def test_greedy_generate_equals_hf(ours, hf_gpt2):
    x = _ids(t=4)
    want = hf_gpt2.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    got = ours.generate(x, 12, eos_token_id=EOS, pad_token_id=PAD)
    assert got.tolist() == want.tolist()


def test_greedy_generate_left_padded_equals_hf(ours, hf_gpt2):
    x = _ids(t=6, seed=11)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    mask[2, :1] = 0
    x = x.masked_fill(mask == 0, PAD)
    want = hf_gpt2.generate(x, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD)
    got = ours.generate(x, 10, attention_mask=mask, eos_token_id=hf_gpt2.generation_config.eos_token_id, pad_token_id=PAD)
    assert got.tolist() == want.tolist()


def test_generate_stops_at_eos_like_hf(ours, hf_gpt2):
    x = _ids(t=4, seed=3)
    free = ours.generate(x, 8, eos_token_id=None)  # no eos: the tokens the model picks
    eos = int(free[0, 4 + 1])  # row 0 produces it as its 2nd new token
    want = hf_gpt2.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    got = ours.generate(x, 8, eos_token_id=eos, pad_token_id=PAD)
    assert got.tolist() == want.tolist()
    row0 = got[0, 4:].tolist()
    k = row0.index(eos)  # the first eos; after it only padding
    assert k <= 1 and all(t == PAD for t in row0[k + 1:]) and k + 1 < len(row0)


def _hf_folder(tmp_path, name: str, x: torch.Tensor, generation_config: dict | None = None) -> tuple:
    """A tiny HF GPT-2 whose config.json's eos is the 3rd new token greedy decoding gives row 0 of ``x``, saved
    with ``generation_config`` as its generation_config.json (None: no such file). -> (folder, that eos)."""
    free = make_hf_gpt2().generate(x, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    eos = int(free[0, x.shape[1] + 2])
    folder = tmp_path / name
    make_hf_gpt2(eos_token_id=eos).save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder, eos


def _hf_generate(folder, x, **kw):
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder)
    return hf.generate(x, attention_mask=torch.ones_like(x), **kw)


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")  # HF's own 20 new tokens
def test_generate_defaults_from_config_json_equal_hf(tmp_path):
    """No generation_config.json: config.json's eos stops a row (padded with eos), as HF's generate."""
    x = _ids(b=2, t=4, seed=5)  # both rows give that eos as their 3rd new token
    folder, eos = _hf_folder(tmp_path, "a", x)
    ours = GPT2.from_pretrained(folder)
    got = ours.generate(x, 8)
    assert got.tolist() == _hf_generate(folder, x, max_new_tokens=8).tolist()
    assert got.shape == (2, 7) and got[:, -1].tolist() == [eos, eos]  # stopped at the eos
    free = ours.generate(x, 8, eos_token_id=None)  # None passed: no end token
    assert free.shape == (2, 12) and free[:, :7].tolist() == got.tolist()
    assert ours.generate(x).tolist() == _hf_generate(folder, x).tolist()  # HF's max_length 20


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")  # HF's own 20 new tokens
@pytest.mark.parametrize(
    "gen", [{"max_new_tokens": 5, "pad_token_id": PAD}, {"max_length": 7, "eos_token_id": None}, {"eos_token_id": 0}]
)
def test_generate_defaults_from_generation_config_json_equal_hf(tmp_path, gen):
    x = _ids(b=2, t=4, seed=5)
    folder, _ = _hf_folder(tmp_path, "a", x, gen)  # config.json's eos no longer counts, as in HF
    ours = GPT2.from_pretrained(folder)
    want = _hf_generate(folder, x)
    assert ours.generate(x).tolist() == want.tolist()
    ours.save_pretrained(tmp_path / "b")  # written back: HF reads the same defaults
    assert _hf_generate(tmp_path / "b", x).tolist() == want.tolist()
    assert GPT2.from_pretrained(tmp_path / "b").generation_config == ours.generation_config
    assert GPT2.from_hf(transformers.GPT2LMHeadModel.from_pretrained(folder)).generation_config == ours.generation_config


@pytest.mark.filterwarnings("ignore:`do_sample` is set to `False`")  # HF warns of the unread temperature
def test_greedy_generation_config_json_with_temperature_0_loads_as_hf(tmp_path):
    """HF's greedy configs may hold temperature 0.0 (unread when greedy): loaded, and greedy runs as HF's."""
    x = _ids(b=2, t=4, seed=5)
    folder, _ = _hf_folder(tmp_path, "a", x, {"max_new_tokens": 5, "temperature": 0.0})
    ours = GPT2.from_pretrained(folder)
    assert ours.generation_config.temperature == 0.0
    assert ours.generate(x).tolist() == _hf_generate(folder, x).tolist()
    assert ours.generate(x, 3, temperature=0.0).tolist() == ours.generate(x, 3).tolist()  # greedy: not read
    with pytest.raises(ValueError, match="temperature must be a float > 0 to sample, got 0.0"):
        ours.generate(x, 3, do_sample=True)


def test_generation_config_json_errors(tmp_path):
    x = _ids(b=1, t=4)
    for gen, match in [
        ({"temperature": 0.0, "do_sample": True}, r"temperature must be None or a float > 0 \(0 without do_sample\)"),
        ({"temperature": -1.0}, r"temperature must be None or a float > 0 \(0 without do_sample\), got -1.0"),
        ({"num_beams": 4}, r"unsupported generation option num_beams=4 \(only 1 is implemented\)"),
        ({"pad_token_id": [2, 3]}, r"pad_token_id must be a single id, got the list \[2, 3\]"),
        ({"pad_token_id": VOCAB}, rf"generation_config.pad_token_id must be < vocab_size={VOCAB}, got {VOCAB}"),
        ({"top_p": 2}, r"top_p must be None or in \(0, 1\], got 2"),
    ]:
        folder, _ = _hf_folder(tmp_path, "a", x, gen)
        with pytest.raises(CheckpointError, match=rf"generation config .*generation_config.json: {match}"):
            GPT2.from_pretrained(folder)
    ours = GPT2.from_pretrained(_hf_folder(tmp_path, "b", x, {"max_length": 4, "eos_token_id": EOS})[0])
    with pytest.raises(ValueError, match="max_new_tokens is not given and generation_config.max_length=4 leaves no room"):
        ours.generate(x)


def test_config_ids_must_lie_in_the_vocabulary():
    assert GPT2Config().eos_token_id == 50256 and GPT2Config(vocab_size=97).eos_token_id == 96  # -1: the last id
    with pytest.raises(ValueError, match=r"eos_token_id must be None or an int in \[-97, vocab_size=97\), got 50256"):
        GPT2Config(vocab_size=97, eos_token_id=50256)
    with pytest.raises(ValueError, match=r"pad_token_id must be .*vocab_size=2000\), got 2000"):
        GPT2Config(vocab_size=2000, pad_token_id=2000)
    hf = transformers.GPT2Config(vocab_size=97, n_embd=6, n_layer=1, n_head=2)  # HF's bos/eos 50256
    with pytest.raises(ValueError, match=r"bos_token_id must be .*vocab_size=97\), got 50256"):
        GPT2Config.from_hf_dict(hf.to_dict())


def test_cached_decoding_equals_full_recompute(ours):
    # Greedy decoding without any cache: run the whole sequence each step; the KV-cached path must agree.
    x = _ids(b=2, t=3, seed=8)
    seq = x
    with torch.no_grad():
        for _ in range(9):
            seq = torch.cat([seq, ours(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ours.generate(x, 9).tolist() == seq.tolist()


def test_causal_future_tokens_do_not_change_past_logits(ours):
    x = _ids(b=2, t=9)
    y = x.clone()
    y[:, 5:] = (y[:, 5:] + 7) % VOCAB
    with torch.no_grad():
        assert_close(ours(x)[:, :5], ours(y)[:, :5])


def test_batch_row_equals_running_it_alone(ours):
    x = _ids(b=3, t=6)
    with torch.no_grad():
        assert_close(ours(x)[1:2], ours(x[1:2]))


# ---- sampling ------------------------------------------------------------------------------------------------


def test_sampling_reproducible_with_seed(ours):
    x = _ids(b=2, t=3)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return ours.generate(x, 12, do_sample=True, temperature=1.3, generator=g).tolist()

    assert run(4) == run(4)
    assert run(4) != run(5)


def test_top_k_one_equals_greedy(ours):
    x = _ids(b=2, t=3)
    g = torch.Generator().manual_seed(0)
    sampled = ours.generate(x, 10, do_sample=True, top_k=1, temperature=0.7, generator=g)
    assert sampled.tolist() == ours.generate(x, 10).tolist()


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, None, None), (1.0, 5, None), (1.3, None, 0.6), (0.9, 7, 0.8)])
def test_sampling_filters_equal_hf_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p))
    want = warpers(None, logits.clone()).softmax(-1)
    got = filtered_probs(logits, temperature, top_k, top_p)
    assert_close(got, want)
    if top_k is not None:
        assert bool(((got > 0).sum(-1) <= top_k).all())


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.9])
def test_top_p_keeps_hf_warpers_tokens_among_tied_logits(top_p):
    """Tied logits at the nucleus' edge (bf16 logits, a flat row): the same tokens are kept as HF's."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = (torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 2).round()
    logits[0] = 0.0  # every token tied
    want = TopPLogitsWarper(top_p)(None, logits.clone()).softmax(-1)
    assert_close(filtered_probs(logits, 1.0, None, top_p), want)


def test_generate_restores_training_mode(gpt2_folder):
    model = GPT2.from_pretrained(gpt2_folder).train()
    out = model.generate(_ids(b=1, t=2), 3)
    assert model.training and out.shape == (1, 5)


def test_generate_zero_new_tokens_returns_prompt(ours):
    x = _ids()
    assert torch.equal(ours.generate(x, 0), x)


# ---- argument checks -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"temperature": 0.0, "do_sample": True}, ValueError, "temperature must be a float > 0 to sample, got 0.0"),
        ({"temperature": -0.5}, ValueError, "temperature must be a float > 0, got -0.5"),
        ({"top_k": -2}, ValueError, "top_k must be a positive int, got -2"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\], got 1.5"),
        ({"eos_token_id": -1}, ValueError, "eos_token_id must be None, an int >= 0 or a non-empty list of them, got -1"),
        ({"eos_token_id": VOCAB}, ValueError, rf"eos_token_id must be .* vocab_size={VOCAB}\), got {VOCAB}"),
        ({"pad_token_id": VOCAB + 5}, ValueError, rf"pad_token_id must be .* vocab_size={VOCAB}\), got {VOCAB + 5}"),
        ({"do_sample": 1}, TypeError, "do_sample must be a bool, got 1"),
    ],
)
def test_generate_rejects_bad_options(ours, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ours.generate(_ids(), 2, **kwargs)


def test_top_k_zero_is_no_filter_as_in_hf(ours):
    ids = _ids()
    runs = [ours.generate(ids, 4, do_sample=True, top_k=k, generator=torch.Generator().manual_seed(3)) for k in (0, None)]
    assert torch.equal(*runs)


def test_generate_rejects_too_long(ours):
    with pytest.raises(ValueError, match=rf"prompt length 7 \+ max_new_tokens {MAX_POS} exceeds max_positions={MAX_POS}"):
        ours.generate(_ids(), MAX_POS)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        ours.generate(_ids(), -1)


@pytest.mark.parametrize(
    ("ids", "exc", "match"),
    [
        (torch.zeros(2, 3), TypeError, "input_ids must hold integer token ids, got dtype torch.float32"),
        (torch.zeros(3, dtype=torch.long), ValueError, r"input_ids must have shape \(batch, seq_len\).*got \(3,\)"),
        (
            torch.full((1, 2), VOCAB),
            ValueError,
            rf"input_ids must lie in \[0, vocab_size={VOCAB}\), got values in \[{VOCAB}, {VOCAB}\]",
        ),
        (
            torch.zeros(1, MAX_POS + 1, dtype=torch.long),
            ValueError,
            f"input_ids has {MAX_POS + 1} positions, more than max_positions={MAX_POS}",
        ),
        ([[1, 2]], TypeError, "input_ids must be a torch.Tensor of token ids, got list"),
    ],
)
def test_forward_rejects_bad_ids(ours, ids, exc, match):
    with pytest.raises(exc, match=match):
        ours(ids)


def test_forward_rejects_bad_attention_mask(ours):
    x = _ids()
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids \(3, 7\), got \(3, 6\)"):
        ours(x, attention_mask=torch.ones(3, 6))
    with pytest.raises(ValueError, match="attention_mask must hold only 0"):
        ours(x, attention_mask=torch.full((3, 7), 2))


# ---- config --------------------------------------------------------------------------------------------------


def test_config_from_hf_dict_maps_fields(hf_gpt2):
    cfg = GPT2Config.from_hf_dict(hf_gpt2.config.to_dict())
    assert (cfg.vocab_size, cfg.max_positions, cfg.d_model, cfg.n_layers, cfg.n_heads) == (VOCAB, MAX_POS, 15, 2, 3)
    assert cfg.d_ff is None and cfg.hidden_size == 60 and cfg.activation == "gelu_tanh" and cfg.eps == 1e-5
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, EOS, None)
    assert GPT2Config.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "bert"}, "model_type must be 'gpt2' for GPT-2, got 'bert'"),
        ({"activation_function": "quick_gelu"}, "unsupported activation_function 'quick_gelu'; supported: gelu_new"),
        ({"scale_attn_by_inverse_layer_idx": True}, "unsupported GPT-2 option scale_attn_by_inverse_layer_idx=True"),
        ({"n_embd": 16}, r"d_model \(16\) must be divisible by n_heads \(3\)"),
        ({"eos_token_id": [2, 3]}, r"eos_token_id must be a single id, got the list \[2, 3\]"),
    ],
)
def test_config_from_hf_dict_rejects(hf_gpt2, change, match):
    d = hf_gpt2.config.to_dict() | change
    with pytest.raises(ValueError, match=match):
        GPT2Config.from_hf_dict(d)


def test_config_rejects_unknown_keys():
    d = dataclasses.asdict(GPT2Config()) | {"n_embd_typo": 3}
    with pytest.raises(ValueError, match="unknown GPT2Config keys: n_embd_typo"):
        GPT2Config.from_dict(d)
    with pytest.raises(ValueError, match="unknown activation 'swiglu'"):
        GPT2Config(activation="swiglu")


def test_tied_head_shares_the_embedding():
    model = GPT2(GPT2Config(vocab_size=11, max_positions=7, d_model=6, n_layers=1, n_heads=2))
    assert model.lm_head.weight is model.wte.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
    untied = GPT2(dataclasses.replace(model.config, tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.wte.weight


def test_loaded_head_stays_tied(ours):
    assert ours.lm_head.weight is ours.wte.weight
    assert len(list(ours.parameters())) == len({id(p) for p in ours.parameters()})


def test_module_structure_is_plain(ours):
    # What tensor-parallel plans address: separate q/k/v/out projections and fc1/fc2 (no fused c_attn).
    block = ours.blocks[0]
    names = {n for n, _ in block.named_modules()}
    assert {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "ffn.fc1", "ffn.fc2"} <= names
    assert isinstance(block.self_attn.q_proj, torch.nn.Linear) and block.self_attn.q_proj.weight.shape == (15, 15)


# ---- properties ----------------------------------------------------------------------------------------------


@hsettings(max_examples=8)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3), new=st.integers(1, 6), seed=st.integers(0, 99))
def test_left_padded_batch_generates_like_each_row_alone(ours, lengths, new, seed):
    # Padding, the positions derived from the mask and the cached decoding together: every row of a left-padded
    # batch continues exactly as the same prompt run alone without padding.
    t = max(lengths)
    x = _ids(b=len(lengths), t=t, seed=seed)
    mask = torch.zeros_like(x)
    for i, n in enumerate(lengths):
        mask[i, t - n :] = 1
    batch = ours.generate(x.masked_fill(mask == 0, PAD), new, attention_mask=mask)
    for i, n in enumerate(lengths):
        alone = ours.generate(x[i : i + 1, t - n :], new)
        assert batch[i, t - n :].tolist() == alone[0].tolist()


def test_from_pretrained_is_in_eval_mode_and_generate_ignores_the_mode(tmp_path):
    cfg = GPT2Config(vocab_size=VOCAB, max_positions=MAX_POS, d_model=12, n_layers=1, n_heads=3, dropout=0.3,
                     embd_dropout=0.3, attn_dropout=0.3)  # fmt: skip
    GPT2(cfg).save_pretrained(tmp_path)
    model = GPT2.from_pretrained(tmp_path)
    assert not any(m.training for m in model.modules())  # as HF's from_pretrained
    x = _ids(b=1, t=3)
    first = model.generate(x, 5)
    assert torch.equal(model.train().generate(x, 5), first) and model.training


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int8, torch.bool])
def test_small_integer_ids_are_refused_with_the_dtype_named(ours, dtype):
    """uint8 ids passed the check, then indexed as a mask inside torch."""
    from sublayer.models.fast import fast_inference

    ids = _ids().to(dtype)
    for model in (ours, fast_inference(ours)):
        with pytest.raises(TypeError, match=rf"input_ids must hold integer token ids, got dtype {dtype} \(int64 or int32"):
            model(ids)
    assert ours(_ids().to(torch.int32)).shape == ours(_ids()).shape  # int32 ids are fine


def test_position_ids_range_error_names_max_positions(ours):
    with pytest.raises(ValueError, match=rf"position_ids must lie in \[0, max_positions={MAX_POS}\)"):
        ours(_ids(), position_ids=torch.full((3, 7), MAX_POS))


def test_gradcheck_float64_forward_and_loss_with_padding():
    cfg = GPT2Config(vocab_size=11, max_positions=7, d_model=6, n_layers=1, n_heads=3, d_ff=5,
                     dropout=0.0, embd_dropout=0.0, attn_dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = LossForward(GPT2(cfg, dtype=torch.float64))
    names, params = zip(*[(n, p.detach().clone().requires_grad_(True)) for n, p in model.named_parameters()])
    x = torch.tensor([[1, 4, 7, 2], [3, 3, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])  # left padding: the padding-free path runs

    def logits(*ps):
        return torch.func.functional_call(model.model, {n[6:]: p for n, p in zip(names, ps)}, (x,),
                                          {"attention_mask": mask})[mask.bool()]  # fmt: skip

    def loss(*ps):
        return torch.func.functional_call(model, dict(zip(names, ps)), (x,), {"attention_mask": mask})

    assert torch.autograd.gradcheck(logits, params, fast_mode=True)
    assert torch.autograd.gradcheck(loss, params, fast_mode=True)
