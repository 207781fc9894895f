"""The output objects of the models' ``forward(..., return_dict=True)`` (and of a causal LM given ``labels=``), named
and read as Hugging Face's: ``out.logits``, ``out.loss``, ``out.last_hidden_state``, ``out.pooler_output``;
``out["logits"]`` and ``out[0]`` (the fields that are set, in order, as HF's ``ModelOutput``), ``out.to_tuple()``.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

__all__ = ["ModelOutput", "CausalLMOutput", "BaseModelOutput"]


@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """Fields by attribute, by name or by position among the fields that are not None (HF's indexing)."""

    def to_tuple(self) -> tuple:
        """The fields that are set, in declaration order."""
        return tuple(v for v in (getattr(self, f.name) for f in dataclasses.fields(self)) if v is not None)

    def keys(self) -> list[str]:
        """The names of the fields that are set."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str | int | slice):
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(f"{type(self).__name__} has no field {key!r} set; set fields: {self.keys()}")
            return getattr(self, key)
        return self.to_tuple()[key]


@dataclasses.dataclass(frozen=True)
class CausalLMOutput(ModelOutput):
    """A causal LM's output (HF ``CausalLMOutput``).

    Attributes:
        loss: 0-dim mean next-token cross-entropy, when ``labels`` were given, else None.
        logits: (B, T, vocab_size), or None where the fused loss ran without building them.
    """

    loss: Tensor | None = None
    logits: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class BaseModelOutput(ModelOutput):
    """An encoder's output (HF ``BaseModelOutputWithPooling``).

    Attributes:
        last_hidden_state: (B, T, d_model).
        pooler_output: (B, d_model) ``tanh(dense(h[:, 0]))``, or None for a model without pooler.
    """

    last_hidden_state: Tensor | None = None
    pooler_output: Tensor | None = None
