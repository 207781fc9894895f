"""Tiny random Hugging Face GPT-2 and BERT models saved to temporary folders (nothing is downloaded), and tiny
``tokenizer.json`` files built with the ``tokenizers`` library.

Sizes are small primes where they can be: d_model 15 (3 heads of 5), 2 layers, FFN 23 (BERT), vocab 53.
The HF models are session-scoped and in eval mode; tests that change weights work on copies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
transformers.utils.logging.disable_progress_bar()  # quiet save_pretrained in test output

VOCAB = 53
D_MODEL, N_HEADS, N_LAYERS, BERT_FF, MAX_POS = 15, 3, 2, 23, 31
BOS, EOS, PAD = 1, 2, 0
WORDS = (
    "the cat sat on a mat and dog ran to park with ball red blue green big small quick brown fox jumps "
    "over lazy hello world sun moon star tree sky sea"
).split()


def hf_gpt2_config(**overrides) -> transformers.GPT2Config:
    kw = dict(
        vocab_size=VOCAB, n_positions=MAX_POS, n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS,
        bos_token_id=BOS, eos_token_id=EOS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    kw.update(overrides)
    return transformers.GPT2Config(**kw)


def hf_bert_config(**overrides) -> transformers.BertConfig:
    kw = dict(
        vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS,
        intermediate_size=BERT_FF, max_position_embeddings=MAX_POS, type_vocab_size=2, pad_token_id=PAD,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    kw.update(overrides)
    return transformers.BertConfig(**kw)


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    # HF initialises biases to 0 and LayerNorm to (1, 0): give every parameter random values so that a
    # key mapped to the wrong place cannot go unnoticed.
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_weight = p.dim() == 1 and name.endswith("weight")  # LayerNorm gains stay near 1
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if norm_weight else 0.0))
    return model.eval()


def make_hf_gpt2(**overrides):
    torch.manual_seed(0)
    return _randomize(transformers.GPT2LMHeadModel(hf_gpt2_config(**overrides)))


def make_hf_bert(cls_name: str = "BertModel", **overrides):
    torch.manual_seed(0)
    return _randomize(getattr(transformers, cls_name)(hf_bert_config(**overrides)))


def word_tokenizer(*, bert: bool = False):
    """A WordLevel tokenizer over :data:`WORDS` (ids below :data:`VOCAB`); BERT style adds [CLS]/[SEP]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bert:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
    return tok


@pytest.fixture(params=["kernels", "no-kernels"])
def kernels_mode(request):
    """Each test twice: with the fused C++ kernels and on the pure-PyTorch reference path."""
    from sublayer import kernels

    was = kernels.switched_on()
    kernels.set_enabled(request.param == "kernels")
    yield request.param
    kernels.set_enabled(was)


@pytest.fixture(scope="session")
def hf_gpt2():
    return make_hf_gpt2()


@pytest.fixture(scope="session")
def gpt2_folder(hf_gpt2, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf_gpt2")
    hf_gpt2.save_pretrained(folder)
    word_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="session")
def hf_bert():
    return make_hf_bert()


@pytest.fixture(scope="session")
def bert_folder(hf_bert, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf_bert")
    hf_bert.save_pretrained(folder)
    word_tokenizer(bert=True).save(str(folder / "tokenizer.json"))
    return folder


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
