"""The engine of every decoder-only language model (GPT-2, the Llama family): no model has engine code of its own.

A model (:class:`sublayer.models.causal_lm.CausalLM`) provides ``blocks`` of the standard sub-layers
(``attn_residual.norm`` / ``ffn_residual.norm``: LayerNorm with or without bias, or RMSNorm;
``self_attn.{q,k,v,out}_proj``: optional biases, ``n_kv_heads`` key/value heads of ``head_dim``;
``ffn.{fc1,fc2}`` + ``ffn.activation``, plain or gated with fc1 = ``[gate; up]``) and ``causal_parts()``
(:class:`CausalParts`). :func:`named_tensors` gives its tensors under engine names; :func:`build` makes
:class:`CausalWeights` from them with a ``linear(name, tensors)`` factory, so a weight format (float32 panels,
another compute dtype, int8 with scales) is a property of the layer. Then :func:`hidden` is the prepared forward
(prefill, ``fast_inference``: rotary or learned positions, grouped-query attention, packed documents, left
padding), :func:`step` one decoding step over static caches of the key/value heads (every block in one C++ call,
``causal_decode_layers``, where it applies; the per-op loop is its reference), and :func:`decode` the decoding
loop (:func:`decoder` hands it to :func:`sublayer.runtime.generation.generate`). :func:`packed_weights` come
through :func:`sublayer.runtime.weights.prepared`: rebuilt whenever a parameter changes.

Switch: ``SUBLAYER_DECODING=0`` in the environment or :func:`set_enabled` (``False``: the reference loops run).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as SF
from .. import kernels, settings
from ..functional import fused
from ..functional.packing import document_mask
from ..nn import RMSNorm
from .generation import token_loop
from .kv_cache import StaticKVCache, decode_attention
from .linear import NO_SCALE, GreedyHead, PackedLinear, skinny_max_rows
from .rows import add_norm, kernels_on, norm_rows
from .rules import autocast_on, fast_path_allowed
from .weights import prepared

__all__ = [
    "CausalParts", "CausalWeights", "Norm", "named_tensors", "build", "packed_weights", "hidden", "step", "decode",
    "decoder", "supports", "set_enabled", "enabled", "LINEARS", "common_value",
]  # fmt: skip

_enabled: bool | None = None  # SUBLAYER_DECODING, read at the first call (a bad value raises there, not at import)


def set_enabled(flag: bool) -> None:
    """Use the fast decoding path (default) or the reference loops (``False``)."""
    global _enabled
    _enabled = bool(flag)


def enabled() -> bool:
    """Whether ``generate``/``translate`` take the fast decoding path."""
    if _enabled is None:
        set_enabled(settings.decoding_enabled())
    return _enabled


LINEARS = ("qkv", "out", "fc1", "fc2")  # a block's dense layers, as engine names (``layers.{i}.{name}``)


class CausalParts(NamedTuple):
    """The model-level parts of a decoder-only LM (its ``causal_parts()``).

    embed: (vocab, d) token embedding weight. positions: (max_positions, d) learned position table, or None.
    rotary: a module ``position_ids (B|1, T) -> (cos, sin)`` (B|1, T, head_dim), or None. norm: the final norm
    module. lm_head: the ``nn.Linear`` to the vocabulary.
    """

    embed: Tensor
    positions: Tensor | None
    rotary: nn.Module | None
    norm: nn.Module
    lm_head: nn.Module


class Norm(NamedTuple):
    """A prepared norm: float32 weight (d,), bias (d,) or None, eps; ``rms``: RMSNorm (no mean, no bias)."""

    weight: Tensor
    bias: Tensor | None
    eps: float
    rms: bool


def named_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's tensors under engine names (detached; q|k|v concatenated, otherwise the parameters
    themselves): ``wte``, ``wpe`` (learned positions only), ``layers.{i}.{ln1,ln2}.{weight,bias}``,
    ``layers.{i}.{qkv,out,fc1,fc2}.{weight,bias}``, ``ln_f.{weight,bias}``, ``head.{weight,bias}`` (biases and
    norm biases only where the model has them)."""
    parts = model.causal_parts()
    t: dict[str, Tensor] = {"wte": parts.embed}
    if parts.positions is not None:
        t["wpe"] = parts.positions

    def add(name: str, m: nn.Module) -> None:
        t[f"{name}.weight"] = m.weight
        if getattr(m, "bias", None) is not None:
            t[f"{name}.bias"] = m.bias

    for i, blk in enumerate(model.blocks):
        a, p = blk.self_attn, f"layers.{i}"
        add(f"{p}.ln1", blk.attn_residual.norm)
        t[f"{p}.qkv.weight"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)
        if a.q_proj.bias is not None:
            t[f"{p}.qkv.bias"] = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0)
        add(f"{p}.out", a.out_proj)
        add(f"{p}.ln2", blk.ffn_residual.norm)
        add(f"{p}.fc1", blk.ffn.fc1)
        add(f"{p}.fc2", blk.ffn.fc2)
    add("ln_f", parts.norm)
    add("head", parts.lm_head)
    return {k: v.detach() for k, v in t.items()}


