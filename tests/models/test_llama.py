"""Llama / Qwen2: parity with HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` on tiny random models (logits, every
parameter gradient in fp32 and fp64, ``labels=`` loss, greedy ``generate`` with left padding and eos), gradcheck,
checkpoint folders both ways (sharded too), packed documents, ``record_attention``, config refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.testing import assert_close

from sublayer import record_attention
from sublayer.checkpoints import CheckpointError
from sublayer.checkpoints import llama as keymap
from sublayer.models import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

VOCAB, PAD, BOS, EOS = 97, 0, 1, 2
LLAMA3 = {
    "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}  # fmt: skip
# hidden 30, 5 heads of 6 unless said otherwise; FFN 22; vocab 97; 2 layers
CASES = {
    "mqa-untied": ("llama", {"num_key_value_heads": 1}),
    "mha-tied-bias-llama3": (
        "llama", {"num_key_value_heads": 5, "tie_word_embeddings": True, "attention_bias": True,
                  "rope_parameters": {**LLAMA3, "rope_theta": 500.0}},
    ),
    "gqa-2-groups-head_dim": ("llama", {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 10}),
    "qwen2": ("qwen2", {"num_key_value_heads": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen2-tied": ("qwen2", {"num_key_value_heads": 5, "tie_word_embeddings": True}),
}  # fmt: skip
cases = pytest.mark.parametrize("case", sorted(CASES))


def make_hf(case: str, **overrides):
    kind, kw = CASES[case]
    cfg = dict(
        vocab_size=VOCAB, hidden_size=30, intermediate_size=22, num_hidden_layers=2, num_attention_heads=5,
        max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )  # fmt: skip
    cfg.update(kw, **overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**cfg))
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():  # every parameter random: a key mapped to the wrong place cannot hide
        for name, p in hf.named_parameters():
            gain = name.endswith("norm.weight")
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if gain else 0.3) + (1.0 if gain else 0.0))
    return hf.eval()


def _ids(b: int = 3, t: int = 9, seed: int = 5) -> torch.Tensor:
    # ids >= 3: no special token in prompts (HF's generate treats pad ids in the prompt as padding).
    return torch.randint(3, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _grads(model: Llama, hf) -> tuple[dict, dict]:
    tied = model.config.tie_word_embeddings
    ours = keymap.to_hf({k: p.grad for k, p in model.named_parameters()}, model.config.n_layers, tied=tied)
    theirs = {k.removeprefix("model."): p.grad for k, p in hf.named_parameters()}
    assert set(ours) == set(theirs)
    return ours, theirs


def _assert_grads_equal(model: Llama, hf, **tol) -> None:
    ours, theirs = _grads(model, hf)
    for k, g in ours.items():
        assert g is not None and theirs[k] is not None, k
        assert_close(g, theirs[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


# ---- parity with Hugging Face --------------------------------------------------------------------------------


@cases
def test_logits_and_every_gradient_equal_hf(case, kernels_mode):
    hf = make_hf(case)
    model = Llama.from_hf(hf)
    assert model.config.model_type == CASES[case][0]
    x = _ids()
    got, want = model(x), hf(x).logits
    assert_close(got, want)
    g = torch.randn_like(got)
    (got * g).mean().backward()  # mean: gradients of order 1, where the fp32 tolerances mean what they say
    (want * g).mean().backward()
    _assert_grads_equal(model, hf)


def _rms_norm_in_input_dtype(self, x):  # LlamaRMSNorm / Qwen2RMSNorm without the float32 round trip
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@cases
def test_float64_logits_and_gradients_to_1e_10(case, monkeypatch):
    # HF's RMSNorm computes in float32 even for float64 inputs; with that patched out (and rotary angles float32
    # on both sides) the two float64 models must agree to rounding.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    monkeypatch.setattr(LlamaRMSNorm, "forward", _rms_norm_in_input_dtype)
    monkeypatch.setattr(Qwen2RMSNorm, "forward", _rms_norm_in_input_dtype)
    hf = make_hf(case).double()
    model = Llama.from_hf(hf)
    assert model.lm_head.weight.dtype == torch.float64
    x = _ids(2, 7)
    got, want = model(x), hf(x).logits
    assert_close(got, want, rtol=0, atol=1e-10)
    g = torch.randn_like(got)
    (got * g).mean().backward()
    (want * g).mean().backward()
    _assert_grads_equal(model, hf, rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", ["gqa-2-groups-head_dim", "qwen2-tied"])
def test_bfloat16_logits_as_close_to_float32_as_hf_bfloat16(case, tmp_path):
    # HF rounds the RMSNorm output to bf16 before the gain, we round once after it: the two bf16 models differ by
    # rounding, so each is measured against the float32 logits; ours must be at least about as close.
    hf = make_hf(case)
    hf.save_pretrained(tmp_path)
    hf16 = type(hf).from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ours16 = Llama.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert ours16.lm_head.weight.dtype == torch.bfloat16
    x = _ids()
    with torch.no_grad():
        ref = hf(x).logits
        ours_err = (ours16(x).float() - ref).abs().mean()
        hf_err = (hf16(x).logits.float() - ref).abs().mean()
    assert ours_err <= 1.25 * hf_err, (ours_err, hf_err)


def test_gradcheck_float64():
    config = LlamaConfig(
        vocab_size=11, max_positions=8, d_model=6, n_layers=1, n_heads=3, n_kv_heads=1, head_dim=2, d_ff=5,
        tie_word_embeddings=True, pad_token_id=None, attention_bias=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Llama(config, dtype=torch.float64)
    names, params = zip(*[(n, p.detach().clone().requires_grad_(True)) for n, p in model.named_parameters()])
    x = torch.tensor([[1, 4, 7, 2], [3, 3, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])

    def f(*ps):
        out = torch.func.functional_call(model, dict(zip(names, ps)), (x,), {"attention_mask": mask})
        return out[mask.bool()]

    assert torch.autograd.gradcheck(f, params)


@cases
def test_logits_equal_hf_with_padding_at_real_positions(case):
    hf = make_hf(case)
    model = Llama.from_hf(hf)
    x = _ids(4, 8)
    mask = torch.ones_like(x)
    mask[0, 5:] = 0  # right padding
    mask[1, :3] = 0  # left padding
    mask[3, :1] = 0
    with torch.no_grad():
        got = model(x, attention_mask=mask)
        want = hf(x, attention_mask=mask).logits
    # Only real query positions are defined: a left-padded query row that sees no real key gets a zero attention
    # output in ours (finite), while HF's is arbitrary.
    real = mask.bool()
    assert_close(got[real], want[real])


@pytest.mark.parametrize("case", ["mqa-untied", "qwen2-tied", "gqa-2-groups-head_dim"])
@pytest.mark.parametrize("padding", ["none", "right", "left", "one-row-all-padding"])
def test_loss_and_every_gradient_equal_hf_labels_loss(case, padding):
    hf = make_hf(case)
    model = Llama.from_hf(hf)
    x = _ids(4, 8)
    mask = torch.ones_like(x)
    if padding == "right":
        mask[0, 5:] = 0
        mask[2, 2:] = 0
    elif padding == "left":
        mask[1, :3] = 0
        mask[3, :1] = 0
    elif padding == "one-row-all-padding":
        mask[1] = 0
        mask[3, 6:] = 0
    labels = x.masked_fill(mask == 0, -100)  # our default; HF needs them spelled out
    got = model.loss(x, attention_mask=mask)
    want = hf(x, attention_mask=mask, labels=labels).loss
    # left padding: the last pad position predicts the first real token; its query row sees only padding, and
    # both libraries give it a zero attention output
    assert_close(got, want, rtol=1e-5, atol=0)
    got.backward()
    want.backward()
    _assert_grads_equal(model, hf)


def test_loss_explicit_labels_and_errors():
    hf = make_hf("mqa-untied")
    model = Llama.from_hf(hf)
    x = _ids()
    labels = _ids(seed=9)
    labels[0, 3:] = -1
    got = model.loss(x, labels=labels, ignore_index=-1)
    with torch.no_grad():
        want = hf(x, labels=labels.masked_fill(labels == -1, -100)).loss
    assert_close(got.detach(), want)
    with pytest.raises(ValueError, match="no position has a target"):
        model.loss(x[:, :1])
    empty = torch.zeros_like(x)  # an all-padding batch: finite logits, and no target for a mean
    assert torch.isfinite(model(x, attention_mask=empty)).all()
    with pytest.raises(ValueError, match="no position has a target"):
        model.loss(x, attention_mask=empty)
    with pytest.raises(ValueError, match="labels must have the shape of input_ids"):
        model.loss(x, labels=x[:, :4])


# ---- generation ----------------------------------------------------------------------------------------------


@cases
def test_greedy_generate_equals_hf(case):
    hf = make_hf(case)
    model = Llama.from_hf(hf)
    x = _ids(3, 4)
    want = hf.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    assert model.generate(x, 12, eos_token_id=EOS, pad_token_id=PAD).tolist() == want.tolist()


@pytest.mark.parametrize("case", ["gqa-2-groups-head_dim", "qwen2"])
def test_greedy_generate_left_padded_equals_hf(case):
    hf = make_hf(case)
    model = Llama.from_hf(hf)
    x = _ids(3, 6, seed=11)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    mask[2, :1] = 0
    x = x.masked_fill(mask == 0, PAD)
    want = hf.generate(x, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    got = model.generate(x, 10, attention_mask=mask, eos_token_id=EOS, pad_token_id=PAD)
    assert got.tolist() == want.tolist()


def test_greedy_generate_of_pad_ids_without_mask_equals_hf():
    # HF's generate reads the prompt's pad ids as padding when no attention_mask is given
    hf = make_hf("gqa-2-groups-head_dim")
    model = Llama.from_hf(hf)
    x = _ids(3, 6, seed=11)
    x[0, :3] = PAD
    x[2, :1] = PAD
    want = hf.generate(x, max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    assert model.generate(x, 10).tolist() == want.tolist()


def test_generate_stops_at_eos_like_hf():
    hf = make_hf("mqa-untied")
    model = Llama.from_hf(hf)
    x = _ids(3, 4, seed=3)
    free = model.generate(x, 8)  # no eos: the tokens the model picks
    eos = int(free[0, 4 + 1])  # row 0 produces it as its 2nd new token
    want = hf.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    got = model.generate(x, 8, eos_token_id=eos, pad_token_id=PAD)
    assert got.tolist() == want.tolist()
    row0 = got[0, 4:].tolist()
    k = row0.index(eos)
    assert k <= 1 and all(t == PAD for t in row0[k + 1:])


def test_generate_with_several_eos_ids_like_hf():
    hf = make_hf("qwen2", eos_token_id=[2, 5])
    model = Llama.from_hf(hf)
    assert model.config.eos_token_id == [2, 5]
    x = _ids(3, 4, seed=3)
    free = model.generate(x, 8)
    eos = [int(free[0, 5]), int(free[1, 6])]  # row 0's 2nd and row 1's 3rd new token end their rows
    want = hf.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    got = model.generate(x, 8, eos_token_id=eos, pad_token_id=PAD)
    assert got.tolist() == want.tolist() and got.tolist() != free.tolist()
    with pytest.raises(ValueError, match=r"eos_token_id must be None, an int >= 0 or a non-empty list of them"):
        model.generate(x, 2, eos_token_id=[2, -1])


def test_cached_decoding_equals_full_recompute_and_sampling():
    model = Llama.from_hf(make_hf("gqa-2-groups-head_dim"))
    x = _ids(2, 3, seed=8)
    seq = x
    with torch.no_grad():
        for _ in range(9):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert model.generate(x, 9).tolist() == seq.tolist()
    g = torch.Generator().manual_seed(0)
    assert model.generate(x, 9, do_sample=True, top_k=1, generator=g).tolist() == seq.tolist()

    def run(seed: int) -> list:
        return model.generate(x, 9, do_sample=True, generator=torch.Generator().manual_seed(seed)).tolist()

    assert run(4) == run(4) != run(5)
    with pytest.raises(ValueError, match="temperature must be a float > 0 to sample, got 0"):
        model.generate(x, 2, do_sample=True, temperature=0)
    model.train()
    assert model.generate(x, 1).shape == (2, 4) and model.training


# ---- packed documents, hooks ---------------------------------------------------------------------------------


def test_packed_documents_equal_each_document_alone_and_hf():
    hf = make_hf("gqa-2-groups-head_dim")
    model = Llama.from_hf(hf)
    a, b = _ids(1, 5, seed=1), _ids(1, 4, seed=2)
    packed = torch.cat([a, b], dim=1)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    with torch.no_grad():
        got = model(packed, position_ids=pos)
        assert_close(got, torch.cat([model(a), model(b)], dim=1))
        # HF reads the restart as a document boundary when it keeps no cache
        assert_close(got, hf(packed, position_ids=pos, use_cache=False).logits)


@pytest.mark.parametrize("layout", ["varlen", "padded"])
@pytest.mark.parametrize("case", ["mqa-untied", "gqa-2-groups-head_dim"])
def test_packed_documents_with_padding_loss_and_gradients_equal_the_padded_path(case, layout, monkeypatch):
    from sublayer.functional import packing
    from sublayer.runtime import padding_free

    monkeypatch.setattr(packing, "ATTENTION", layout)
    model = Llama.from_hf(make_hf(case))
    x = _ids(3, 11, seed=3)
    mask = torch.ones_like(x)
    mask[0, 7:] = 0
    mask[2, 4:] = 0
    # row 0: documents of 3 and 4 tokens; row 1: 5 + 6; row 2: one document of 4
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 0, 0, 0], [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5], list(range(11))])
    labels = x.masked_fill((mask == 0) | (pos == 0), -100)

    def run():
        model.zero_grad(set_to_none=True)
        loss = model.loss(x, attention_mask=mask, labels=labels, position_ids=pos)
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}

    got, got_grads = run()
    with padding_free.disabled():
        want, want_grads = run()
    assert_close(got, want, rtol=1e-5, atol=0)
    for k, g in want_grads.items():
        assert_close(got_grads[k], g, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_record_attention_sees_every_layer():
    model = Llama.from_hf(make_hf("gqa-2-groups-head_dim"))
    x = _ids(2, 5)
    with torch.no_grad():
        plain = model(x)
        with record_attention(model) as maps:
            recorded = model(x)
    assert sorted(maps) == ["blocks.0.self_attn", "blocks.1.self_attn"]
    assert maps["blocks.0.self_attn"][0].shape == (2, 6, 5, 5)
    assert_close(recorded, plain)
    with record_attention(model) as maps:
        model.generate(x, 3)
    assert len(maps["blocks.1.self_attn"]) == 3  # one call per step


# ---- checkpoints ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mqa-untied", "mha-tied-bias-llama3", "qwen2"])
def test_folder_round_trip_through_hf(case, tmp_path):
    hf = make_hf(case)
    hf.save_pretrained(tmp_path / "hf")
    model = Llama.from_pretrained(tmp_path / "hf")
    assert not model.training
    x = _ids()
    with torch.no_grad():
        want = hf(x).logits
        assert_close(model(x), want)
        model.save_pretrained(tmp_path / "ours")
        cls = type(hf)
        back = cls.from_pretrained(tmp_path / "ours").eval()
        assert_close(back(x).logits, want)
        assert_close(model.to_hf()(x).logits, want)
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["model_type"] == CASES[case][0] and saved["architectures"] == [cls.__name__]
    assert LlamaConfig.from_hf_dict(saved) == model.config


def test_sharded_folder_loads(tmp_path):
    hf = make_hf("gqa-2-groups-head_dim")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = Llama.from_pretrained(tmp_path, dtype=torch.float64)
    x = _ids()
    with torch.no_grad():
        assert_close(model(x).float(), hf(x).logits, rtol=1e-5, atol=1e-5)


def test_wrong_checkpoint_is_one_clear_error(tmp_path):
    make_hf("mqa-untied").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_key_value_heads"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"wrong shapes \(4\): model.layers.0.self_attn.k_proj.weight"):
        Llama.from_pretrained(tmp_path)


# ---- config --------------------------------------------------------------------------------------------------


def _hf_dict(case: str = "mqa-untied", **changes) -> dict:
    d = make_hf(case).config.to_dict()
    d.update(changes)
    return d


def test_config_reads_old_style_rope_keys():
    d = _hf_dict("mqa-untied")
    d.pop("rope_parameters", None)
    d.update(rope_theta=321.0, rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}})
    c = LlamaConfig.from_hf_dict(d)
    assert c.rope_theta == 321.0 and c.rope_scaling == LLAMA3
    assert c.kv_heads == 1 and c.attention_head_dim == 6 and c.activation == "swiglu" and c.eps == 1e-5


@pytest.mark.parametrize(
    ("case", "changes", "match"),
    [
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types="),
        ("mqa-untied", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type='yarn'"),
        ("mqa-untied", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
        ("mqa-untied", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ("mqa-untied", {"mlp_bias": True}, "mlp_bias=True"),
        ("mqa-untied", {"num_local_experts": 8}, "num_local_experts=8"),
        ("mqa-untied", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh'"),
        ("mqa-untied", {"model_type": "mistral"}, "model_type must be one of 'llama', 'qwen2'"),
        ("mqa-untied", {"pad_token_id": [0, 3]}, r"pad_token_id must be a single id, got the list \[0, 3\]"),
        ("mqa-untied", {"eos_token_id": []}, r"eos_token_id must be None, an int >= 0 or a non-empty list"),
        ("mqa-untied", {"num_key_value_heads": 2}, r"n_heads \(5\) must be divisible by n_kv_heads \(2\)"),
    ],
)  # fmt: skip
def test_config_refuses_what_it_cannot_represent(case, changes, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf_dict(_hf_dict(case, **changes))


@pytest.mark.parametrize("changes, match", [({"num_attention_heads": 0}, "n_heads must be a positive int, got 0"),
                                            ({"hidden_size": "16"}, "d_model must be a positive int, got '16'"),
                                            ({"num_attention_heads": None}, "n_heads must be a positive int, got None")])
def test_bad_sizes_are_named_before_the_head_size_is_derived(changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LlamaConfig.from_hf_dict(_hf_dict(**changes))


def test_config_missing_size_key_and_folder_error(tmp_path):
    d = _hf_dict()
    del d["hidden_size"]
    with pytest.raises(ValueError, match="config lacks hidden_size"):
        LlamaConfig.from_hf_dict(d)
    make_hf("qwen2").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["use_sliding_window"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json: unsupported qwen2 option use_sliding_window=True"):
        Llama.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"n_kv_heads": 3}, r"n_heads \(6\) must be divisible by n_kv_heads \(3\)|n_heads \(5\)"),
        ({"n_heads": 5, "n_kv_heads": 2}, r"n_heads \(5\) must be divisible by n_kv_heads \(2\)"),
        ({"head_dim": 5}, "head_dim must be even"),
        ({"activation": "silu"}, "activation"),
        ({"model_type": "qwen2", "attention_bias": False}, "attention_bias must be True"),
        ({"rope_scaling": {"rope_type": "dynamic"}}, "rope_type='dynamic'"),
    ],
)
def test_config_validation(changes, match):
    base = LlamaConfig(vocab_size=VOCAB, d_model=30, n_layers=1, n_heads=5, d_ff=22)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(base, **changes)


def test_config_dict_round_trip():
    c = LlamaConfig(vocab_size=VOCAB, d_model=30, n_layers=1, n_heads=6, n_kv_heads=2, head_dim=10, d_ff=22)
    assert LlamaConfig.from_dict(c.to_dict()) == c
    assert LlamaConfig.from_hf_dict(c.to_hf_dict()) == c
