"""Llama key map: Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` files <-> :class:`sublayer.models.Llama`.

Hugging Face names (canonical names here are those of the base ``LlamaModel``, without the ``model.`` prefix that
``*ForCausalLM`` files carry; the prefix is optional on load and written on save):

==============================================  ==============================================  ======================
HF key                                          ours                                            layout
==============================================  ==============================================  ======================
``embed_tokens.weight``                         ``embed_tokens.weight``                         same
``layers.{i}.input_layernorm.weight``           ``blocks.{i}.attn_residual.norm.weight``        same
``layers.{i}.self_attn.{q,k,v}_proj.*``         ``blocks.{i}.self_attn.{q,k,v}_proj.*``         same (biases: Qwen2,
                                                                                                ``attention_bias``)
``layers.{i}.self_attn.o_proj.*``               ``blocks.{i}.self_attn.out_proj.*``             same
``layers.{i}.post_attention_layernorm.weight``  ``blocks.{i}.ffn_residual.norm.weight``         same
``layers.{i}.mlp.gate_proj.weight``,            ``blocks.{i}.ffn.fc1.weight``                   packed ``[gate; up]``
``layers.{i}.mlp.up_proj.weight``                                                               on load, split on save
``layers.{i}.mlp.down_proj.weight``             ``blocks.{i}.ffn.fc2.weight``                   same
``norm.weight``                                 ``norm.weight``                                 same
``lm_head.weight``                              ``lm_head.weight``                              tied: ignored on load,
                                                                                                not written on save
==============================================  ==============================================  ======================

Ignored on load: ``layers.{i}.self_attn.rotary_emb.inv_freq`` (a buffer some older files carry: the frequencies
are derived from the config) and, for tied embeddings, ``lm_head.weight``.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

__all__ = ["PREFIX", "canonical", "from_hf", "to_hf"]

PREFIX = "model."
_IGNORED = re.compile(r"(layers\.\d+\.self_attn\.rotary_emb|rotary_emb)\.inv_freq")


def canonical(key: str, *, tied: bool = False) -> str | None:
    """A file key -> its ``LlamaModel`` name (prefix dropped), or None when it is ignored on purpose."""
    if key == "lm_head.weight":
        return None if tied else key
    k = key.removeprefix(PREFIX)
    return None if _IGNORED.fullmatch(k) else k


def _renames(sd_keys, n_layers: int) -> list[tuple[str, str]]:
    """(HF name, our name) for the keys that only need a rename; biases only where present."""
    pairs = [("embed_tokens.weight", "embed_tokens.weight"), ("norm.weight", "norm.weight")]
    for i in range(n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        pairs += [
            (f"{h}input_layernorm.weight", f"{b}attn_residual.norm.weight"),
            (f"{h}post_attention_layernorm.weight", f"{b}ffn_residual.norm.weight"),
            (f"{h}mlp.down_proj.weight", f"{b}ffn.fc2.weight"),
        ]
        for ours, hf in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o")):
            for p in ("weight", "bias"):
                pairs.append((f"{h}self_attn.{hf}_proj.{p}", f"{b}self_attn.{ours}_proj.{p}"))
    return [(hf, ours) for hf, ours in pairs if (hf in sd_keys or ours in sd_keys)]


def from_hf(sd: dict[str, Tensor], n_layers: int, *, tied: bool = False) -> dict[str, Tensor]:
    """Canonical HF tensors (see :func:`canonical`) -> our ``Llama`` state dict."""
    out = {ours: sd[hf] for hf, ours in _renames(sd, n_layers)}
    for i in range(n_layers):
        mlp = f"layers.{i}.mlp."
        out[f"blocks.{i}.ffn.fc1.weight"] = torch.cat([sd[f"{mlp}gate_proj.weight"], sd[f"{mlp}up_proj.weight"]])
    out["lm_head.weight"] = sd["embed_tokens.weight"] if tied else sd["lm_head.weight"]
    return out


def to_hf(sd: dict[str, Tensor], n_layers: int, *, tied: bool = False) -> dict[str, Tensor]:
    """Our ``Llama`` state dict -> canonical HF tensors (no ``model.`` prefix; ``lm_head.weight`` only when untied).
    Works on meta tensors (used to get the expected shapes without copying)."""
    out = {hf: sd[ours] for hf, ours in _renames(sd, n_layers)}
    for i in range(n_layers):
        gate, up = sd[f"blocks.{i}.ffn.fc1.weight"].chunk(2)
        out[f"layers.{i}.mlp.gate_proj.weight"], out[f"layers.{i}.mlp.up_proj.weight"] = gate, up
    if not tied:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out
