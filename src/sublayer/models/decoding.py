"""Fast autoregressive decoding on the CPU: GPT-2 ``generate`` and Transformer ``translate``.

Decoding one token reads every weight once, so on a CPU it is bound by how fast the weights stream from memory,
plus whatever happens between them. This path (beside the reference loops of :meth:`GPT2.generate` and
:meth:`Transformer.translate`, which stay and which it is tested against) therefore:

* packs every decoding matrix once (``pack_linear_weight``: panels of 16 output columns, read sequentially) and
  multiplies the few rows of a step with the ``skinny_linear`` kernel (AVX2 + FMA, both threads); a single row
  reads four panels at a time (four weight streams per thread keep more memory requests in flight than one);
  q/k/v are one matrix; panels may also be
  float16 (the greedy head's screening copy) or int8 with a per-column scale (``QuantizedGPT2``);
* keeps a static key/value cache allocated once per call, (B, H, T_prompt + max_new, head_dim) per layer, that
  ``decode_attention`` writes and reads in place (no ``torch.cat`` per step); positions and the padding mask are
  built once;
* runs every GPT-2 block of a step in one C++ call (``gpt2_decode_layers``: per block q|k|v GEMV, cache write +
  attention, out-projection, residual + LayerNorm, fc1 with bias + activation in its epilogue, fc2, residual + the next LayerNorm), so no Python runs between the weight streams; ``gpt2_step``'s
  per-op loop is its reference and runs where that call does not apply (other activations, no kernels). The
  Transformer's decoder step is one C++ call too (``transformer_decode_layers``: self-attention, cross-attention
  and FFN of every layer, pre- or post-norm; ``transformer_stepper``'s per-op loop is its reference, and runs for
  gated FFNs). Several rows (batches, beams) take a several-row micro-kernel (AVX2: 6 rows x 16 columns;
  AVX-512 CPUs: 8 rows x 2 panels); above
  :func:`skinny_max_rows` rows (32: the demo's batch of 500) torch's GEMM runs on the unpacked weight instead;
* beam search reorders no cache: each layer's cache carries a (rows, positions) table of the cache row that holds
  each key (every slot is written once, by its own row), and ``decode_attention`` reads through it; the beams of
  a sentence share its memory's cross-attention keys/values (projected once per sentence, not per beam); greedy
  rows that emitted eos leave the batch through the same table;
* greedy GPT-2 decoding never computes the float32 logits: :class:`GreedyHead` screens the vocabulary with a
  float16 copy of the LM head (half its bytes; the head is a third of GPT-2 small's) and recomputes in float32
  only the rows whose error bound reaches the best one, which gives the float32 argmax exactly; sampling
  computes the logits and goes through the reference's own filters.

``Transformer.translate`` encodes the source with :mod:`sublayer.models.fast_encode` (fused q/k/v GEMM, the
``qkv_self_attention`` kernel, fused residual LayerNorms), tested against :meth:`Transformer.encode`.

The prompt itself (prefill) runs through the model's reference forward with its KV caches (batched GEMMs are
what torch does well); its keys/values are then copied into the static cache.

The packed weights are a second copy of the model's matrices in float32 (GPT-2 small: 497 MB, plus 77 MB for the
float16 head), built at the first call and kept (per model, weakly referenced) until a parameter changes in any way
(:mod:`sublayer.runtime.weights`: optimizer steps, fused ones too, in-place and ``.data`` writes) or
:func:`clear_cache`. Without the C++ kernels the same path runs on torch ops (``F.linear`` and SDPA over the cache).

Switch: ``SUBLAYER_DECODING=0`` in the environment or :func:`set_enabled` (``False``: the reference loops run).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import functional as SF
from .. import kernels, settings
from ..runtime import weights as weights_cache
from ..functional.packing import document_mask
from ..runtime.rows import EPILOGUE, add_norm, kernels_on, layer_norm, residual_out
from ..runtime.generation import token_loop
from ..runtime.kv_cache import StaticKVCache, decode_attention
from ..runtime.linear import NO_SCALE, GreedyHead, PackedLinear, skinny_max_rows
from ..runtime.rules import fast_path_allowed
from ..runtime.weights import prepared

__all__ = ["set_enabled", "enabled", "clear_cache", "PackedLinear", "StaticKVCache", "decode_attention"]

_enabled = settings.decoding_enabled()


def set_enabled(flag: bool) -> None:
    """Use the fast decoding path (default) or the reference loops (``False``)."""
    global _enabled
    _enabled = bool(flag)


def enabled() -> bool:
    """Whether ``generate``/``translate`` take the fast decoding path."""
    return _enabled


def prepared_weights(module: torch.nn.Module, build):
    """The packed weights of ``module`` (:func:`sublayer.runtime.weights.prepared`: built once, rebuilt when a
    parameter changes)."""
    return prepared(module, ("decoding", build.__name__, kernels_on()), build)


def clear_cache() -> None:
    """Drop every model's prepared weights."""
    weights_cache.clear_cache()


