"""Dataclass configs shared by the models: strict ``from_dict`` (unknown keys are an error) and JSON I/O; and the
models' shared initialisation (:func:`init_weights`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ..checkpoints.io import TO_HF_ACTIVATIONS, CheckpointError, hf_activation, read_json
from ..nn import LayerNorm, RMSNorm

__all__ = ["ModelConfig", "init_weights"]

C = TypeVar("C", bound="ModelConfig")


@dataclasses.dataclass
class ModelConfig:
    """Base of the model configs. Subclasses are dataclasses; ``validate()`` checks values."""

    @classmethod
    def from_dict(cls: type[C], d: dict[str, Any]) -> C:
        """Build from a dict; any key that is not a field raises ``ValueError`` listing them (HF v5 once
        accepted ``hidden_sise`` silently)."""
        if not isinstance(d, dict):
            raise TypeError(f"{cls.__name__}.from_dict needs a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys: {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def _from_hf_names(cls: type[C], d: dict[str, Any], names, act_key: str, act_default: str) -> C:
        """``cls`` from a Hugging Face config dict by ``names`` ((our field, HF key) pairs; an absent key gives the
        field's default); ``activation`` from ``d[act_key]`` (default ``act_default``) by :func:`hf_activation`."""
        ref, act = cls(), hf_activation(act_key, d.get(act_key, act_default))
        return cls(**{ours: act if ours == "activation" else d.get(hf, getattr(ref, ours)) for ours, hf in names})

    def _to_hf_names(self, names, family: str) -> dict[str, Any]:
        """The HF keys of ``names`` with this config's values (the activation under its HF name); ValueError for an
        activation without an HF equivalent (naming ``family``)."""
        if self.activation not in TO_HF_ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} has no Hugging Face {family} equivalent")
        return {hf: TO_HF_ACTIVATIONS[self.activation] if ours == "activation" else getattr(self, ours)
                for ours, hf in names}  # fmt: skip

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # overridden by subclasses
        pass

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls: type[C], path: str | Path) -> C:
        """The config in the JSON file ``path`` (as :meth:`save` writes it: every field). Raises FileNotFoundError, or
        CheckpointError naming the file (a missing or unknown key, a bad value)."""
        path = Path(path)
        d = read_json(path, "config file")
        try:
            missing = [f.name for f in dataclasses.fields(cls) if isinstance(d, dict) and f.name not in d]
            if missing:  # a default would load the saved weights into another model (an activation, norm_first)
                raise ValueError(f"missing {cls.__name__} keys: {', '.join(missing)}")
            return cls.from_dict(d)
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"config file {path}: {e}") from None


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """BERT's and GPT-2's init: N(0, std) Linear and Embedding weights, zero biases, norms reset, then zero padding
    rows (``nn.Embedding(padding_idx=...)``; after every weight, so a tied head does not refill them)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (LayerNorm, RMSNorm)):
            m.reset_parameters()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
