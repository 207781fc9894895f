"""Checkpoint folders: round trips with HF both ways, key-map variants (prefixes, buffers, gamma/beta, heads),
``pytorch_model.bin`` (weights_only), sharded safetensors, and strict, file-naming errors."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from sublayer.checkpoints import CheckpointError, read_config, read_state_dict
from sublayer.models import GPT2, Bert

from .conftest import N_LAYERS, VOCAB, make_hf_bert, make_hf_gpt2, read_json

transformers = pytest.importorskip("transformers")


def _ids(b: int = 2, t: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (b, t), generator=torch.Generator().manual_seed(9))


def _write(folder, tensors, config) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def gpt2_parts(gpt2_folder):
    return load_file(str(gpt2_folder / "model.safetensors")), read_json(gpt2_folder / "config.json")


@pytest.fixture
def bert_parts(bert_folder):
    return load_file(str(bert_folder / "model.safetensors")), read_json(bert_folder / "config.json")


# ---- round trips ---------------------------------------------------------------------------------------------


def test_gpt2_ours_save_hf_load_same_logits(gpt2_folder, hf_gpt2, tmp_path):
    GPT2.from_pretrained(gpt2_folder).save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors"]  # no temp files
    back, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    x = _ids()
    with torch.no_grad():
        assert_close(back.eval()(x).logits, hf_gpt2(x).logits)


def test_bert_ours_save_hf_load_same_outputs(bert_folder, hf_bert, tmp_path):
    Bert.from_pretrained(bert_folder).save_pretrained(tmp_path)
    back, info = transformers.BertModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    x = _ids()
    with torch.no_grad():
        a, b = back.eval()(x), hf_bert(x)
    assert_close(a.last_hidden_state, b.last_hidden_state)
    assert_close(a.pooler_output, b.pooler_output)


@pytest.mark.parametrize("cls, folder", [(GPT2, "gpt2_folder"), (Bert, "bert_folder")])
def test_save_load_is_bit_identical(cls, folder, tmp_path, request):
    model = cls.from_pretrained(request.getfixturevalue(folder))
    model.save_pretrained(tmp_path)
    again = cls.from_pretrained(tmp_path)
    assert again.config == model.config
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gpt2_untied_head_round_trip(tmp_path):
    hf = make_hf_gpt2(tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "hf")
    model = GPT2.from_pretrained(tmp_path / "hf").eval()
    assert not model.config.tie_word_embeddings and model.lm_head.weight is not model.wte.weight
    x = _ids()
    with torch.no_grad():
        assert_close(model(x), hf(x).logits)
    model.save_pretrained(tmp_path / "ours")
    assert "lm_head.weight" in load_file(str(tmp_path / "ours" / "model.safetensors"))
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert_close(back(x).logits, hf(x).logits)


def test_load_in_float64(gpt2_folder, hf_gpt2):
    model = GPT2.from_pretrained(gpt2_folder, dtype=torch.float64).eval()
    assert model.wte.weight.dtype == torch.float64
    x = _ids()
    with torch.no_grad():
        # float64 against HF's float32: float32 tolerance
        assert_close(model(x).float(), hf_gpt2(x).logits)


# ---- key-map variants ----------------------------------------------------------------------------------------


def test_gpt2_without_prefix_and_with_old_buffers(gpt2_parts, hf_gpt2, tmp_path):
    tensors, config = gpt2_parts
    tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    for i in range(N_LAYERS):  # what files written by older transformers carry
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 31, 31))
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    _write(tmp_path, tensors, config)
    x = _ids()
    with torch.no_grad():
        assert_close(GPT2.from_pretrained(tmp_path).eval()(x), hf_gpt2(x).logits)


def test_gpt2_c_attn_is_split_into_q_k_v(gpt2_folder, hf_gpt2):
    model = GPT2.from_pretrained(gpt2_folder)
    c_attn = hf_gpt2.transformer.h[1].attn.c_attn
    attn = model.blocks[1].self_attn
    d = model.config.d_model
    for j, lin in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
        assert torch.equal(lin.weight, c_attn.weight[:, j * d : (j + 1) * d].t())
        assert torch.equal(lin.bias, c_attn.bias[j * d : (j + 1) * d])


def test_bert_from_pretraining_checkpoint_with_prefix_and_heads(tmp_path, hf_bert):
    # BertForPreTraining: keys under `bert.` plus the `cls.*` heads (ignored, documented).
    hf = make_hf_bert("BertForPreTraining")
    hf.save_pretrained(tmp_path)
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    assert any(k.startswith("bert.") for k in keys) and any(k.startswith("cls.") for k in keys)
    model = Bert.from_pretrained(tmp_path).eval()
    ids = _ids()
    with torch.no_grad():
        assert_close(model(ids), hf.bert(ids).last_hidden_state)


def test_bert_masked_lm_checkpoint_has_no_pooler(tmp_path):
    hf = make_hf_bert("BertForMaskedLM")
    hf.save_pretrained(tmp_path)
    model = Bert.from_pretrained(tmp_path).eval()
    assert model.pooler is None
    ids = _ids()
    with torch.no_grad():
        assert_close(model(ids), hf.bert(ids).last_hidden_state)


def test_bert_old_gamma_beta_names_and_position_ids_buffer(bert_parts, hf_bert, tmp_path):
    tensors, config = bert_parts
    old = {}
    for k, v in tensors.items():
        if ".LayerNorm." in k:
            k = k.replace(".weight", ".gamma").replace(".bias", ".beta")
        old["bert." + k] = v
    old["bert.embeddings.position_ids"] = torch.arange(31)[None]
    _write(tmp_path, old, config)
    ids = _ids()
    with torch.no_grad():
        assert_close(Bert.from_pretrained(tmp_path).eval()(ids), hf_bert(ids).last_hidden_state)


def test_pytorch_model_bin_is_read_with_weights_only(gpt2_parts, hf_gpt2, tmp_path):
    tensors, config = gpt2_parts
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(config))
    x = _ids()
    with torch.no_grad():
        assert_close(GPT2.from_pretrained(tmp_path).eval()(x), hf_gpt2(x).logits)


class _Payload:
    """Anything that is not a tensor: weights_only refuses to rebuild it."""


def test_pytorch_model_bin_with_objects_is_refused(gpt2_parts, tmp_path):
    tensors, config = gpt2_parts
    torch.save({"state": tensors, "extra": _Payload()}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"cannot read .*pytorch_model\.bin with torch\.load\(weights_only=True\)"):
        GPT2.from_pretrained(tmp_path)


def test_sharded_safetensors(bert_parts, hf_bert, tmp_path):
    tensors, config = bert_parts
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(tmp_path / name))
    index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = _ids()
    with torch.no_grad():
        assert_close(Bert.from_pretrained(tmp_path).eval()(ids), hf_bert(ids).last_hidden_state)


def test_a_tensor_in_two_shards_is_a_checkpoint_error(bert_parts, tmp_path):
    tensors, config = bert_parts
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    first, second = shards
    save_file({k: tensors[k] for k in shards[first]}, str(tmp_path / first))
    stale = {keys[0]: torch.zeros_like(tensors[keys[0]])}  # a stale copy of a tensor of the first shard
    save_file({k: tensors[k] for k in shards[second]} | stale, str(tmp_path / second))
    index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"tensor {re.escape(keys[0])} is in two shards of .*index.json: "
                       "model-00001-of-00002.safetensors and model-00002-of-00002.safetensors"):  # fmt: skip
        Bert.from_pretrained(tmp_path)


def test_a_sharded_index_naming_no_file_is_a_checkpoint_error(bert_parts, tmp_path):
    tensors, config = bert_parts
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: 5 for k in tensors}}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not a valid safetensors index.*file names"):
        Bert.from_pretrained(tmp_path)


# ---- strict loading ------------------------------------------------------------------------------------------


def test_one_error_lists_missing_unexpected_and_wrong_shape(gpt2_parts, tmp_path):
    tensors, config = gpt2_parts
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    tensors["transformer.h.0.attn.rotary"] = torch.zeros(3)
    tensors["transformer.ln_f.weight"] = torch.ones(16)
    _write(tmp_path, tensors, config)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(tmp_path)
    msg = str(e.value)
    assert "model.safetensors does not fit the model" in msg
    assert "missing keys (1): h.1.mlp.c_fc.bias" in msg
    assert "unexpected keys (1): transformer.h.0.attn.rotary" in msg
    assert r"wrong shapes (1): transformer.ln_f.weight: expected (15,), got (16,)" in msg


def test_fused_c_attn_with_wrong_shape_is_reported(gpt2_parts, tmp_path):
    tensors, config = gpt2_parts
    tensors["transformer.h.0.attn.c_attn.weight"] = torch.zeros(15, 44)
    _write(tmp_path, tensors, config)
    with pytest.raises(CheckpointError, match=r"transformer\.h\.0\.attn\.c_attn\.weight: expected \(15, 45\), got \(15, 44\)"):
        GPT2.from_pretrained(tmp_path)


def test_key_given_twice_is_an_error(gpt2_parts, tmp_path):
    tensors, config = gpt2_parts
    tensors["wte.weight"] = tensors["transformer.wte.weight"].clone()
    _write(tmp_path, tensors, config)
    with pytest.raises(CheckpointError, match=r"keys given twice \(1\): .*wte\.weight"):
        GPT2.from_pretrained(tmp_path)


def test_bert_task_head_other_than_cls_is_unexpected(bert_parts, tmp_path):
    tensors, config = bert_parts
    tensors["classifier.weight"] = torch.zeros(2, 15)
    _write(tmp_path, tensors, config)
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\): classifier\.weight"):
        Bert.from_pretrained(tmp_path)


def test_partial_pooler_is_missing(bert_parts, tmp_path):
    tensors, config = bert_parts
    del tensors["pooler.dense.bias"]
    _write(tmp_path, tensors, config)
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): pooler\.dense\.bias"):
        Bert.from_pretrained(tmp_path)


def test_missing_folder_and_files(tmp_path, gpt2_parts):
    with pytest.raises(FileNotFoundError, match=f"checkpoint folder not found: {tmp_path / 'nope'}"):
        GPT2.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=f"config file not found: {tmp_path / 'config.json'}"):
        GPT2.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(gpt2_parts[1]))
    with pytest.raises(FileNotFoundError, match="no weights file in .*: expected model.safetensors"):
        GPT2.from_pretrained(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="checkpoint path is not a folder"):
        read_state_dict(tmp_path / "file")


@pytest.mark.parametrize("size", [0, 7, -100])
def test_truncated_safetensors_names_the_file(gpt2_folder, tmp_path, size):
    data = (gpt2_folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:size])
    (tmp_path / "config.json").write_text((gpt2_folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"cannot read safetensors file .*model\.safetensors"):
        GPT2.from_pretrained(tmp_path)


def test_truncated_bin_names_the_file(gpt2_parts, tmp_path):
    torch.save(gpt2_parts[0], tmp_path / "full.bin")
    (tmp_path / "pytorch_model.bin").write_bytes((tmp_path / "full.bin").read_bytes()[:500])
    (tmp_path / "config.json").write_text(json.dumps(gpt2_parts[1]))
    with pytest.raises(CheckpointError, match=r"cannot read .*pytorch_model\.bin"):
        GPT2.from_pretrained(tmp_path)


def test_bad_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{'n_embd': 12,")
    with pytest.raises(CheckpointError, match=r"config file .*config\.json is not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config file .*config\.json must hold a JSON object, got list"):
        GPT2.from_pretrained(tmp_path)


def test_wrong_model_type_names_the_config(bert_folder, gpt2_folder):
    with pytest.raises(CheckpointError, match=r"config file .*config\.json: model_type must be 'gpt2' for GPT-2, got 'bert'"):
        GPT2.from_pretrained(bert_folder)
    with pytest.raises(CheckpointError, match=r"config file .*config\.json: model_type must be 'bert' for BERT, got 'gpt2'"):
        Bert.from_pretrained(gpt2_folder)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_atomic_write_gives_the_mode_open_would(tmp_path, umask):
    """mkstemp makes 0600 files: checkpoints and plots were unreadable to the other users of a shared folder."""
    import stat

    from sublayer.checkpoints.io import atomic_write

    def mode(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "a.json", lambda p: open(p, "w").write("{}"))
        with open(tmp_path / "b.json", "w") as f:
            f.write("{}")
        assert mode(tmp_path / "a.json") == mode(tmp_path / "b.json") == 0o666 & ~umask
        os.chmod(tmp_path / "a.json", 0o640)  # an existing file keeps its mode, as open() keeps it
        atomic_write(tmp_path / "a.json", lambda p: open(p, "w").write("[]"))
        assert mode(tmp_path / "a.json") == 0o640 and (tmp_path / "a.json").read_text() == "[]"
    finally:
        os.umask(old)


@pytest.mark.parametrize("folder", [None, 3, b"gpt2", ["gpt2"], True])
def test_from_pretrained_and_save_pretrained_of_a_non_path_name_the_argument_and_the_rule(folder):
    from sublayer.models import Llama, Transformer, TransformerConfig
    from sublayer.models.quantized import load_quantized
    from sublayer.text import Encoder, TextGenerator

    rule = re.escape(f"folder must be a folder's path (a str or an os.PathLike such as pathlib.Path), got {folder!r} "
                     f"({type(folder).__name__})")  # fmt: skip
    for load in (GPT2.from_pretrained, Llama.from_pretrained, Bert.from_pretrained, Transformer.from_pretrained,
                 Encoder.from_pretrained, TextGenerator.from_pretrained, load_quantized, read_config):  # fmt: skip
        with pytest.raises(TypeError, match=rule):
            load(folder)
    model = Transformer.from_config(TransformerConfig(src_vocab_size=7, tgt_vocab_size=7, d_model=6, n_heads=3, d_ff=5,
                                                      n_layers=1))
    with pytest.raises(TypeError, match=rule):
        model.save_pretrained(folder)