def float32_cpu(module: torch.nn.Module) -> bool:
    """float32 parameters on the CPU, and the fast-path rule (:mod:`sublayer.runtime.rules`: not sharded, no
    forward hook on any submodule) allows it; otherwise the reference loops run."""
    return all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters()) and fast_path_allowed(
        module
    )


def norm_params(n) -> tuple[Tensor, Tensor, float]:
    return n.weight.detach(), n.bias.detach(), n.eps


# ----------------------------------------------------------------------------------------------- GPT-2
def gpt2_supports(model) -> bool:
    """Whether :func:`gpt2_generate` runs ``model`` (a float32 CPU :class:`GPT2` with LayerNorms with bias)."""
    return (
        _enabled
        and float32_cpu(model)
        and model.ln_f.bias is not None
        and all(blk.attn_residual.norm.bias is not None for blk in model.blocks)
    )


def gpt2_decoder(model, weights: dict | None = None):
    """The fast decoding loop of :func:`sublayer.runtime.generation.generate` for a GPT-2-shaped ``model``
    (``weights``: its prepared weights, None: the packed float32 weights of ``model``'s parameters), or None where
    the reference loop runs (switched off, not float32 CPU, hooks, sharded, LayerNorms without bias)."""
    if weights is None and not gpt2_supports(model):
        return None
    if weights is not None and not _enabled:
        return None
    return functools.partial(gpt2_generate, model, weights=weights)


def build_gpt2(model, linear=PackedLinear) -> dict:
    """GPT-2's prepared weights: norms (weight, bias, eps) in float32, each linear a callable
    ``(x, activation=None)`` made by ``linear(weight, bias)``; the one-call step's tensors when they apply."""
    layers = []
    for blk in model.blocks:
        a, f = blk.self_attn, blk.ffn
        wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)
        bqkv = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0)
        layers.append({
            "ln1": norm_params(blk.attn_residual.norm), "ln2": norm_params(blk.ffn_residual.norm),
            "qkv": linear(wqkv, bqkv), "out": linear(a.out_proj.weight, a.out_proj.bias),
            "fc1": linear(f.fc1.weight, f.fc1.bias), "fc2": linear(f.fc2.weight, f.fc2.bias),
        })  # fmt: skip
    W = {
        "layers": layers, "lnf": norm_params(model.ln_f), "head": linear(model.lm_head.weight, None),
        "greedy": GreedyHead(model.lm_head.weight) if kernels_on() and linear is PackedLinear else None,
        "wte": model.wte.weight.detach(), "wpe": model.wpe.weight.detach(),
    }  # fmt: skip
    W["flat"] = flat_gpt2(W, model.config.activation)
    return W


def flat_gpt2(W: dict, activation: str) -> list | None:
    """The tensors of ``gpt2_decode_layers`` (every block in one C++ call), or None where it does not apply
    (no kernels, an activation it does not fuse, LayerNorms with different eps)."""
    eps = {n[2] for L in W["layers"] for n in (L["ln1"], L["ln2"])} | {W["lnf"][2]}
    if not kernels_on() or activation not in EPILOGUE or len(eps) != 1:
        return None
    flat = []
    for L in W["layers"]:
        parts = [getattr(L[k], "flat", lambda: None)() for k in ("qkv", "out", "fc1", "fc2")]
        if any(p is None for p in parts):
            return None
        flat += [*L["ln1"][:2], *parts[0], *parts[1], *L["ln2"][:2], *parts[2], *parts[3]]
    return [t.contiguous() for t in flat + list(W["lnf"][:2])]


