"""Decoding defaults of a checkpoint: Hugging Face's ``generation_config.json``, read, checked and written.

HF's rule, followed by :meth:`sublayer.models.GPT2.generate`: an argument passed to ``generate`` wins; else the
model's :class:`GenerationConfig` — a folder's ``generation_config.json`` when it has one, else the special ids
of its ``config.json`` (``bos/eos/pad_token_id``, HF's ``GenerationConfig.from_model_config``); what that leaves
unset takes HF's global defaults (:data:`DEFAULTS`: greedy, temperature 1, top-k 50, top-p 1; with no length
set anywhere, 20 new tokens, fewer where the model's positions end). ``generate``'s arguments default to :data:`FROM_CONFIG`, which means "the model's value"; ``None``
passed explicitly keeps its own meaning (``eos_token_id=None``: no end token, ``top_k=None``: no top-k filter).

Keys of the file that change decoding in ways not implemented here (beam search, repetition penalties, forced or
suppressed tokens...) are accepted only with HF's neutral values; any other key (``transformers_version``,
``_from_model_config``, cache settings...) is ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from .io import CheckpointError, atomic_write, resolve_folder

__all__ = [
    "FILE_NAME",
    "FROM_CONFIG",
    "DEFAULTS",
    "DEFAULT_NEW_TOKENS",
    "GenerationConfig",
    "of_hf_model",
    "read_generation_config",
    "write_generation_config",
]

FILE_NAME = "generation_config.json"


class _FromConfig:
    """The type of :data:`FROM_CONFIG` (compared by identity)."""

    def __repr__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG: Any = _FromConfig()
"""Default of ``generate``'s decoding arguments: take the value from the model's ``generation_config``."""

# HF's defaults for the fields read here (max_length: unset means 20 new tokens, see GenerationConfig.resolve).
DEFAULT_NEW_TOKENS = 20
DEFAULTS: dict[str, Any] = {
    "max_length": None,
    "max_new_tokens": None,
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

# Keys that change the decoded tokens in ways not implemented here: only HF's neutral value (or None) is accepted.
_NEUTRAL: dict[str, Any] = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "penalty_alpha": None,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_length": 0,
    "min_new_tokens": None,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "diversity_penalty": 0.0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "guidance_scale": None,
    "renormalize_logits": False,
}


def _int(name: str, value: object, low: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise ValueError(f"{name} must be None or an int >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """A model's decoding defaults (the fields of HF's ``generation_config.json`` that ``generate`` reads).

    Every field is optional: None means unset, and :meth:`get` then gives HF's global default (:data:`DEFAULTS`).

    Args:
        max_length: prompt + new tokens, used when neither the call nor ``max_new_tokens`` sets a length.
        max_new_tokens: new tokens.
        do_sample: sample (True) or greedy (False).
        temperature, top_k, top_p: sampling filters (``top_k=0``: no top-k filter, as HF).
        bos_token_id, eos_token_id, pad_token_id: special ids (each a single int).

    Raises:
        ValueError: a value of the wrong type or range, naming the field.
    """

    max_length: int | None = None
    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        _int("max_length", self.max_length, 1)
        _int("max_new_tokens", self.max_new_tokens, 0)
        _int("top_k", self.top_k, 0)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if isinstance(value, list) and name != "eos_token_id":  # only eos lists several (Llama 3, Qwen instruct)
                raise ValueError(f"{name} must be a single id, got the list {value!r}")
            if isinstance(value, list) and not value:
                raise ValueError(f"{name} must be an id or a non-empty list of ids, got {value!r}")
            for v in value if isinstance(value, list) else [value]:
                _int(name, v, 0)
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be None or a bool, got {self.do_sample!r}")
        t, p = self.temperature, self.top_p
        bad_t = isinstance(t, bool) or not isinstance(t, (int, float)) or not (t > 0 or t == 0 and not self.do_sample)
        if t is not None and bad_t:  # 0 only where it is not read: greedy (HF loads it so, with a warning)
            raise ValueError(f"temperature must be None or a float > 0 (0 without do_sample), got {t!r}")
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must be None or in (0, 1], got {p!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationConfig:
        """Build from an HF ``generation_config.json`` dict (see the module doc for the keys read and refused).

        Raises:
            ValueError: a decoding option that is not implemented (a non-neutral ``num_beams``,
                ``repetition_penalty``...), or a bad value, naming the key.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a generation config must be a JSON object, got {type(d).__name__}")
        for key, neutral in _NEUTRAL.items():
            if d.get(key) is not None and d[key] != neutral:
                raise ValueError(f"unsupported generation option {key}={d[key]!r} (only {neutral!r} is implemented)")
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_model_config(cls, config: object) -> GenerationConfig:
        """The special ids of a model config (its ``bos/eos/pad_token_id`` attributes), as HF's
        ``GenerationConfig.from_model_config``."""
        return cls(**{k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (what ``generation_config.json`` holds)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def get(self, name: str) -> Any:
        """The field's value, or HF's global default (:data:`DEFAULTS`) when unset."""
        value = getattr(self, name)
        return DEFAULTS[name] if value is None else value

    def resolve(self, prompt_length: int, max_positions: int | None, **call: Any) -> dict[str, Any]:
        """``generate``'s arguments with each :data:`FROM_CONFIG` replaced by this config's value (or HF's default).

        Args:
            prompt_length: T of the prompt. Without ``max_new_tokens`` from the call or this config, the new
                tokens are ``max_length - T``, or without ``max_length`` ``min(20, max_positions - T)`` (HF's rule).
            max_positions: the model's positions (None: no limit, rotary positions).
            call: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``,
                ``pad_token_id`` as passed (``FROM_CONFIG`` or a value).

        Returns:
            The same keys, resolved; a ``top_k`` of 0 (from the call or the config) becomes None: no filter, as HF.

        Raises:
            ValueError: no length anywhere leaves room for a new token (``max_length <= T``).
        """
        out = {k: self.get(k) if v is FROM_CONFIG else v for k, v in call.items()}
        if out.get("top_k") == 0 and not isinstance(out["top_k"], bool):
            out["top_k"] = None
        if call.get("max_new_tokens", 0) is FROM_CONFIG and self.max_new_tokens is None:
            max_length = self.max_length
            if max_length is None:
                max_length = prompt_length + DEFAULT_NEW_TOKENS
                max_length = max_length if max_positions is None else min(max_length, max_positions)
            elif max_length <= prompt_length:
                raise ValueError(
                    f"max_new_tokens is not given and generation_config.max_length={max_length} leaves no room "
                    f"after the prompt's {prompt_length} tokens: pass max_new_tokens"
                )
            out["max_new_tokens"] = max_length - prompt_length
        return out

    def check_vocab(self, vocab_size: int, where: str = "generation_config") -> None:
        """Every special id set must lie in ``[0, vocab_size)``.

        Raises:
            ValueError: naming ``where.field``, the id and the vocabulary size.
        """
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            for value in getattr(self, name) if isinstance(getattr(self, name), list) else [getattr(self, name)]:
                if value is not None and value >= vocab_size:
                    raise ValueError(f"{where}.{name} must be < vocab_size={vocab_size}, got {value}")


def of_hf_model(model: object) -> GenerationConfig | None:
    """A live Hugging Face model's ``generation_config`` (None when it has none).

    Raises:
        CheckpointError: an unsupported or bad value, naming the model class.
    """
    hf = getattr(model, "generation_config", None)
    if hf is None or not callable(getattr(hf, "to_dict", None)):
        return None
    try:
        return GenerationConfig.from_dict(hf.to_dict())
    except ValueError as e:
        raise CheckpointError(f"{type(model).__name__}.generation_config: {e}") from None


def read_generation_config(folder: str | os.PathLike, vocab_size: int | None = None) -> GenerationConfig | None:
    """``FOLDER/generation_config.json`` as a :class:`GenerationConfig`, or None when the folder has none.

    Args:
        vocab_size: when given, every special id must lie below it.

    Raises:
        FileNotFoundError: no folder. CheckpointError: not JSON, an unsupported or bad value, an id outside the
        vocabulary (naming the file).
    """
    path = resolve_folder(folder) / FILE_NAME
    if not path.is_file():
        return None
    try:
        config = GenerationConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))
        if vocab_size is not None:
            config.check_vocab(vocab_size)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"generation config {path}: {e}") from None
    return config


def write_generation_config(folder: str | os.PathLike, config: GenerationConfig) -> Path:
    """Write ``FOLDER/generation_config.json`` (the fields that are set), atomically; returns its path."""
    path = Path(folder) / FILE_NAME
    text = json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))
    return path
