"""Starting models made in code, for training from scratch offline: ``--model builtin:gpt2-tiny`` /
``builtin:llama-tiny``.

Each is a small randomly initialised model (2 layers, d_model 64, 256 positions) with a byte-level tokenizer: ids
0-255 are the bytes of the UTF-8 text (GPT-2's byte-to-character table, so any text encodes and decodes exactly)
and id 256 is ``<|endoftext|>``, the end-of-document token. The tokenizer is an ordinary ``tokenizer.json``:
``sublayer generate`` and HF's ``AutoTokenizer`` read it from the trained folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoints.io import atomic_write

EOS_TOKEN = "<|endoftext|>"
STARTERS = ("gpt2-tiny", "llama-tiny")
_SIZES = {"vocab_size": 257, "max_positions": 256, "d_model": 64, "n_layers": 2, "n_heads": 4}


def _byte_chars() -> list[str]:
    """GPT-2's printable character of each byte 0-255 (byte-level BPE's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]  # the others, in order, become chr(256), chr(257), ...
    return [chr(b) if b in keep else chr(256 + moved.index(b)) for b in range(256)]


def byte_tokenizer():
    """A ``tokenizers.Tokenizer``: one id per byte (0-255) and ``<|endoftext|>`` = 256."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    vocab[EOS_TOKEN] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    return tok


def starter_model(name: str, *, seed: int = 0):
    """``(model, tokenizer)``: a fresh :data:`STARTERS` model (weights drawn from ``seed``) and its
    :func:`byte_tokenizer`. Raises ValueError for another name."""
    from ..models import GPT2, GPT2Config, Llama, LlamaConfig

    if name not in STARTERS:
        raise ValueError(f"model 'builtin:{name}' is not a built-in model: use one of "
                         f"{', '.join('builtin:' + s for s in STARTERS)} or a Hugging Face folder")  # fmt: skip
    torch.manual_seed(seed)
    ids = {"bos_token_id": 256, "eos_token_id": 256}
    if name == "gpt2-tiny":
        model = GPT2(GPT2Config(**_SIZES, **ids, dropout=0.0, embd_dropout=0.0, attn_dropout=0.0))
    else:
        model = Llama(LlamaConfig(**_SIZES, **ids, n_kv_heads=2, d_ff=172, tie_word_embeddings=True))
    return model, byte_tokenizer()


def save_tokenizer(tokenizer, folder: Path, max_length: int) -> None:
    """``tokenizer.json`` and a ``tokenizer_config.json`` that HF's ``AutoTokenizer`` reads (eos = bos =
    ``<|endoftext|>``)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN,
              "model_max_length": max_length}  # fmt: skip
    atomic_write(folder / "tokenizer.json", lambda p: tokenizer.save(str(p)))
    atomic_write(folder / "tokenizer_config.json", lambda p: Path(p).write_text(json.dumps(config, indent=1) + "\n"))
