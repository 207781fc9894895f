"""GPT-2 key map: Hugging Face ``GPT2Model``/``GPT2LMHeadModel`` files <-> :class:`sublayer.models.GPT2`.

Hugging Face names (the canonical names here are those of ``GPT2Model``, without the ``transformer.`` prefix that
``GPT2LMHeadModel`` files carry; the prefix is optional on load and written on save):

=================================  ==============================================  =================================
HF key                             ours                                            layout
=================================  ==============================================  =================================
``wte.weight``, ``wpe.weight``     ``wte.weight``, ``wpe.weight``                  same
``h.{i}.ln_1.*``                   ``blocks.{i}.attn_residual.norm.*``             same
``h.{i}.attn.c_attn.weight``       ``blocks.{i}.self_attn.{q,k,v}_proj.weight``    Conv1D (d, 3d): split the out dim
                                                                                   in q, k, v and transpose each
``h.{i}.attn.c_attn.bias``         ``blocks.{i}.self_attn.{q,k,v}_proj.bias``      (3d,) split in three
``h.{i}.attn.c_proj.*``            ``blocks.{i}.self_attn.out_proj.*``             Conv1D weight transposed
``h.{i}.ln_2.*``                   ``blocks.{i}.ffn_residual.norm.*``              same
``h.{i}.mlp.c_fc.*``               ``blocks.{i}.ffn.fc1.*``                        Conv1D weight transposed
``h.{i}.mlp.c_proj.*``             ``blocks.{i}.ffn.fc2.*``                        Conv1D weight transposed
``ln_f.*``                         ``ln_f.*``                                      same
``lm_head.weight``                 ``lm_head.weight``                              tied (the default): ignored on
                                                                                   load, not written on save
=================================  ==============================================  =================================

Ignored on load: ``h.{i}.attn.bias`` and ``h.{i}.attn.masked_bias`` (causal-mask buffers of older files) and, for
tied embeddings, ``lm_head.weight``. Splitting the fused ``c_attn`` matters for tensor parallelism: a fused
projection sharded column-wise gives wrong results.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

__all__ = ["PREFIX", "canonical", "from_hf", "to_hf"]

PREFIX = "transformer."
_IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


def canonical(key: str, *, tied: bool = True) -> str | None:
    """A file key -> its ``GPT2Model`` name (prefix dropped), or None when it is ignored on purpose."""
    if key == "lm_head.weight":
        return None if tied else key
    k = key.removeprefix(PREFIX)
    return None if _IGNORED.fullmatch(k) else k


# (HF module, ours) in a layer: see _pairs
_RENAMED = (("ln_1", "attn_residual.norm"), ("attn.c_proj", "self_attn.out_proj"), ("ln_2", "ffn_residual.norm"),
            ("mlp.c_fc", "ffn.fc1"), ("mlp.c_proj", "ffn.fc2"))  # fmt: skip


def _pairs(n_layers: int) -> list[tuple[str, str]]:
    """(HF name, our name) for the keys that only need a rename (and maybe a transpose): all but ``c_attn``'s."""
    same = [(k, k) for k in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")]
    return same + [(f"h.{i}.{hf}.{p}", f"blocks.{i}.{ours}.{p}")
                   for i in range(n_layers) for p in ("weight", "bias") for hf, ours in _RENAMED]  # fmt: skip


def _conv1d(name: str) -> bool:
    # HF Conv1D stores weight as (in, out): the transpose of nn.Linear's (out, in).
    return name.endswith(".weight") and (".c_proj." in name or ".c_fc." in name or ".c_attn." in name)


def from_hf(sd: dict[str, Tensor], n_layers: int, *, tied: bool = True) -> dict[str, Tensor]:
    """Canonical HF tensors (see :func:`canonical`) -> our ``GPT2`` state dict."""
    out = {ours: sd[hf].t() if _conv1d(hf) else sd[hf] for hf, ours in _pairs(n_layers)}
    for i in range(n_layers):
        w = sd[f"h.{i}.attn.c_attn.weight"]  # (d, 3d)
        bias = sd[f"h.{i}.attn.c_attn.bias"]  # (3d,)
        for name, wc, bc in zip("qkv", w.chunk(3, dim=1), bias.chunk(3, dim=0)):
            out[f"blocks.{i}.self_attn.{name}_proj.weight"] = wc.t()
            out[f"blocks.{i}.self_attn.{name}_proj.bias"] = bc
    out["lm_head.weight"] = sd["wte.weight"] if tied else sd["lm_head.weight"]
    return out


def to_hf(sd: dict[str, Tensor], n_layers: int, *, tied: bool = True) -> dict[str, Tensor]:
    """Our ``GPT2`` state dict -> canonical HF tensors (no ``transformer.`` prefix; ``lm_head.weight`` only
    when untied). Works on meta tensors (used to get the expected shapes without copying)."""
    out = {hf: sd[ours].t() if _conv1d(hf) else sd[ours] for hf, ours in _pairs(n_layers)}
    for i in range(n_layers):
        a = f"blocks.{i}.self_attn."
        out[f"h.{i}.attn.c_attn.weight"] = torch.cat([sd[f"{a}{n}_proj.weight"].t() for n in "qkv"], dim=1)
        out[f"h.{i}.attn.c_attn.bias"] = torch.cat([sd[f"{a}{n}_proj.bias"] for n in "qkv"], dim=0)
    if not tied:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out