def gpt2_hidden(
    W: dict,
    config,
    input_ids: Tensor,
    position_ids: Tensor,
    key_padding_mask: Tensor | None,
    caches: list | None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """GPT-2's forward on prepared weights ``W`` (:func:`build_gpt2`'s, or the int8 ones of ``QuantizedGPT2``):
    final-LayerNormed hidden states (B, T, d) in ``dtype``; ``caches``: one ``SF.KVCache`` per block, appended to.

    input_ids (B, T); position_ids (B | 1, T), restarts at 0 mark packed documents (block-diagonal attention, as
    :class:`GPT2`); key_padding_mask (B, T_past + T) True = padding, or None. Reference: :meth:`GPT2._hidden`.
    """
    B, T = input_ids.shape
    d, H = config.d_model, config.n_heads
    hd = d // H
    x = (W["wte"][input_ids] + W["wpe"][position_ids]).to(dtype).reshape(B * T, d)
    past = 0 if caches is None else len(caches[0])
    docs = document_mask(position_ids) if past == 0 else None
    if key_padding_mask is None and docs is None and (past == 0 or T == 1):
        mask, causal = None, past == 0
    else:
        mask = SF.causal_mask(T, past + T, device=x.device)[None, None]
        if key_padding_mask is not None:
            mask = mask & ~key_padding_mask[:, None, None, :]
        if docs is not None:
            mask = mask & ~docs
        causal = False
    layers = W["layers"]
    h = layer_norm(x, *layers[0]["ln1"])
    for i, L in enumerate(layers):
        q, k, v = L["qkv"](h).view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)
        if caches is not None:
            k, v = caches[i].update(k, v)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        h, x = add_norm(x, L["out"](ctx.transpose(1, 2).reshape(B * T, d)), *L["ln2"])  # x += attn; h = ln_2(x)
        y = L["fc2"](L["fc1"](h, config.activation))
        h, x = add_norm(x, y, *(layers[i + 1]["ln1"] if i + 1 < len(layers) else W["lnf"]))
    return h.view(B, T, d)


def gpt2_step(model, W: dict, tokens: Tensor, positions: Tensor, caches: list, mask: Tensor | None) -> Tensor:
    """One decoding step: tokens (B,) at positions (B,) -> final hidden states (B, d) float32 (ln_f applied);
    appends to ``caches``."""
    cfg = model.config
    d = cfg.d_model
    x = W["wte"][tokens] + W["wpe"][positions]  # (B, d)
    length = caches[0].length + 1
    flat = W.get("flat")
    if flat is not None and x.shape[0] <= W.get("flat_rows", skinny_max_rows()):  # every block in one C++ call
        h = kernels.ops().gpt2_decode_layers(
            x, flat, [c.k for c in caches], [c.v for c in caches], mask, length, W["lnf"][2], EPILOGUE[cfg.activation]
        )
        for c in caches:
            c.length = length
        return h
    layers = W["layers"]
    w, b, eps = layers[0]["ln1"]
    h = F.layer_norm(x, (d,), w, b, eps)
    for i, L in enumerate(layers):
        qkv = L["qkv"](h)  # (B, 3d)
        c = caches[i]
        ctx = decode_attention(
            qkv[:, :d], c.k, c.v, length, mask=mask, new_k=qkv[:, d : 2 * d], new_v=qkv[:, 2 * d :]
        )
        c.length = length
        h, x = add_norm(x, L["out"](ctx), *L["ln2"])  # x += attn; h = ln_2(x)
        y = L["fc2"](L["fc1"](h, cfg.activation))
        h, x = add_norm(x, y, *(layers[i + 1]["ln1"] if i + 1 < len(layers) else W["lnf"]))
    return h


def gpt2_generate(
    model,
    input_ids: Tensor,
    positions: Tensor,
    key_padding_mask: Tensor | None,
    max_new_tokens: int,
    *,
    prefill,
    pick,
    eos_token_id: int | None,
    pad: int | None,
    weights: dict | None = None,
    greedy: bool = False,
) -> Tensor:
    """The loop of :meth:`GPT2.generate` on the fast path (arguments already checked there).

    Args:
        model: the :class:`GPT2` whose weights decode. input_ids (B, T); positions (B, T) of the prompt tokens;
        key_padding_mask (B, T) True = padding, or None. prefill: ``fn(ids, positions, kpm, caches) -> hidden``
        (the reference ``_hidden``, final norm applied) run once on the prompt. pick: ``fn(logits (B, V)) ->
        (B,) ids`` (argmax or sampling). eos_token_id, pad: as ``generate``. weights: the decoding weights
        (:func:`build_gpt2`'s dict: each linear a callable ``(x, activation=None)``); None -> ``model``'s
        packed float32 weights. greedy: ``pick`` is the argmax; :class:`GreedyHead` (``weights["greedy"]``)
        then finds it without computing every logit in float32.

    Returns:
        (B, T + n) ids.
    """
    cfg = model.config
    b, t = input_ids.shape
    if max_new_tokens == 0:
        return input_ids
    W = prepared_weights(model, build_gpt2) if weights is None else weights
    H = cfg.n_heads
    hd = cfg.d_model // H
    cap = t + max_new_tokens
    ref_caches = [SF.KVCache() for _ in model.blocks]
    h = prefill(input_ids, positions, key_padding_mask, ref_caches)  # (B, T, d)
    caches = []
    for rc in ref_caches:
        c = StaticKVCache(b, H, cap, hd)
        c.fill(rc.k, rc.v)
        caches.append(c)
    del ref_caches
    mask = None
    if key_padding_mask is not None:
        mask = torch.zeros(b, cap, dtype=torch.bool)
        mask[:, :t] = key_padding_mask
    step_pos = positions[:, -1:] + torch.arange(1, max_new_tokens + 1)[None]  # (B, max_new) positions to come
    greedy_head = W.get("greedy") if greedy else None

    def next_ids(h: Tensor) -> Tensor:  # (B, d) final hidden states -> (B,) ids
        return greedy_head(h) if greedy_head is not None else pick(W["head"](h))

    def step(nxt: Tensor, s: int) -> Tensor:
        return next_ids(gpt2_step(model, W, nxt, step_pos[:, s], caches, mask))

    return token_loop(input_ids, max_new_tokens, next_ids(h[:, -1].float()), step, eos_token_id, pad)


