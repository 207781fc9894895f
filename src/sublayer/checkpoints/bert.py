"""BERT key map: Hugging Face ``BertModel`` files (and the ``bert.`` part of task-head files) <->
:class:`sublayer.models.Bert`.

=====================================================  ===========================================
HF key (canonical: ``BertModel``'s, no prefix)         ours
=====================================================  ===========================================
``embeddings.{word,position,token_type}_embeddings``   ``embeddings.{word,position,token_type}_embeddings``
``embeddings.LayerNorm``                               ``embeddings.norm``
``encoder.layer.{i}.attention.self.query``             ``encoder.layers.{i}.self_attn.q_proj``
``encoder.layer.{i}.attention.self.key``               ``encoder.layers.{i}.self_attn.k_proj``
``encoder.layer.{i}.attention.self.value``             ``encoder.layers.{i}.self_attn.v_proj``
``encoder.layer.{i}.attention.output.dense``           ``encoder.layers.{i}.self_attn.out_proj``
``encoder.layer.{i}.attention.output.LayerNorm``       ``encoder.layers.{i}.attn_residual.norm``
``encoder.layer.{i}.intermediate.dense``               ``encoder.layers.{i}.ffn.fc1``
``encoder.layer.{i}.output.dense``                     ``encoder.layers.{i}.ffn.fc2``
``encoder.layer.{i}.output.LayerNorm``                 ``encoder.layers.{i}.ffn_residual.norm``
``pooler.dense``                                       ``pooler.dense``
=====================================================  ===========================================

All weights are ``nn.Linear`` layout on both sides (no transposes). On load:

- a ``bert.`` prefix (``BertForPreTraining``, ``BertForMaskedLM``, ... files) is dropped;
- very old files name LayerNorm parameters ``gamma``/``beta``: read as ``weight``/``bias``;
- ignored on purpose: the ``embeddings.position_ids`` buffer and the pre-training heads ``cls.*`` (masked-LM and
  next-sentence heads, which the encoder and :meth:`Bert.embed` do not use). Any other key (``classifier.*``,
  ``qa_outputs.*``, ...) is unexpected, hence an error.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["PREFIX", "canonical", "from_hf", "to_hf"]

PREFIX = "bert."


def canonical(key: str) -> str | None:
    """A file key -> its ``BertModel`` name, or None when it is ignored on purpose."""
    if key.startswith("cls."):
        return None
    k = key.removeprefix(PREFIX)
    if k == "embeddings.position_ids":
        return None
    for old, new in ((".gamma", ".weight"), (".beta", ".bias")):  # very old files' LayerNorm names
        if ".LayerNorm." in k and k.endswith(old):
            k = k.removesuffix(old) + new
    return k


# (HF module, ours) in a layer, the table above
_LAYER = (("attention.self.query", "self_attn.q_proj"), ("attention.self.key", "self_attn.k_proj"),
          ("attention.self.value", "self_attn.v_proj"), ("attention.output.dense", "self_attn.out_proj"),
          ("attention.output.LayerNorm", "attn_residual.norm"), ("intermediate.dense", "ffn.fc1"),
          ("output.dense", "ffn.fc2"), ("output.LayerNorm", "ffn_residual.norm"))  # fmt: skip


def _pairs(n_layers: int, pooler: bool) -> list[tuple[str, str]]:
    """(HF name, our name) for every parameter."""
    pairs: list[tuple[str, str]] = [
        (f"embeddings.{e}_embeddings.weight", f"embeddings.{e}_embeddings.weight")
        for e in ("word", "position", "token_type")
    ]
    pairs += [(f"embeddings.LayerNorm.{p}", f"embeddings.norm.{p}") for p in ("weight", "bias")]
    for i in range(n_layers):
        pairs += [(f"encoder.layer.{i}.{hf}.{p}", f"encoder.layers.{i}.{ours}.{p}")
                  for p in ("weight", "bias") for hf, ours in _LAYER]  # fmt: skip
    if pooler:
        pairs += [(f"pooler.dense.{p}", f"pooler.dense.{p}") for p in ("weight", "bias")]
    return pairs


def from_hf(sd: dict[str, Tensor], n_layers: int, *, pooler: bool = True) -> dict[str, Tensor]:
    """Canonical HF tensors -> our ``Bert`` state dict."""
    return {ours: sd[hf] for hf, ours in _pairs(n_layers, pooler)}


def to_hf(sd: dict[str, Tensor], n_layers: int, *, pooler: bool = True) -> dict[str, Tensor]:
    """Our ``Bert`` state dict -> canonical HF (``BertModel``) tensors."""
    return {hf: sd[ours] for hf, ours in _pairs(n_layers, pooler)}
