"""Static KV caches with row tables, and the one-query-per-row attention that reads and writes them in place."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from .rows import kernels_on

__all__ = ["StaticKVCache", "decode_attention"]


class StaticKVCache:
    """Keys and values of one attention layer, allocated once: (B, n_heads, capacity, head_dim) each (the
    key/value heads only, for grouped-query attention).

    ``length`` positions are filled; :func:`decode_attention` appends one position per step in place. ``dtype``:
    float32 or bfloat16 (keys and values rounded to it when written; the attention's arithmetic is float32).
    """

    def __init__(self, batch: int, n_heads: int, capacity: int, head_dim: int, *, dtype=torch.float32) -> None:
        self.k = torch.empty(batch, n_heads, capacity, head_dim, dtype=dtype)  # only [0, length) is ever read
        self.v = torch.empty_like(self.k)
        self.length = 0
        self.rows: Tensor | None = None  # (batch, capacity) int64 once reordered: the cache row of each key

    def fill(self, k: Tensor, v: Tensor) -> StaticKVCache:
        """Copy a prefix (B, H, T, hd) into positions [0, T) (converted to the cache's dtype); returns the cache."""
        t = k.shape[2]
        self.k[:, :, :t].copy_(k)
        self.v[:, :, :t].copy_(v)
        self.length = t
        return self

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
    """One query per row against cached keys/values: q (N, H·hd), k/v (B, H_kv, T_max, hd) -> (N, H·hd), H a
    multiple of H_kv (grouped-query attention: query head h reads key/value head h // (H / H_kv)). k and v are
    both float32 or both bfloat16 (read as float32; new keys/values rounded to bfloat16 when written); q float32.

    With ``new_k``/``new_v`` (N, H_kv·hd) they are first written at position ``length - 1`` of cache rows [0, N) (in
    place; N <= B, and N < B only through a row table). Attends to positions [0, length) except those ``mask``
    (N, T_max) bool marks True; scaled by 1/sqrt(hd). ``rows`` (N, T_max) int64: key j of query row n is in cache
    row ``rows[n, j]`` (a reordered beam's history, a row that outlived others, or the sentence whose memory the
    beams share); None: row n (N == B).
    """
    b, h_kv, _, hd = k.shape
    scale = 1.0 / math.sqrt(hd)
    if kernels_on():
        return kernels.ops().decode_attention(q, k, v, mask, length, scale, new_k, new_v, rows)
    n, h = q.shape[0], q.shape[1] // hd
    if new_k is not None:  # query row i writes cache row i
        k[:n, :, length - 1] = new_k.reshape(n, h_kv, hd)
        v[:n, :, length - 1] = new_v.reshape(n, h_kv, hd)
    k, v = k[:, :, :length].float(), v[:, :, :length].float()
    if rows is not None:  # (N, length, H, hd) gathered through the table, as (N, H, length, hd)
        at = torch.arange(length, device=k.device)
        k, v = (t.transpose(1, 2)[rows[:, :length], at].transpose(1, 2) for t in (k, v))
    if h != h_kv:
        k, v = k.repeat_interleave(h // h_kv, dim=1), v.repeat_interleave(h // h_kv, dim=1)
    am = None if mask is None else ~mask[:, None, None, :length]
    ctx = F.scaled_dot_product_attention(q.reshape(n, h, 1, hd), k, v, attn_mask=am, scale=scale)
    return ctx.reshape(n, h * hd)