# ----------------------------------------------------------------------------------------------- Transformer
def _layer_norms(model) -> list:
    norms = []
    for layer in model.decoder.layers:
        norms += [layer.self_attn_residual.norm, layer.cross_attn_residual.norm, layer.ffn_residual.norm]
    return norms + ([model.decoder.norm] if model.decoder.norm is not None else [])


def transformer_supports(model) -> bool:
    """Whether :func:`transformer_stepper` runs ``model``: float32 CPU, LayerNorms with bias, the fast-path rule
    (no hooks, not sharded); any FFN activation, gated ones included."""
    from ..nn import LayerNorm

    return (
        _enabled
        and float32_cpu(model)
        and all(isinstance(n, LayerNorm) and n.bias is not None for n in _layer_norms(model))
    )


def _build_transformer(model) -> dict:
    layers = []
    for layer in model.decoder.layers:
        sa, ca, f = layer.self_attn, layer.cross_attn, layer.ffn
        qkv_b = None if sa.q_proj.bias is None else torch.cat([sa.q_proj.bias, sa.k_proj.bias, sa.v_proj.bias], 0)
        layers.append({
            "qkv": PackedLinear(torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight], 0), qkv_b),
            "out": PackedLinear(sa.out_proj.weight, sa.out_proj.bias),
            "q_cross": PackedLinear(ca.q_proj.weight, ca.q_proj.bias),
            "out_cross": PackedLinear(ca.out_proj.weight, ca.out_proj.bias),
            "fc1": PackedLinear(f.fc1.weight, f.fc1.bias),
            "fc2": PackedLinear(f.fc2.weight, f.fc2.bias),
            "norms": [norm_params(layer.self_attn_residual.norm), norm_params(layer.cross_attn_residual.norm),
                      norm_params(layer.ffn_residual.norm)],
        })  # fmt: skip
    final = None if model.decoder.norm is None else norm_params(model.decoder.norm)
    W = {"layers": layers, "final": final, "head": PackedLinear(model.out_proj.weight, model.out_proj.bias)}
    W["flat"] = _flat_transformer(W, model.config.activation)
    W["greedy"] = GreedyHead(model.out_proj.weight, model.out_proj.bias) if kernels_on() else None
    return W


_LINEARS = ("qkv", "out", "q_cross", "out_cross", "fc1", "fc2")


def _flat_transformer(W: dict, activation: str) -> list | None:
    """The tensors of ``transformer_decode_layers`` (a decoder step in one C++ call), or None where it does not
    apply (no kernels, a linear without bias, an activation it does not fuse, LayerNorms with different eps)."""
    norms = [n for L in W["layers"] for n in L["norms"]] + ([W["final"]] if W["final"] is not None else [])
    if not kernels_on() or activation not in EPILOGUE or len({n[2] for n in norms}) != 1:
        return None
    flat = []
    for L in W["layers"]:
        parts = [L[k].flat() for k in _LINEARS]
        if any(p is None for p in parts):
            return None
        for lin, p in zip((L[k] for k in _LINEARS), parts):
            flat += [*p, lin.weight]
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
    a row table. Each layer's self-attention cache holds ``max_len`` positions, allocated once.
    """
    if not transformer_supports(model):
        return None
    cfg = model.config
    W = prepared_weights(model, _build_transformer)
    b, s, d = memory.shape
    n = b * beams
    H = cfg.n_heads
    hd = d // H
    memory = memory.float()
    cross = []
    for layer in model.decoder.layers:
        ca = layer.cross_attn
        kv = [F.linear(memory, p.weight, p.bias).view(b, s, H, hd).transpose(1, 2) for p in (ca.k_proj, ca.v_proj)]
        cross.append([t.contiguous() for t in kv])
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
    act = cfg.activation

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
            x, h = residual_out(pre, x, L["fc2"](L["fc1"](h, act)), norms[2], norms[3])
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
