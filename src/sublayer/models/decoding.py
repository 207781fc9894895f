"""Fast autoregressive decoding on the CPU: GPT-2 ``generate`` and Transformer ``translate``.

Decoding one token reads every weight once, so on a CPU it is bound by how fast the weights stream from memory,
plus whatever happens between them. This path (beside the reference loops of :meth:`GPT2.generate` and
:meth:`Transformer.translate`, which stay and which it is tested against) therefore:

* packs every decoding matrix once (``pack_linear_weight``: panels of 16 output columns, read sequentially) and
  multiplies the few rows of a step with the ``skinny_linear`` kernel (AVX2 + FMA, both threads); a single row
  reads four panels at a time (four weight streams per thread keep more misses in flight: ~26 GB/s on GPT-2's
  layers here, where one stream reached ~19 and torch's GEMV ~17-21); q/k/v are one matrix; panels may also be
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
  AVX-512 CPUs: 8 rows x 2 panels, ~130-160 GFLOP/s here against torch's ~80-115 at 32 rows); above
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
float16 head), built at the first call and kept (per model, weakly referenced) until a parameter changes (version counter or storage) or
:func:`clear_cache`. Without the C++ kernels the same path runs on torch ops (``F.linear`` and SDPA over the cache).

Switch: ``SUBLAYER_DECODING=0`` in the environment or :func:`set_enabled` (``False``: the reference loops run).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import functional as SF
from .. import kernels, settings
from ..functional import fused

__all__ = ["set_enabled", "enabled", "clear_cache", "PackedLinear", "StaticKVCache", "decode_attention"]

_enabled = settings.decoding_enabled()


def set_enabled(flag: bool) -> None:
    """Use the fast decoding path (default) or the reference loops (``False``)."""
    global _enabled
    _enabled = bool(flag)


def enabled() -> bool:
    """Whether ``generate``/``translate`` take the fast decoding path."""
    return _enabled


def _kernels_on() -> bool:
    return kernels._enabled and kernels.available()


# ----------------------------------------------------------------------------------------------- building blocks
class PackedLinear:
    """``y = x @ weight.T + bias`` for few rows, the weight packed once for the ``skinny_linear`` kernel.

    Args:
        weight: (N, K) float32 (``nn.Linear`` layout). bias: (N,) or None.

    Call: x (M, K) float32 with unit inner stride (a column slice of a wider tensor works) -> (M, N).
    Without the kernels, or for more than :func:`skinny_max_rows` rows, ``F.linear`` runs on the unpacked weight.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        weight = weight.detach().float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.weight = weight  # the parameter itself (no copy) for batches above skinny_max_rows()
        self.packed = kernels.ops().pack_linear_weight(weight) if _kernels_on() else None
        self.max_rows = skinny_max_rows() if self.packed is not None else 0  # decided once, not per call

    def __call__(self, x: Tensor, activation: str | None = None) -> Tensor:
        """``activation`` (an FFN activation name) is applied after the bias: fused into the kernel's epilogue
        (``fused._ACT_IDS``), a separate pass for any other."""
        if x.shape[0] <= self.max_rows:
            act = _EPILOGUE.get(activation, 0)
            y = kernels.ops().skinny_linear(x, self.packed, self.bias, self.out_features, act)
            return y if activation is None or act else ffn_hidden(y, None, activation)
        y = F.linear(x, self.weight, self.bias)
        return y if activation is None else ffn_hidden(y, None, activation)

    def flat(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(packed, scale, bias)`` as ``gpt2_decode_layers`` takes a linear (no scale: an empty tensor), or None
        (no kernels, no bias)."""
        if self.packed is None or self.bias is None:
            return None
        return self.packed, _NO_SCALE, self.bias


# Up to here the several-row micro-kernels beat torch's GEMM (AVX-512: 8 rows x 2 panels; AVX2: 6 rows x 16
# columns, ~60-70 GFLOP/s at 8-32 rows where torch's reached 40-70 here); above it a blocked GEMM wins.
SKINNY_MAX_ROWS = 32


def skinny_max_rows() -> int:
    """Most rows ``PackedLinear`` multiplies with ``skinny_linear`` (above: torch's GEMM on the unpacked weight)."""
    return SKINNY_MAX_ROWS


_NO_SCALE = torch.empty(0)
_GATES = SF.ffn._GATES  # gated activations: fc1 packs [gate; up]
_EPILOGUE = fused._ACT_IDS  # activations fused into skinny_linear's epilogue (relu, GELU, tanh-GELU, SiLU, relu^2)


class GreedyHead:
    """``argmax(x @ weight.T + bias)`` per row, equal to the float32 argmax, reading the weight in float16.

    The LM head is a third of GPT-2 small's bytes per token. A greedy step needs only the argmax, so this screens
    every vocabulary row with a float16 copy of the weight (half the bytes) and recomputes in float32 only the
    rows that could still be the maximum: with ``w16`` the float16 weight and ``x`` the float32 input,

        |x·w16_j - x·w_j| <= ||x||_2 ||w_j - w16_j||_2            (Cauchy-Schwarz; w_j - w16_j is known exactly)

    plus the float32 rounding of either sum (<= 2 (K+2) u ||x||_2 ||w_j||_2, any summation order, u = 2^-24) and
    of the bias addition. A row j whose screened logit plus its bound is below the best screened logit minus that
    row's bound cannot be the float32 maximum, so the argmax over the candidates' float32 logits (typically one to
    a few rows; ``screened_argmax`` in C++) is the argmax over all rows (ties: the first index, as
    ``torch.argmax``). When the best lower end is not finite, every row is recomputed.

    Args:
        weight: (V, K) float32. bias: (V,) or None.

    Call: x (M, K) float32 -> (M,) int64 ids. Needs the kernels (``skinny_linear`` on float16 panels).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        w = weight.detach().float().contiguous()
        self.weight, self.bias = w, None if bias is None else bias.detach().float().contiguous()
        self.out_features, k = w.shape
        w16 = w.half()
        self.usable = bool(torch.isfinite(w16).all())  # |w| beyond float16's range: no screening
        diff = (w.double() - w16.double()).norm(dim=1)
        rounding = 2 * (k + 2) * 2.0**-24 * torch.maximum(w.double().norm(dim=1), w16.double().norm(dim=1))
        self.bound = ((diff + rounding) * (1 + 2.0**-10)).float()  # (V,) per unit of ||x||_2, rounded up
        self.packed = kernels.ops().pack_linear_weight(w16) if self.usable else None

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias).argmax(-1)
        ops = kernels.ops()
        screened = ops.skinny_linear(x, self.packed, self.bias, self.out_features, 0)  # (M, V)
        return ops.screened_argmax(x, screened, self.weight, self.bias, self.bound)

    def reference(self, x: Tensor) -> Tensor:
        """The same selection in PyTorch ops (what ``screened_argmax`` computes), for tests."""
        screened = F.linear(x, self.weight.half().float(), self.bias)
        xnorm = x.double().norm(dim=1, keepdim=True).float() * (1 + 2.0**-10)
        err = torch.addcmul(screened.abs() * 2.0**-21, xnorm, self.bound[None])  # (M, V)
        best_low = (screened - err).amax(dim=1, keepdim=True)
        cand = ((screened + err) >= best_low) | ~torch.isfinite(best_low) | screened.isnan().any(1, keepdim=True)
        logits = torch.where(cand, F.linear(x, self.weight, self.bias), float("-inf"))
        return logits.argmax(dim=-1), cand.sum(dim=1)


class StaticKVCache:
    """Keys and values of one attention layer, allocated once: (B, n_heads, capacity, head_dim) each.

    ``length`` positions are filled; :func:`decode_attention` appends one position per step in place.
    """

    def __init__(self, batch: int, n_heads: int, capacity: int, head_dim: int, *, dtype=torch.float32) -> None:
        self.k = torch.empty(batch, n_heads, capacity, head_dim, dtype=dtype)  # only [0, length) is ever read
        self.v = torch.empty_like(self.k)
        self.length = 0
        self.rows: Tensor | None = None  # (batch, capacity) int64 once reordered: the cache row of each key

    def fill(self, k: Tensor, v: Tensor) -> None:
        """Copy a prefix (B, H, T, hd) into positions [0, T)."""
        t = k.shape[2]
        self.k[:, :, :t].copy_(k)
        self.v[:, :, :t].copy_(v)
        self.length = t

    def reorder(self, rows: Tensor) -> None:
        """Select batch rows: row n's filled positions become those of row ``rows[n]`` (beam search), and fewer
        rows than the cache holds keep only those (a greedy batch whose other rows ended). Only the (rows,
        capacity) row table changes, no key or value: :func:`decode_attention` reads key j of row n from cache
        row ``self.rows[n, j]``. Row n writes its later positions in cache row n: those slots were never written
        and no table points at them, so every slot stays valid."""
        b, cap = self.k.shape[0], self.k.shape[2]
        if self.rows is None:
            self.rows = torch.arange(b)[:, None].expand(b, cap).contiguous()
        t, n = self.length, rows.numel()
        table = torch.arange(n)[:, None].repeat(1, cap)  # own rows from position t on
        table[:, :t] = self.rows[:, :t].index_select(0, rows.to(self.rows.device))
        self.rows = table


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    length: int,
    *,
    mask: Tensor | None = None,
    new_k: Tensor | None = None,
    new_v: Tensor | None = None,
    rows: Tensor | None = None,
) -> Tensor:
    """One query per row against cached keys/values: q (N, d), k/v (B, H, T_max, hd) -> (N, d).

    With ``new_k``/``new_v`` (N, d) they are first written at position ``length - 1`` of cache rows [0, N) (in
    place; N <= B, and N < B only through a row table). Attends to positions [0, length) except those ``mask``
    (N, T_max) bool marks True; scaled by 1/sqrt(hd). ``rows`` (N, T_max) int64: key j of query row n is in cache
    row ``rows[n, j]`` (a reordered beam's history, a row that outlived others, or the sentence whose memory the
    beams share); None: row n (N == B).
    """
    b, h, _, hd = k.shape
    scale = 1.0 / math.sqrt(hd)
    if _kernels_on():
        return kernels.ops().decode_attention(q, k, v, mask, length, scale, new_k, new_v, rows)
    n = q.shape[0]
    if new_k is not None:  # query row i writes cache row i
        k[:n, :, length - 1] = new_k.reshape(n, h, hd)
        v[:n, :, length - 1] = new_v.reshape(n, h, hd)
    k, v = k[:, :, :length], v[:, :, :length]
    if rows is not None:  # (N, length, H, hd) gathered through the table, as (N, H, length, hd)
        at = torch.arange(length, device=k.device)
        k, v = (t.transpose(1, 2)[rows[:, :length], at].transpose(1, 2) for t in (k, v))
    am = None if mask is None else ~mask[:, None, None, :length]
    ctx = F.scaled_dot_product_attention(q.reshape(n, h, 1, hd), k, v, attn_mask=am, scale=scale)
    return ctx.reshape(n, h * hd)


def _add_norm(x: Tensor, y: Tensor, w: Tensor, b: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(LN(x + y), x + y)`` for (N, d) float32 rows."""
    if _kernels_on():
        out, s, _, _, _ = kernels.ops().add_norm_fwd(x, y, w, b, eps, 0.0, 0, False, True)
        return out, s
    s = x + y
    return F.layer_norm(s, w.shape, w, b, eps), s


def _bias_act(a: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """``act(a + bias)``, in place where the kernels run."""
    if _kernels_on() and act in fused._ACT_IDS:
        return kernels.ops().act_fwd(a, bias, fused._ACT_IDS[act], 0.0, 0, True)
    return SF.activation_fn(act)(a if bias is None else a + bias)


def ffn_hidden(a: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """An FFN's hidden activation from fc1's output ``a`` (N, d_ff) without its bias: ``act(a + bias)``, or for a
    gated activation (``a`` (N, 2·d_ff), gate first) ``act(gate) * up``, as :func:`sublayer.functional.feed_forward`."""
    if act not in _GATES:
        return _bias_act(a, bias, act)
    gate, up = (a if bias is None else a + bias).chunk(2, dim=-1)
    return SF.activation_fn(act)(gate) * up


def residual_out(pre: bool, x: Tensor, y: Tensor, norm: tuple, after: tuple | None) -> tuple[Tensor, Tensor]:
    """``(x, h)`` after a sublayer's output ``y`` joins the residual stream ``x`` (N, d):

    post-norm ``x = LN(x + y)`` with this sublayer's ``norm``, and ``h = x``; pre-norm ``x = x + y`` and ``h`` the
    next sublayer's input, ``after(x)`` (the norm that follows: the next sublayer's, or the stack's final one;
    ``x`` itself when there is none). Norms are ``(weight, bias, eps)``; the add and the norm run fused.
    """
    if not pre:
        x, _ = _add_norm(x, y, *norm)
        return x, x
    if after is None:
        x = x + y
        return x, x
    h, x = _add_norm(x, y, *after)
    return x, h


def _stamp(module: torch.nn.Module) -> tuple:
    return (_kernels_on(),) + tuple((p._version, p.data_ptr()) for p in module.parameters())


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights(module: torch.nn.Module, build):
    """The packed weights of ``module`` (built once, rebuilt when a parameter changes)."""
    stamp = _stamp(module)
    hit = _CACHE.get(module)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    _CACHE.pop(module, None)  # free the old copy before building the new one
    with torch.no_grad():
        w = build(module)
    _CACHE[module] = (stamp, w)
    return w


def clear_cache() -> None:
    """Drop every model's packed decoding weights."""
    _CACHE.clear()


def _float32_cpu(module: torch.nn.Module) -> bool:
    """float32 parameters on the CPU, not sharded (tensor-parallel / FSDP2 models decode on the reference loop)."""
    from .padding_free import plain_model

    return all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters()) and plain_model(module)


def _norm(n) -> tuple[Tensor, Tensor, float]:
    return n.weight.detach(), n.bias.detach(), n.eps


# ----------------------------------------------------------------------------------------------- GPT-2
def gpt2_supports(model) -> bool:
    """Whether :func:`gpt2_generate` runs ``model`` (a float32 CPU :class:`GPT2` with LayerNorms with bias)."""
    return (
        _enabled
        and _float32_cpu(model)
        and model.ln_f.bias is not None
        and all(blk.attn_residual.norm.bias is not None for blk in model.blocks)
    )


def gpt2_source(obj):
    """The :class:`GPT2` whose weights the fast path decodes for ``obj`` (a GPT2, or a wrapper exposing
    ``decode_model``), or None when the reference loop must run."""
    from .gpt2 import GPT2

    model = obj if isinstance(obj, GPT2) else getattr(obj, "decode_model", None)
    return model if isinstance(model, GPT2) and gpt2_supports(model) else None


def _build_gpt2(model) -> dict:
    layers = []
    for blk in model.blocks:
        a, f = blk.self_attn, blk.ffn
        wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)
        bqkv = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0)
        layers.append({
            "ln1": _norm(blk.attn_residual.norm), "ln2": _norm(blk.ffn_residual.norm),
            "qkv": PackedLinear(wqkv, bqkv), "out": PackedLinear(a.out_proj.weight, a.out_proj.bias),
            "fc1": PackedLinear(f.fc1.weight, f.fc1.bias), "fc2": PackedLinear(f.fc2.weight, f.fc2.bias),
        })  # fmt: skip
    W = {
        "layers": layers, "lnf": _norm(model.ln_f), "head": PackedLinear(model.lm_head.weight),
        "greedy": GreedyHead(model.lm_head.weight) if _kernels_on() else None,
        "wte": model.wte.weight.detach(), "wpe": model.wpe.weight.detach(),
    }  # fmt: skip
    W["flat"] = _flat_gpt2(W, model.config.activation)
    return W


def _flat_gpt2(W: dict, activation: str) -> list | None:
    """The tensors of ``gpt2_decode_layers`` (every block in one C++ call), or None where it does not apply
    (no kernels, an activation it does not fuse, LayerNorms with different eps)."""
    eps = {n[2] for L in W["layers"] for n in (L["ln1"], L["ln2"])} | {W["lnf"][2]}
    if not _kernels_on() or activation not in _EPILOGUE or len(eps) != 1:
        return None
    flat = []
    for L in W["layers"]:
        parts = [getattr(L[k], "flat", lambda: None)() for k in ("qkv", "out", "fc1", "fc2")]
        if any(p is None for p in parts):
            return None
        flat += [*L["ln1"][:2], *parts[0], *parts[1], *L["ln2"][:2], *parts[2], *parts[3]]
    return [t.contiguous() for t in flat + list(W["lnf"][:2])]


def gpt2_step(model, W: dict, tokens: Tensor, positions: Tensor, caches: list, mask: Tensor | None) -> Tensor:
    """One decoding step: tokens (B,) at positions (B,) -> final hidden states (B, d) float32 (ln_f applied);
    appends to ``caches``."""
    cfg = model.config
    d, H = cfg.d_model, cfg.n_heads
    x = W["wte"][tokens] + W["wpe"][positions]  # (B, d)
    length = caches[0].length + 1
    flat = W.get("flat")
    if flat is not None and x.shape[0] <= W.get("flat_rows", skinny_max_rows()):  # every block in one C++ call
        h = kernels.ops().gpt2_decode_layers(
            x, flat, [c.k for c in caches], [c.v for c in caches], mask, length, W["lnf"][2], _EPILOGUE[cfg.activation]
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
        h, x = _add_norm(x, L["out"](ctx), *L["ln2"])  # x += attn; h = ln_2(x)
        y = L["fc2"](L["fc1"](h, cfg.activation))
        h, x = _add_norm(x, y, *(layers[i + 1]["ln1"] if i + 1 < len(layers) else W["lnf"]))
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
        (:func:`_build_gpt2`'s dict: each linear a callable ``(x, activation=None)``); None -> ``model``'s
        packed float32 weights. greedy: ``pick`` is the argmax; :class:`GreedyHead` (``weights["greedy"]``)
        then finds it without computing every logit in float32.

    Returns:
        (B, T + n) ids.
    """
    cfg = model.config
    b, t = input_ids.shape
    if max_new_tokens == 0:
        return input_ids
    W = _weights(model, _build_gpt2) if weights is None else weights
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
    out = torch.empty(b, cap, dtype=torch.long)  # as the reference (cat with int64 ids promotes)
    out[:, :t] = input_ids
    finished = torch.zeros(b, dtype=torch.bool)
    greedy_head = W.get("greedy") if greedy else None

    def next_ids(h: Tensor) -> Tensor:  # (B, d) final hidden states -> (B,) ids
        return greedy_head(h) if greedy_head is not None else pick(W["head"](h))

    nxt = next_ids(h[:, -1].float())
    n = 0
    for s in range(max_new_tokens):
        if eos_token_id is not None:
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            finished = finished | (nxt == eos_token_id)
        out[:, t + s] = nxt
        n = s + 1
        if s + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
            break
        nxt = next_ids(gpt2_step(model, W, nxt, step_pos[:, s], caches, mask))
    return out[:, : t + n]


# ----------------------------------------------------------------------------------------------- Transformer
def _layer_norms(model) -> list:
    norms = []
    for layer in model.decoder.layers:
        norms += [layer.self_attn_residual.norm, layer.cross_attn_residual.norm, layer.ffn_residual.norm]
    return norms + ([model.decoder.norm] if model.decoder.norm is not None else [])


def transformer_supports(model) -> bool:
    """Whether :func:`transformer_stepper` runs ``model``: float32 CPU, LayerNorms with bias, no forward hooks on
    an attention module (they fire on the reference steps only); any FFN activation, gated ones included."""
    from ..nn import LayerNorm

    from .padding_free import _attention_hooked

    return (
        _enabled
        and _float32_cpu(model)
        and all(isinstance(n, LayerNorm) and n.bias is not None for n in _layer_norms(model))
        and not _attention_hooked(model)
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
            "norms": [_norm(layer.self_attn_residual.norm), _norm(layer.cross_attn_residual.norm),
                      _norm(layer.ffn_residual.norm)],
        })  # fmt: skip
    final = None if model.decoder.norm is None else _norm(model.decoder.norm)
    W = {"layers": layers, "final": final, "head": PackedLinear(model.out_proj.weight, model.out_proj.bias)}
    W["flat"] = _flat_transformer(W, model.config.activation)
    W["greedy"] = GreedyHead(model.out_proj.weight, model.out_proj.bias) if _kernels_on() else None
    return W


_LINEARS = ("qkv", "out", "q_cross", "out_cross", "fc1", "fc2")


def _flat_transformer(W: dict, activation: str) -> list | None:
    """The tensors of ``transformer_decode_layers`` (a decoder step in one C++ call), or None where it does not
    apply (no kernels, a linear without bias, an activation it does not fuse, LayerNorms with different eps)."""
    norms = [n for L in W["layers"] for n in L["norms"]] + ([W["final"]] if W["final"] is not None else [])
    if not _kernels_on() or activation not in _EPILOGUE or len({n[2] for n in norms}) != 1:
        return None
    flat = []
    for L in W["layers"]:
        parts = [L[k].flat() for k in _LINEARS]
        if any(p is None for p in parts):
            return None
        for lin, p in zip((L[k] for k in _LINEARS), parts):
            flat += [*p, lin.weight]
        flat += [t for n in L["norms"] for t in n[:2]]
    flat += list(W["final"][:2]) if W["final"] is not None else [_NO_SCALE, _NO_SCALE]
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
    W = _weights(model, _build_transformer)
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
                mask, caches[0].rows, sentence, t + 1, eps, _EPILOGUE[act], pre, W["head"].max_rows,
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
