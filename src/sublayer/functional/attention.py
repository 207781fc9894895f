"""Multi-head attention: masks, the attention core and the projections — the one reference of its math.

Mask conventions (those of ``torch.nn.MultiheadAttention``):
- ``key_padding_mask`` (B, T_k): bool True = padding (ignored key), or float added to the scores.
- ``attn_mask``: bool True = NOT allowed to attend, or float added to the scores; shape (T_q, T_k),
  (B·n_heads, T_q, T_k) or (B | 1, n_heads | 1, T_q, T_k).
- ``is_causal``: query i sees keys j ≤ i + (T_k − T_q): aligned bottom-right, so that a query block that continues
  a cached prefix sees the whole prefix (the same as top-left when T_q == T_k).
Masks are combined as booleans (adding two ``finfo.min`` masks overflows in half precision). A query row whose
keys are all masked gives zeros and finite gradients, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import (
    check_input_weight, check_positive_int, check_probability, check_same_dtype_device, check_tensor,
)
from .rope import apply_rotary

__all__ = ["KVCache", "attention", "multi_head_attention", "causal_mask"]


class KVCache:
    """Keys and values kept between decoding steps, (B, n_kv_heads, T, head_dim) each (the key/value heads only:
    grouped-query attention repeats them for the query heads after the cache).

    ``static=False`` (self-attention): each call appends the new keys/values.
    ``static=True`` (cross-attention on a fixed memory): the first call stores them, later calls reuse them and
    skip the key/value projections.
    """

    def __init__(self, *, static: bool = False) -> None:
        self.static = static
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    @property
    def filled(self) -> bool:
        return self.k is not None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is None or self.static:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=-2)
            self.v = torch.cat([self.v, v], dim=-2)
        return self.k, self.v

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (beam search)."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


def causal_mask(t_q: int, t_k: int, *, device: torch.device | None = None) -> Tensor:
    """(T_q, T_k) bool, True = allowed; bottom-right aligned (query i sees keys j ≤ i + T_k − T_q)."""
    i = torch.arange(t_q, device=device)[:, None]
    j = torch.arange(t_k, device=device)[None, :]
    return j <= i + (t_k - t_q)


def _check_mask_dtype(name: str, mask: Tensor, q: Tensor) -> None:
    check_tensor(name, mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = masked) or floating (additive), got dtype {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"{name} device {mask.device} does not match query device {q.device}")


def _attn_mask_4d(attn_mask: Tensor, q: Tensor, t_k: int) -> Tensor:
    b, h, t_q = q.shape[:3]
    _check_mask_dtype("attn_mask", attn_mask, q)
    if attn_mask.dim() == 2 and attn_mask.shape == (t_q, t_k):
        return attn_mask[None, None]
    if attn_mask.dim() == 3 and attn_mask.shape == (b * h, t_q, t_k):
        return attn_mask.view(b, h, t_q, t_k)
    if (
        attn_mask.dim() == 4
        and attn_mask.shape[0] in (1, b)
        and attn_mask.shape[1] in (1, h)
        and attn_mask.shape[2:] == (t_q, t_k)
    ):
        return attn_mask
    raise ValueError(
        f"attn_mask must have shape ({t_q}, {t_k}), ({b * h}, {t_q}, {t_k}) or "
        f"({b} or 1, {h} or 1, {t_q}, {t_k}), got {tuple(attn_mask.shape)}"
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout: float = 0.0,
    training: bool = True,
    need_weights: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention over heads, built on ``F.scaled_dot_product_attention``.

    Args:
        q: (B, H, T_q, d_head). k: (B, H, T_k, d_head). v: (B, H, T_k, d_v).
        key_padding_mask, attn_mask, is_causal: see the module docstring.
        dropout: on the attention weights when ``training``.
        need_weights: also return the attention weights.
        scale: defaults to 1/sqrt(d_head).

    Returns:
        (out (B, H, T_q, d_v), weights (B, H, T_q, T_k) or None).
    """
    b, h, t_q, _ = q.shape
    t_k = k.shape[-2]
    masks = []  # (B | 1, H | 1, T_q | 1, T_k), bool True = masked or additive
    if key_padding_mask is not None:
        _check_mask_dtype("key_padding_mask", key_padding_mask, q)
        if key_padding_mask.shape != (b, t_k):
            raise ValueError(
                f"key_padding_mask must have shape (batch, key_len) = ({b}, {t_k}), "
                f"got {tuple(key_padding_mask.shape)}"
            )
        masks.append(key_padding_mask[:, None, None, :])
    if attn_mask is not None:
        masks.append(_attn_mask_4d(attn_mask, q, t_k))
    allowed: Tensor | None = None  # bool, True = may attend
    additive: Tensor | None = None
    for m in masks:
        if m.dtype == torch.bool:
            allowed = ~m if allowed is None else allowed & ~m
        else:
            additive = m.to(q.dtype) if additive is None else additive + m.to(q.dtype)
    sdpa_causal = False
    if is_causal:
        if allowed is None and additive is None and t_q == t_k and not need_weights:
            sdpa_causal = True  # lets SDPA take its flash kernel
        else:
            cm = causal_mask(t_q, t_k, device=q.device)[None, None]
            allowed = cm if allowed is None else allowed & cm

    mask: Tensor | None = None
    dead: Tensor | None = None  # query rows with no key left to attend to
    if additive is not None:
        if allowed is not None:
            additive = additive.masked_fill(~allowed, float("-inf"))
        dead = torch.isneginf(additive).all(dim=-1, keepdim=True)
        mask = additive.masked_fill(dead, 0.0)  # a dead row attends uniformly, then is zeroed below
    elif allowed is not None:
        dead = ~allowed.any(dim=-1, keepdim=True)
        mask = allowed | dead

    p = dropout if training else 0.0
    weights: Tensor | None = None
    if need_weights:
        s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        scores = (q @ k.transpose(-2, -1)) * s
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        weights = scores.softmax(dim=-1)
        if dead is not None:
            weights = weights.masked_fill(dead, 0.0)
        # the weights returned are the ones applied, after dropout (as nn.MultiheadAttention and HF's eager path)
        weights = F.dropout(weights, p, training)
        out = weights @ v
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=sdpa_causal, scale=scale)
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
    return out, weights