class CausalWeights:
    """Prepared weights of a decoder-only LM (:func:`build`): ``layers`` (per block ``ln1``, ``ln2``
    (:class:`Norm`) and ``qkv``, ``out``, ``fc1``, ``fc2`` linears called ``(x, activation=None)``), ``norm``
    (final), ``head`` (a linear), ``greedy`` (a :class:`GreedyHead` or None), ``embed``, ``positions``,
    ``rotary``, the head layout (``n_heads``, ``n_kv_heads``, ``head_dim``), ``activation`` (every block's FFN
    activation, or None where they differ: each layer's ``act`` holds its own), ``cache_dtype`` (the
    decoding KV caches': float32, or bfloat16 for bfloat16 panels), and ``flat``: the tensors of the one-call C++
    step, or None where it does not apply."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def build(
    model: nn.Module,
    linear: Callable[[str, dict[str, Tensor]], object],
    tensors: dict[str, Tensor] | None = None,
    *,
    greedy: bool = False,
    cache_dtype: torch.dtype = torch.float32,
) -> CausalWeights:
    """Prepared weights of ``model``'s structure (head layout, activation, norm kinds and eps, rotary) over
    ``tensors`` (engine names, :func:`named_tensors`; default: the model's own). ``linear(name, tensors)`` makes
    each dense layer (``layers.{i}.{qkv,out,fc1,fc2}``, ``head``); ``greedy``: add a :class:`GreedyHead` of the
    float32 head (needs the kernels); ``cache_dtype``: the decoding KV caches' (float32 or bfloat16)."""
    a, parts = model.blocks[0].self_attn, model.causal_parts()
    t = named_tensors(model) if tensors is None else tensors

    def norm(name: str, module: nn.Module) -> Norm:
        w, b = t[f"{name}.weight"].float(), t.get(f"{name}.bias")
        return Norm(w, None if b is None else b.float(), module.eps, isinstance(module, RMSNorm))

    layers = [{"ln1": norm(f"layers.{i}.ln1", blk.attn_residual.norm),
               "ln2": norm(f"layers.{i}.ln2", blk.ffn_residual.norm), "act": blk.ffn.activation,
               **{k: linear(f"layers.{i}.{k}", t) for k in LINEARS}} for i, blk in enumerate(model.blocks)]  # fmt: skip
    head_w = t.get("head.weight", t["wte"])  # a saved int8 form omits a tied float head: it is the embedding
    W = CausalWeights(
        layers=layers, norm=norm("ln_f", parts.norm), head=linear("head", t), embed=t["wte"], positions=t.get("wpe"),
        greedy=GreedyHead(head_w, t.get("head.bias")) if greedy and kernels_on() else None, cache_dtype=cache_dtype,
        n_heads=a.n_heads, n_kv_heads=a.n_kv_heads or a.n_heads, head_dim=a.head_dim, rotary=parts.rotary,
        activation=common_value({L["act"] for L in layers}), d_model=parts.embed.shape[1],
    )  # fmt: skip
    W.flat = flat_weights(W)
    return W


def common_value(values: set):
    """The one value of ``values``, or None where they differ (layers whose FFN activations were set apart)."""
    return next(iter(values)) if len(values) == 1 else None


def packed_linear(name: str, t: dict[str, Tensor], dtype: torch.dtype = torch.float32) -> PackedLinear:
    """The decoding format of one dense layer (``linear`` of :func:`build`): ``dtype`` (float32 or bfloat16)
    panels for the ``skinny_linear`` kernel, from float32 or bfloat16 parameters."""
    return PackedLinear(t[f"{name}.weight"], t.get(f"{name}.bias"), dtype=dtype)


def packed_weights(model: nn.Module, dtype: torch.dtype | None = None) -> CausalWeights:
    """``model``'s decoding weights (packed panels, the greedy head), built once and rebuilt whenever a parameter
    changes (:func:`sublayer.runtime.weights.prepared`). ``dtype``: the panels' (None: bfloat16 for a model whose
    parameters are all bfloat16, else float32); bfloat16 panels stream half the bytes per step, and their KV
    caches are bfloat16 too (half the bytes a step reads from the caches)."""
    if dtype is None:
        dtype = torch.bfloat16 if all(p.dtype == torch.bfloat16 for p in model.parameters()) else torch.float32

    def packed(m: nn.Module) -> CausalWeights:
        for name, p in m.named_parameters():
            if p.dtype not in (torch.float32, torch.bfloat16) or p.device.type != "cpu":
                raise ValueError(f"the packed weights need float32 or bfloat16 CPU parameters; {name} is {p.dtype} "
                                 f"on {p.device}")  # fmt: skip
        return build(m, functools.partial(packed_linear, dtype=dtype), greedy=True, cache_dtype=dtype)

    return prepared(model, ("causal", "packed", dtype, kernels_on()), packed)


def _flat_linear(lin) -> tuple[Tensor, ...] | None:
    """``(packed, scale, bias, colsum)`` of one linear: its ``flat_quads()`` (``int8_linear``'s quads and column
    sums: a step of one row multiplies them at 24 bits, several rows at 8) where it has them, else its ``flat()``
    panels with an empty colsum; None where it has neither."""
    quads = getattr(lin, "flat_quads", lambda: None)()
    if quads is not None:
        return quads
    p = getattr(lin, "flat", lambda: None)()
    return None if p is None else (*p, NO_SCALE)


def flat_weights(W: CausalWeights) -> list[Tensor] | None:
    """The tensors of ``causal_decode_layers`` (every block of a step in one C++ call), or None where it does not
    apply: no kernels, a linear without panels (``flat()``) or quads (``flat_quads()``), an activation it does not
    fuse or blocks of different activations, norms of mixed kinds or eps, LayerNorms without bias."""
    norms = [n for L in W.layers for n in (L["ln1"], L["ln2"])] + [W.norm]
    act_ok = W.activation in fused.ACT_IDS or W.activation in fused.GLU_IDS
    if not kernels_on() or not act_ok or len({(n.eps, n.rms) for n in norms}) != 1:
        return None
    if any(n.bias is None for n in norms if not n.rms):
        return None
    empty = torch.empty(0)
    flat = []
    for L in W.layers:
        parts = [_flat_linear(L[k]) for k in LINEARS]
        if any(p is None for p in parts):
            return None
        for n, (a, b) in ((L["ln1"], parts[:2]), (L["ln2"], parts[2:])):
            flat += [n.weight, empty if n.rms else n.bias, *a, *b]
    flat += [W.norm.weight, empty if W.norm.rms else W.norm.bias]
    return [x.contiguous() for x in flat]


# ----------------------------------------------------------------------------------------------- row operations
def _next_norm(W: CausalWeights, i: int) -> Norm:
    return W.layers[i + 1]["ln1"] if i + 1 < len(W.layers) else W.norm


def _embed(W: CausalWeights, ids: Tensor, positions: Tensor) -> Tensor:
    x = W.embed[ids]
    return x if W.positions is None else x + W.positions[positions]


# ----------------------------------------------------------------------------------------------- forward
def hidden(
    W: CausalWeights,
    input_ids: Tensor,
    position_ids: Tensor,
    key_padding_mask: Tensor | None,
    caches: list | None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The model's forward on prepared weights: final-normed hidden states (B, T, d) in ``dtype``.

    input_ids (B, T); position_ids (B | 1, T), restarts at 0 mark packed documents (block-diagonal attention)
    without ``caches``; key_padding_mask (B, T_past + T) True = padding, or None; ``caches``: one ``SF.KVCache``
    per block (key/value heads only), appended to. Reference: the model's ``_hidden``.
    """
    B, T = input_ids.shape
    H, Hkv, hd, d = W.n_heads, W.n_kv_heads, W.head_dim, W.d_model
    dq, dkv = H * hd, Hkv * hd
    x = _embed(W, input_ids, position_ids).to(dtype).reshape(B * T, d)
    past = 0 if caches is None else len(caches[0])
    docs = document_mask(position_ids) if caches is None else None  # not generate's prompt: its pads are at 0
    if key_padding_mask is None and docs is None and (past == 0 or T == 1):
        mask, causal = None, past == 0
    else:
        mask = SF.causal_mask(T, past + T, device=x.device)[None, None]
        if key_padding_mask is not None:
            mask = mask & ~key_padding_mask[:, None, None, :]
        if docs is not None:
            mask = mask & ~docs
        causal = False
    rot = None if W.rotary is None else W.rotary(position_ids, dtype=dtype)
    # a causal prompt of plain heads: attention read from the fused q|k|v rows (no transposed copies)
    fused_attn = causal and rot is None and Hkv == H and dtype in (torch.float32, torch.bfloat16) and kernels_on()
    h = norm_rows(x, *W.layers[0]["ln1"])
    for i, L in enumerate(W.layers):
        rows = L["qkv"](h)  # (B*T, dq + 2*dkv)
        qkv = rows.view(B, T, dq + 2 * dkv)
        q = qkv[..., :dq].unflatten(-1, (H, hd)).transpose(1, 2)
        k = qkv[..., dq : dq + dkv].unflatten(-1, (Hkv, hd)).transpose(1, 2)
        v = qkv[..., dq + dkv :].unflatten(-1, (Hkv, hd)).transpose(1, 2)
        if rot is not None:
            q, k = SF.apply_rotary(q, *rot), SF.apply_rotary(k, *rot)
        if W.cache_dtype != dtype:  # attend over the keys and values as the decoding caches hold them
            if rot is None:  # k and v are views of the rows: rounded there, in one pass
                rows[:, dq:].copy_(rows[:, dq:].to(W.cache_dtype))
            else:
                k, v = k.to(W.cache_dtype).to(dtype), v.to(W.cache_dtype).to(dtype)
        if caches is not None:
            k, v = caches[i].update(k, v)
        if fused_attn:
            ctx = kernels.ops().qkv_self_attention(rows, None, H, T, hd**-0.5, True)
        else:
            if Hkv != H:
                k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            ctx = ctx.transpose(1, 2).reshape(B * T, dq)
        h, x = add_norm(x, L["out"](ctx), *L["ln2"])  # x += attn; h = ln_2(x)
        y = L["fc2"](L["fc1"](h, L["act"]))
        h, x = add_norm(x, y, *_next_norm(W, i))
    return h.view(B, T, d)


# ----------------------------------------------------------------------------------------------- decoding
def _rotate(x: Tensor, heads: int, cos: Tensor, sin: Tensor) -> Tensor:
    """Rows x (B, heads * hd) rotated per head by cos/sin (B, hd) -> (B, heads * hd)."""
    b = x.shape[0]
    return SF.apply_rotary(x.reshape(b, heads, -1), cos[:, None], sin[:, None]).reshape(b, -1)


def step(W: CausalWeights, tokens: Tensor, positions: Tensor, caches: list, mask: Tensor | None) -> Tensor:
    """One decoding step: tokens (B,) at positions (B,) -> final hidden states (B, d) float32; appends each
    block's key/value at ``caches[i].length`` (:class:`StaticKVCache` s of the key/value heads); ``mask``
    (B, capacity) True = padding, or None."""
    x = _embed(W, tokens, positions).float()  # (B, d)
    length = caches[0].length + 1
    H, Hkv, hd = W.n_heads, W.n_kv_heads, W.head_dim
    dq, dkv = H * hd, Hkv * hd
    cos = sin = None
    if W.rotary is not None:
        cos, sin = (c[:, 0].contiguous() for c in W.rotary(positions[:, None]))  # (B, hd)
    flat = W.flat
    if flat is not None and x.shape[0] <= skinny_max_rows():  # every block in one C++ call
        gated = W.activation in fused.GLU_IDS
        act = fused.GLU_IDS[W.activation] if gated else fused.ACT_IDS[W.activation]
        d_ff = W.layers[0]["fc1"].out_features
        h = kernels.ops().causal_decode_layers(
            x, flat, [c.k for c in caches], [c.v for c in caches], mask, cos, sin, length, H, d_ff, W.norm.eps,
            W.norm.rms, act, gated,
        )  # fmt: skip
        for c in caches:
            c.length = length
        return h
    h = norm_rows(x, *W.layers[0]["ln1"])
    for i, L in enumerate(W.layers):
        qkv = L["qkv"](h)  # (B, dq + 2 dkv)
        q, k = qkv[:, :dq], qkv[:, dq : dq + dkv]
        if cos is not None:
            q, k = _rotate(q, H, cos, sin), _rotate(k, Hkv, cos, sin)
        c = caches[i]
        ctx = decode_attention(q, c.k, c.v, length, mask=mask, new_k=k, new_v=qkv[:, dq + dkv :])
        c.length = length
        h, x = add_norm(x, L["out"](ctx), *L["ln2"])  # x += attn; h = ln_2(x)
        y = L["fc2"](L["fc1"](h, L["act"]))
        h, x = add_norm(x, y, *_next_norm(W, i))
    return h


def decode(
    model: nn.Module,
    input_ids: Tensor,
    positions: Tensor,
    key_padding_mask: Tensor | None,
    max_new_tokens: int,
    *,
    prefill,
    pick,
    eos_token_id: int | list[int] | None,
    pad: int | None,
    weights: CausalWeights | None = None,
    greedy: bool = False,
) -> Tensor:
    """The decoding loop of :func:`sublayer.runtime.generation.generate` on the fast path (arguments checked
    there): input_ids (B, T), positions (B, T), key_padding_mask (B, T) True = padding or None; ``prefill(ids,
    positions, kpm, caches)`` (the reference forward) runs once on the prompt; ``pick(logits (B, V)) -> (B,)``;
    ``weights``: :func:`build`'s (None: :func:`packed_weights` of ``model``); ``greedy``: ``pick`` is the argmax,
    which the weights' :class:`GreedyHead` finds without every float32 logit. Returns (B, T + n) ids."""
    b, t = input_ids.shape
    if max_new_tokens == 0:
        return input_ids
    W = packed_weights(model) if weights is None else weights
    cap = t + max_new_tokens
    ref_caches = [SF.KVCache() for _ in W.layers]
    h = prefill(input_ids, positions, key_padding_mask, ref_caches)  # (B, T, d)
    caches = [StaticKVCache(b, W.n_kv_heads, cap, W.head_dim, dtype=W.cache_dtype).fill(c.k, c.v) for c in ref_caches]
    del ref_caches
    mask = None
    if key_padding_mask is not None:
        mask = torch.zeros(b, cap, dtype=torch.bool)
        mask[:, :t] = key_padding_mask
    step_pos = positions[:, -1:] + torch.arange(1, max_new_tokens + 1)[None]  # (B, max_new) positions to come
    greedy_head = W.greedy if greedy else None

    def next_ids(h: Tensor) -> Tensor:  # (B, d) final hidden states -> (B,) ids
        return greedy_head(h) if greedy_head is not None else pick(W.head(h).float())

    def one(nxt: Tensor, s: int) -> Tensor:
        return next_ids(step(W, nxt, step_pos[:, s], caches, mask))

    return token_loop(input_ids, max_new_tokens, next_ids(h[:, -1].float().contiguous()), one, eos_token_id, pad)


def supports(model: nn.Module) -> bool:
    """Whether the packed decoding runs ``model``: switched on, float32 or bfloat16 CPU parameters (float32
    panels, or bfloat16 ones for an all-bfloat16 model: :func:`packed_weights`), the fast-path rule
    (:mod:`sublayer.runtime.rules`: not sharded, no forward hook on any submodule) and CPU autocast off (under
    autocast the reference loop runs every step under it, as the prompt)."""
    return (
        enabled()
        and all(p.dtype in (torch.float32, torch.bfloat16) and p.device.type == "cpu" for p in model.parameters())
        and fast_path_allowed(model)
        and not autocast_on()
    )


def decoder(model: nn.Module, weights: Callable[[], CausalWeights] | None = None, *, check: bool | None = None):
    """The fast decoding loop of :func:`sublayer.runtime.generation.generate` for ``model``, or None where the
    reference loop runs. ``weights``: a function giving the prepared weights (an int8 or bf16 form's); None:
    ``model``'s :func:`packed_weights`. ``check``: ask :func:`supports` first (default: when ``weights`` is
    None)."""
    if not enabled() or ((weights is None if check is None else check) and not supports(model)):
        return None
    return functools.partial(decode, model, weights=None if weights is None else weights())
