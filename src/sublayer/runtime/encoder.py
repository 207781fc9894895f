"""The prepared encoder: one inference loop over post-norm (BERT's) or pre-norm layers, whatever the weights' format.

Per layer: fused q|k|v linear, self-attention on the packed rows (below), output projection, add & LayerNorm, fc1
with its activation, fc2, add & LayerNorm (pre-norm: each LayerNorm before its sublayer). The dense layers see the
real tokens only (packed rows), so a batch of mixed lengths costs the FLOPs of its real tokens.

A layer is a dict: ``qkv``, ``out``, ``fc1``, ``fc2`` — prepared linears of :mod:`sublayer.runtime.linear`'s call
protocol, ``lin(x (N, K), activation=None) -> (N, M)`` (float32 / bf16 oneDNN panels :class:`~.linear.OneDNNLinear`,
a compute-dtype copy :class:`~.linear.DenseLinear`, int8 :class:`~.linear.Int8Linear`, or any object with that
call) — and ``norm1``, ``norm2``: ``(weight, bias, eps)`` float32. A linear may also fuse its epilogue with the next
linear's input preparation (the int8 ``linear_dynamic`` format does): it then has ``add_norm(h, resid, norm, *,
pre, nxt) -> (x, pre')`` and ``act(h, activation, *, pre, nxt) -> (y, pre')``, takes ``pre=`` in its call, and the
loop hands each ``pre'`` to the next linear (``None``: the linear prepares its input itself).

Attention runs on the packed rows, one call per run of consecutive sequences of one length (:func:`runs`; no
padding multiplied, nothing scattered into a padded layout): in bf16 the ``packed_self_attention`` kernel, one call
for all runs (bf16 q|k|v and probabilities, float32 scores, softmax and sums; vdpbf16ps where the CPU has
AVX512_BF16), in float32 the same kernel in float32 products where the CPU has AVX-512 (else the fused
``qkv_self_attention`` kernel per run: each sequence and head in L1, no (B, H, T, T) scores),
``F.scaled_dot_product_attention`` with the kernels off. No autograd, no dropout: callers run it under
:func:`sublayer.runtime.rows.inference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from .rows import kernels_on, layer_norm, residual_out

__all__ = ["run_layers", "attention", "runs"]


def runs(pad: Tensor | None, shape: tuple[int, int]) -> list[tuple[int, int, int]]:
    """The packed rows as runs of consecutive sequences of one length: ``(first row, sequences, length)`` each, in
    order (rows of padding only hold no row and start no run). ``pad`` (B, T) bool True = padding, or None."""
    B, T = shape
    out: list[list[int]] = []
    row = 0
    for n in [T] * B if pad is None else (~pad).sum(1).tolist():
        if n and out and out[-1][2] == n:
            out[-1][1] += 1
        elif n:
            out.append([row, 1, n])
        row += n
    return [tuple(r) for r in out]


def attention(qkv: Tensor, segments: list[tuple[int, int, int]], heads: int, scale: float, *,
              dtype: torch.dtype | None = None, split_probs: bool = True) -> Tensor:  # fmt: skip
    """Self-attention of packed q|k|v rows, each sequence on its own rows: ``qkv`` (N, 3d), ``segments`` from
    :func:`runs` (no padding multiplied, nothing scattered). ``dtype``: the attention's dtype (None: qkv's; bf16
    with the kernels on: ``packed_self_attention``, one call for all runs, float32 or bf16 q|k|v; float32 with its
    AVX-512 kernels on: the same call in float32 products).
    ``split_probs``: that kernel's probabilities as two bf16 parts (about float32's accuracy) rather than one
    (bf16's; the P v products cost half). Returns ctx (N, d) in qkv's dtype."""
    d = qkv.shape[1] // 3
    dtype = qkv.dtype if dtype is None else dtype
    if kernels_on() and qkv.dtype in (torch.float32, torch.bfloat16) and (
        dtype == torch.bfloat16 or (dtype == qkv.dtype == torch.float32 and kernels.ops().packed_attention_avx512(-1))
    ):
        table = torch.tensor(segments, dtype=torch.int64).reshape(-1, 3)
        return kernels.ops().packed_self_attention(qkv.contiguous(), table, heads, scale, qkv.dtype, split_probs,
                                                   dtype == torch.float32)  # fmt: skip
    x = qkv.to(dtype)
    kernel = kernels_on() and dtype == torch.float32
    out = None if len(segments) == 1 else qkv.new_empty(qkv.shape[0], d, dtype=dtype)
    for row, count, n in segments:
        part = x[row : row + count * n]
        if kernel:
            ctx = kernels.ops().qkv_self_attention(part, None, heads, n, scale)
        else:
            q, k, v = part.view(count, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            ctx = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).reshape(count * n, d)
        if out is None:
            return ctx.to(qkv.dtype)
        out[row : row + count * n] = ctx
    return out.to(qkv.dtype)


def run_layers(
    x: Tensor, layers: list[dict], *, pad: Tensor | None, shape: tuple[int, int], heads: int, scale: float,
    activation: str, attention_dtype: torch.dtype | None = None, split_probs: bool = True,
    queries: Tensor | None = None, norm_first: bool = False, final: tuple | None = None,
) -> Tensor:
    """The encoder layers on packed rows: ``x`` (N, d), the embeddings' output at the real tokens of a padded
    batch of ``shape`` (B, T) in row-major order, ``pad`` (B, T) bool True = padding (None: none). Returns (N, d)
    in the dtype of the linears' outputs. ``attention_dtype``: the attention's dtype (None: q|k|v's);
    ``split_probs`` as :func:`attention`'s. ``activation``: the FFN activation of a layer without its own ``act``.

    ``queries`` (E,) long: the sequences of E query-only rows appended to ``x`` ((N + E, d) in and out): padded
    positions whose output is read (a pooler's position 0 under left padding). Each attends to its sequence's
    real tokens, as in the padded layout, without being a key.

    ``norm_first``: pre-norm layers (``norm1`` / ``norm2`` before the attention / the FFN; linears without
    ``add_norm``), each closing add fused with the norm that follows. ``final``: the stack's last norm, or None."""
    segments, pre = runs(pad, shape), None
    n = x.shape[0] if queries is None else x.shape[0] - queries.numel()
    keys = None if queries is None else _query_keys(pad, queries)
    h = layer_norm(x, *layers[0]["norm1"]) if norm_first else x
    following = [(M["qkv"], M["norm1"]) for M in layers[1:]] + [(None, final)]  # the next linear and norm
    # each big temporary is freed (del) before the next product allocates: it then takes the freed memory, where a
    # held one would make the allocator map fresh pages for the kernel to fault on
    for L, (nxt, after) in zip(layers, following):
        qkv = L["qkv"](h) if pre is None else L["qkv"](h, pre=pre)
        ctx = attention(qkv[:n], segments, heads, scale, dtype=attention_dtype, split_probs=split_probs)
        if keys is not None:
            ctx = torch.cat([ctx, _query_attention(qkv, n, keys, heads, scale, attention_dtype)])
        del qkv
        x, h, pre = _add_norm(L["out"], ctx, x, L["norm1"], None, L["fc1"], norm_first, L["norm2"])
        del ctx
        f, pre = _act(L["fc1"], h, L.get("act", activation), pre, L["fc2"])
        x, h, pre = _add_norm(L["fc2"], f, x, L["norm2"], pre, nxt, norm_first, after)
        del f
    return layer_norm(h, *final) if final is not None and not norm_first else h


def _query_keys(pad: Tensor, queries: Tensor) -> tuple[Tensor, Tensor]:
    """For each query-only row of :func:`run_layers`: the rows of its sequence's keys (E, L), clamped to a row of
    the N + E, and which of them are keys (E, L) bool."""
    lengths = (~pad).sum(1)
    starts = lengths.cumsum(0) - lengths
    n, first = lengths[queries], starts[queries]
    span = torch.arange(max(int(n.max()), 1))
    return (first[:, None] + span).clamp(max=int(lengths.sum()) + queries.numel() - 1), span < n[:, None]


def _query_attention(qkv: Tensor, n: int, keys: tuple[Tensor, Tensor], heads: int, scale: float,
                     dtype: torch.dtype | None) -> Tensor:  # fmt: skip
    """ctx (E, d) of the query-only rows ``qkv[n:]`` on their sequences' keys; zeros for a sequence without any."""
    rows, allowed = keys
    x = qkv if dtype is None else qkv.to(dtype)
    d = x.shape[1] // 3
    e, length = rows.shape
    q = x[n:, :d].view(e, 1, heads, d // heads).transpose(1, 2)
    k, v = x[rows.reshape(-1), d:].view(e, length, 2, heads, d // heads).permute(2, 0, 3, 1, 4)
    dead = ~allowed.any(1)
    mask = (allowed | dead[:, None])[:, None, None, :]
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2).reshape(e, d)
    return ctx.masked_fill(dead[:, None], 0.0).to(qkv.dtype)


def _add_norm(lin, h: Tensor, resid: Tensor, norm: tuple, pre, nxt, norm_first: bool, after) -> tuple:
    """``(x, h)`` of :func:`~.rows.residual_out` (post-norm: both ``LN(resid + lin(h))``) and the next linear's
    prepared input (None: it prepares its own)."""
    fused = getattr(lin, "add_norm", None)
    if fused is not None:  # post-norm
        x, pre = fused(h, resid, norm, pre=pre, nxt=nxt)
        return x, x, pre
    return *residual_out(norm_first, resid, lin(h), norm, after), None


def _act(lin, h: Tensor, activation: str, pre, nxt) -> tuple[Tensor, object]:
    fused = getattr(lin, "act", None)
    if fused is not None:
        return fused(h, activation, pre=pre, nxt=nxt)
    return lin(h, activation), None