def multi_head_attention(
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    n_heads: int,
    q_weight: Tensor,
    q_bias: Tensor | None,
    k_weight: Tensor,
    k_bias: Tensor | None,
    v_weight: Tensor,
    v_bias: Tensor | None,
    out_weight: Tensor,
    out_bias: Tensor | None,
    *,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout: float = 0.0,
    training: bool = True,
    need_weights: bool = False,
    average_attn_weights: bool = True,
    kv_cache: KVCache | None = None,
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor] = F.linear,
    rotary: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Multi-head attention with separate q/k/v/out projections (``nn.MultiheadAttention`` math).

    Grouped-query attention: ``k_weight``/``v_weight`` may project to fewer heads than ``q_weight`` (``n_kv_heads``
    = their rows / head_dim, dividing ``n_heads``); each key/value head serves ``n_heads / n_kv_heads``
    consecutive query heads (HF ``repeat_kv``), and a KV cache holds the key/value heads only.

    Args:
        query: (B, T_q, d_model). key: (B, T_k, kdim) or None (= query). value: (B, T_k, vdim) or None (= key).
        n_heads: number of (query) heads; the projected size must divide by it.
        q_weight: (n_heads·head_dim, d_model) (head_dim = d_model / n_heads unless the weights say otherwise);
        k_weight: (n_kv_heads·head_dim, kdim); v_weight: (n_kv_heads·head_dim, vdim);
        out_weight: (d_model, n_heads·head_dim); biases of the projections' output sizes, or None.
        key_padding_mask: (B, T_k) — for the keys this call attends to, cache included.
        attn_mask, is_causal, dropout, training: see :func:`attention`.
        need_weights: also return the weights, averaged over heads (B, T_q, T_k) unless
            ``average_attn_weights=False`` (B, H, T_q, T_k).
        kv_cache: a :class:`KVCache` that this call reads and extends (decoding).
        linear: the projection, ``F.linear`` by default (the modules pass :func:`sublayer.functional.fused.linear`,
            which speeds up bf16 on CPUs without native bf16 GEMMs).
        rotary: ``(cos, sin)``, each (B | 1, T_q, head_dim) (:func:`sublayer.functional.rotary_cos_sin` at the
            positions of the query tokens): rotary position embeddings applied to q and k after the projections,
            before the cache update (HF Llama order); None = none.

    Returns:
        (out (B, T_q, d_model), weights or None).

    Raises:
        ValueError/TypeError: non-3-D inputs, batch or length mismatch, dtype/device mismatch, bad masks.
    """
    check_positive_int("n_heads", n_heads)
    check_probability("dropout", dropout)
    key = query if key is None else key
    value = key if value is None else value
    for name, t, w in (("query", query, q_weight), ("key", key, k_weight), ("value", value, v_weight)):
        check_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (batch, seq, features), got shape {tuple(t.shape)}")
        if t.shape[-1] != w.shape[-1]:
            raise ValueError(f"{name} must have last dim {w.shape[-1]}, got shape {tuple(t.shape)}")
    check_same_dtype_device(query=query, key=key, value=value)
    check_input_weight("query", query, "q_weight", q_weight)
    if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
        raise ValueError(
            "query, key and value must share the batch size and key/value the length: got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    b, t_q = query.shape[:2]
    head_dim = q_weight.shape[0] // n_heads
    if q_weight.shape[0] % n_heads or k_weight.shape[0] % head_dim or (n_heads * head_dim) % k_weight.shape[0]:
        raise ValueError(
            f"q_weight's {q_weight.shape[0]} outputs must split into n_heads={n_heads} heads and k_weight's "
            f"{k_weight.shape[0]} outputs into a number of heads of that size that divides n_heads"
        )

    def split(x: Tensor) -> Tensor:
        # (B, T, H·d) -> (B, H, T, d); heads from the projected size, so a tensor-parallel shard with fewer
        # local heads works (not view(..., -1, d): that is ambiguous for an empty batch or sequence).
        return x.view(x.shape[0], x.shape[1], x.shape[-1] // head_dim, head_dim).transpose(1, 2)

    q = split(linear(query, q_weight, q_bias))
    if rotary is not None:
        q = apply_rotary(q, *rotary)
    if kv_cache is not None and kv_cache.static and kv_cache.filled:
        k, v = kv_cache.k, kv_cache.v
    else:
        k = split(linear(key, k_weight, k_bias))
        v = split(linear(value, v_weight, v_bias))
        if rotary is not None:
            k = apply_rotary(k, *rotary)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group of query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out, weights = attention(
        q, k, v, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal, dropout=dropout,
        training=training, need_weights=need_weights,
    )  # fmt: skip
    out = out.transpose(1, 2).reshape(b, t_q, out.shape[1] * out.shape[-1])  # (B, H, T, d) -> (B, T, H·d)
    out = linear(out, out_weight, out_bias)
    if weights is not None and average_attn_weights:
        weights = weights.mean(dim=1)
    return out, weights
