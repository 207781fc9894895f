"""Fast decoding of the Transformer's decoder (``Transformer.translate``); decoder-only language models decode
through :mod:`sublayer.runtime.causal`, which this module re-exports the switch of.

Decoding one token reads every weight once, so on a CPU it is bound by how fast the weights stream from memory,
plus whatever happens between them. This path (beside :meth:`Transformer.translate`'s reference loops, which stay
and which it is tested against) therefore:

* packs every decoding matrix once (:class:`~sublayer.runtime.linear.PackedLinear`) and multiplies the few rows
  of a step with the ``skinny_linear`` kernel; q/k/v are one matrix;
* keeps a static key/value cache allocated once per call (:class:`~sublayer.runtime.kv_cache.StaticKVCache`),
  that ``decode_attention`` writes and reads in place;
* runs the decoder step in one C++ call (``transformer_decode_layers``: self-attention, cross-attention and FFN
  of every layer, pre- or post-norm; ``transformer_stepper``'s per-op loop is its reference, and runs for gated
  FFNs; one parallel region for the whole step); above :func:`~sublayer.runtime.linear.skinny_max_rows` rows
  torch's GEMM runs on the unpacked weight, in blocks of rows shared by the threads;
* beam search reorders no cache: each layer's cache carries a (rows, positions) table of the cache row that holds
  each key, and ``decode_attention`` reads through it; the beams of a sentence share its memory's cross-attention
  keys/values (projected once per sentence, not per beam); greedy rows that emitted eos leave the batch through
  the same table; greedy search reads the head through :class:`~sublayer.runtime.linear.GreedyHead`.

``Transformer.translate`` encodes the source with :mod:`sublayer.models.fast_encode`. The packed weights come
from :func:`sublayer.runtime.weights.prepared` (rebuilt whenever a parameter changes).

Switch: ``SUBLAYER_DECODING=0`` in the environment or :func:`set_enabled` (``False``: the reference loops run).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from ..functional.fused import linear
from ..runtime.causal import common_value, enabled, set_enabled
from ..runtime.kv_cache import StaticKVCache, decode_attention
from ..runtime.linear import NO_SCALE, GreedyHead, PackedLinear, skinny_max_rows
from ..runtime.rows import EPILOGUE, kernels_on, residual_out
from ..runtime.rules import autocast_on, fast_path_allowed
from ..runtime.weights import clear_cache, prepared  # clear_cache: drop every model's prepared weights

__all__ = [
    "set_enabled", "enabled", "clear_cache", "transformer_stepper", "PackedLinear", "StaticKVCache",
    "decode_attention", "skinny_max_rows",
]  # fmt: skip


def prepared_weights(module: torch.nn.Module, build):
    """The packed weights of ``module`` (:func:`sublayer.runtime.weights.prepared`: built once, rebuilt when a
    parameter changes)."""
    return prepared(module, ("decoding", build.__name__, kernels_on()), build)


def float32_cpu(module: torch.nn.Module, norms: list) -> bool:
    """float32 parameters on the CPU, ``norms`` LayerNorms with bias (None entries: no norm there), the
    fast-path rule (:mod:`sublayer.runtime.rules`: not sharded, no forward hook on any submodule) allows it and
    CPU autocast is off; otherwise the reference loops run."""
    from ..nn import LayerNorm

    ok = all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters())
    ok = ok and all(n is None or (isinstance(n, LayerNorm) and n.bias is not None) for n in norms)
    return ok and fast_path_allowed(module) and not autocast_on()


def norm_params(n) -> tuple[Tensor, Tensor, float]:
    return n.weight.detach(), n.bias.detach(), n.eps


# ----------------------------------------------------------------------------------------------- Transformer
def transformer_supports(model) -> bool:
    """Whether :func:`transformer_stepper` runs ``model``: float32 CPU, LayerNorms with bias, the fast-path rule
    (no hooks, not sharded); any FFN activation, gated ones included."""
    dec = model.decoder
    norms = [r.norm for L in dec.layers for r in (L.self_attn_residual, L.cross_attn_residual, L.ffn_residual)]
    return enabled() and float32_cpu(model, [*norms, dec.norm])


_LINEARS = ("qkv", "out", "q_cross", "out_cross", "fc1", "fc2")  # a decoder layer's, in the C++ step's order


def _build_transformer(model) -> dict:
    layers = []
    for layer in model.decoder.layers:
        sa, ca, f = layer.self_attn, layer.cross_attn, layer.ffn
        qkv_b = None if sa.q_proj.bias is None else torch.cat([sa.q_proj.bias, sa.k_proj.bias, sa.v_proj.bias], 0)
        rest = zip(_LINEARS[1:], (sa.out_proj, ca.q_proj, ca.out_proj, f.fc1, f.fc2))  # every linear but qkv
        layers.append({
            "qkv": PackedLinear(torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight], 0), qkv_b),
            **{k: PackedLinear(m.weight, m.bias) for k, m in rest},
            "norms": [norm_params(layer.self_attn_residual.norm), norm_params(layer.cross_attn_residual.norm),
                      norm_params(layer.ffn_residual.norm)],
            "act": f.activation,  # the module's own, as its forward reads it (set after construction too)
        })  # fmt: skip
    final = None if model.decoder.norm is None else norm_params(model.decoder.norm)
    W = {"layers": layers, "final": final, "head": PackedLinear(model.out_proj.weight, model.out_proj.bias)}
    W["act"] = common_value({L["act"] for L in layers})  # None: the layers' activations differ
    W["flat"] = _flat_transformer(W, W["act"])
    W["greedy"] = GreedyHead(model.out_proj.weight, model.out_proj.bias) if kernels_on() else None
    return W


def _flat_transformer(W: dict, activation: str | None) -> list | None:
    """The tensors of ``transformer_decode_layers`` (a decoder step in one C++ call), or None where it does not
    apply (no kernels, a linear without bias, an activation it does not fuse or layers of different activations
    (None), LayerNorms with different eps)."""
    norms = [n for L in W["layers"] for n in L["norms"]] + ([W["final"]] if W["final"] is not None else [])
    if not kernels_on() or activation not in EPILOGUE or len({n[2] for n in norms}) != 1:
        return None
    flat = []
    for L in W["layers"]:
        parts = [L[k].flat() if L[k].bias is not None else None for k in _LINEARS]
        if any(p is None for p in parts):
            return None
        flat += [t for k, p in zip(_LINEARS, parts) for t in (*p, L[k].weight)]
        flat += [t for n in L["norms"] for t in n[:2]]
    flat += list(W["final"][:2]) if W["final"] is not None else [NO_SCALE, NO_SCALE]
    return [t.contiguous() for t in flat]


def transformer_stepper(
    model, memory: Tensor, memory_key_padding_mask: Tensor | None, max_len: int, *, beams: int = 1
):
    """``(step, reorder)`` for :meth:`Transformer.translate`'s search loops on the fast path, or None when the
    model is not supported (the reference steps then run).

    ``(step, reorder, next_ids)``: ``step(tok)``: tok (N, 1) ids of the newest position -> (N, tgt_vocab) float32
    logits of the next one (the ``decode`` logits of the reference with caches); ``next_ids(tok)``: their argmax
    (N,) (greedy search: the head read in float16, exact). ``reorder(rows)``: keep batch rows ``rows``.
    memory (B, S, d_model) and its mask (B, S) True = padding are projected to keys/values once per layer, once
    per sentence: its ``beams`` rows (N = B * beams, row i * beams + j is beam j of sentence i) read them through
    a row table. Each layer's self-attention cache holds ``max_len`` positions, allocated once. An empty source
    (S = 0: cross-attention reads nothing) takes the reference steps.
    """
    if not transformer_supports(model) or memory.shape[1] == 0:
        return None
    cfg = model.config
    W = prepared_weights(model, _build_transformer)
    b, s, d = memory.shape
    n = b * beams
    H = cfg.n_heads
    hd = d // H
    memory = memory.float()
    cross = [[linear(memory, p.weight, p.bias).view(b, s, H, hd).transpose(1, 2).contiguous()
              for p in (L.cross_attn.k_proj, L.cross_attn.v_proj)] for L in model.decoder.layers]  # fmt: skip
    # beam j of sentence i reads sentence i's memory keys/values
    sentence = None if beams == 1 else (torch.arange(n) // beams)[:, None].expand(n, s).contiguous()
    mask = None
    if memory_key_padding_mask is not None and bool(memory_key_padding_mask.any()):
        mask = memory_key_padding_mask.repeat_interleave(beams, dim=0).contiguous()
    caches = [StaticKVCache(n, H, max_len, hd) for _ in model.decoder.layers]
    emb = model.tgt_embed.weight.detach()
    pe = model.pos_encoding
    scale = math.sqrt(d)
    pre = cfg.norm_first
    act = W["act"]  # the one-call step's (every layer's, where they agree)

    flat = W["flat"]
    eps = W["layers"][0]["norms"][0][2]

    def hidden(tok: Tensor) -> Tensor:
        """tok (N, 1) -> the decoder's final hidden states (N, d) of that position (what the head reads)."""
        t = caches[0].length
        x = (emb[tok[:, -1]] * scale + pe[t]).float()  # (N, d)
        if flat is not None:  # every layer in one C++ call (the loop below is its reference)
            h = kernels.ops().transformer_decode_layers(
                x, flat, [c.k for c in caches], [c.v for c in caches], [c[0] for c in cross], [c[1] for c in cross],
                mask, caches[0].rows, sentence, t + 1, eps, EPILOGUE[act], pre, W["head"].max_rows,
            )  # fmt: skip
            for c in caches:
                c.length = t + 1
            return h
        layers = W["layers"]
        h = F.layer_norm(x, (d,), *layers[0]["norms"][0][:2], layers[0]["norms"][0][2]) if pre else x
        for i, L in enumerate(layers):
            # the norm after this layer's last sublayer (pre-norm): the next layer's first, or the final one
            norms = L["norms"] + ([layers[i + 1]["norms"][0]] if i + 1 < len(layers) else [W["final"]])
            qkv = L["qkv"](h)
            c = caches[i]
            ctx = decode_attention(
                qkv[:, :d], c.k, c.v, t + 1, new_k=qkv[:, d : 2 * d], new_v=qkv[:, 2 * d :], rows=c.rows
            )
            c.length = t + 1
            x, h = residual_out(pre, x, L["out"](ctx), norms[0], norms[1])
            mk, mv = cross[i]
            ctx = decode_attention(L["q_cross"](h), mk, mv, s, mask=mask, rows=sentence)
            x, h = residual_out(pre, x, L["out_cross"](ctx), norms[1], norms[2])
            x, h = residual_out(pre, x, L["fc2"](L["fc1"](h, L["act"])), norms[2], norms[3])
        if not pre and W["final"] is not None:
            h = F.layer_norm(h, (d,), *W["final"][:2], W["final"][2])
        return h

    def step(tok: Tensor) -> Tensor:
        return W["head"](hidden(tok))

    def next_ids(tok: Tensor) -> Tensor:
        """tok (N, 1) -> (N,) the argmax of ``step(tok)``'s logits: a batch of up to the head's row limit reads the
        head in float16 through :class:`GreedyHead` (the exact float32 argmax) instead of computing the logits."""
        h = hidden(tok)
        if W["greedy"] is not None and h.shape[0] <= W["head"].max_rows:
            return W["greedy"](h)
        return W["head"](h).argmax(-1)

    def reorder(rows: Tensor) -> None:
        """Keep batch rows ``rows`` (beam search: a permutation inside each sentence; greedy: the rows still
        running, fewer than before): the caches' row tables, and which memory (and mask row) each row reads."""
        nonlocal sentence, mask
        caches[0].reorder(rows)
        for c in caches[1:]:  # every layer wrote and reorders the same positions: one table serves all
            c.rows = caches[0].rows
        base = torch.arange(n)[:, None].expand(n, s) if sentence is None else sentence
        sentence = base.index_select(0, rows)
        if mask is not None:
            mask = mask.index_select(0, rows)

    return step, reorder, next_ids
