"""The prepared BERT-style encoder: one inference loop over post-norm encoder layers, whatever the weights' format.

Per layer: fused q|k|v linear, self-attention over the padded layout (the real tokens' rows scattered into it),
output projection, add & LayerNorm, fc1 with its activation, fc2, add & LayerNorm. The dense layers see the real
tokens only (packed rows), so a batch of mixed lengths costs the FLOPs of its real tokens.

A layer is a dict: ``qkv``, ``out``, ``fc1``, ``fc2`` — prepared linears of :mod:`sublayer.runtime.linear`'s call
protocol, ``lin(x (N, K), activation=None) -> (N, M)`` (float32 oneDNN panels :class:`~.linear.OneDNNLinear`, a
compute-dtype copy :class:`~.linear.DenseLinear`, int8 :class:`~.linear.Int8Linear`, or any object with that
call) — and ``norm1``, ``norm2``: ``(weight, bias, eps)`` float32. A linear may also fuse its epilogue with the next
linear's input preparation (the int8 ``linear_dynamic`` format does): it then has ``add_norm(h, resid, norm, *,
pre, nxt) -> (x, pre')`` and ``act(h, activation, *, pre, nxt) -> (y, pre')``, takes ``pre=`` in its call, and the
loop hands each ``pre'`` to the next linear (``None``: the linear prepares its input itself).

Attention: the fused ``qkv_self_attention`` kernel on float32 q|k|v (each sequence and head in L1, no (B, H, T, T)
scores; padded keys skipped, padded query rows zero), ``F.scaled_dot_product_attention`` otherwise (bf16, or the
kernels off). No autograd, no dropout: callers run it under :func:`sublayer.runtime.rows.inference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from .rows import add_norm, kernels_on

__all__ = ["run_layers", "attention"]


def attention(
    qkv: Tensor, index: Tensor | None, shape: tuple[int, int], pad: Tensor | None, heads: int, scale: float, *,
    buffer: Tensor | None = None, dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Self-attention of packed q|k|v rows: ``qkv`` (N, 3d), N = the real tokens, rows ``index`` of the padded
    (B·T) layout of ``shape`` (B, T); ``index`` None: every position (N = B·T, no padding). ``pad`` (B, T) bool
    True = padding, or None. ``dtype``: the attention's dtype (None: qkv's). ``buffer``: the zeroed (B·T, 3d)
    tensor of that dtype an earlier call returned (its padded rows stay zero), reused. Returns
    ``(ctx (N, d) in qkv's dtype, buffer)``."""
    (B, T), d = shape, qkv.shape[1] // 3
    dtype = qkv.dtype if dtype is None else dtype
    if index is None:
        full = qkv.to(dtype)
    else:  # padded rows stay zero: masked keys multiply zero weights and must hold no garbage
        buffer = qkv.new_zeros(B * T, 3 * d, dtype=dtype) if buffer is None else buffer
        full = buffer.index_copy_(0, index, qkv.to(dtype))
    if kernels_on() and dtype == torch.float32:
        ctx = kernels.ops().qkv_self_attention(full, pad, heads, T, scale)
    else:
        q, k, v = full.view(B, T, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        mask = None if pad is None else (~pad)[:, None, None, :]
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2).reshape(B * T, d)
    if index is not None:
        ctx = ctx.index_select(0, index)
    return ctx.to(qkv.dtype), buffer


def run_layers(
    x: Tensor, layers: list[dict], *, index: Tensor | None, shape: tuple[int, int], pad: Tensor | None, heads: int,
    scale: float, activation: str, attention_dtype: torch.dtype | None = None,
) -> Tensor:
    """The encoder layers on packed rows: ``x`` (N, d), the embeddings' output at the real tokens (rows ``index``
    of the padded (B·T) layout of ``shape`` (B, T); every position when ``index`` is None), ``pad`` (B, T) bool
    True = padding (None: none). Returns (N, d) in the dtype of the linears' outputs. ``attention_dtype``: the
    attention's dtype (None: q|k|v's)."""
    buffer, pre = None, None
    for i, L in enumerate(layers):
        qkv = L["qkv"](x) if pre is None else L["qkv"](x, pre=pre)
        ctx, buffer = attention(qkv, index, shape, pad, heads, scale, buffer=buffer, dtype=attention_dtype)
        x, pre = _add_norm(L["out"], ctx, x, L["norm1"], None, L["fc1"])
        h, pre = _act(L["fc1"], x, activation, pre, L["fc2"])
        nxt = layers[i + 1]["qkv"] if i + 1 < len(layers) else None
        x, pre = _add_norm(L["fc2"], h, x, L["norm2"], pre, nxt)
    return x


def _add_norm(lin, h: Tensor, resid: Tensor, norm: tuple, pre, nxt) -> tuple[Tensor, object]:
    """``LN(resid + lin(h))`` and the next linear's prepared input (None: it prepares its own)."""
    fused = getattr(lin, "add_norm", None)
    if fused is not None:
        return fused(h, resid, norm, pre=pre, nxt=nxt)
    x, _ = add_norm(resid, lin(h), *norm, want_sum=False)
    return x, None


def _act(lin, h: Tensor, activation: str, pre, nxt) -> tuple[Tensor, object]:
    fused = getattr(lin, "act", None)
    if fused is not None:
        return fused(h, activation, pre=pre, nxt=nxt)
    return lin(h, activation), None
