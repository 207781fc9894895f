"""Padding-free execution: the real tokens of a padded batch as packed rows, and back.

A padded batch (B, T) with a ``key_padding_mask`` (True = padding) holds N <= B·T real tokens. Every position-wise
sub-layer (projections, FFN, Add & Norm, embeddings, LM head) gives the same numbers on the N real rows alone, so it
can run on a packed ``(N, D)`` tensor; only attention needs the (B, T) layout back. :class:`Packing` computes the
gather index once per forward and every layer reuses it (``pack`` / ``unpack`` are one ``index_select`` /
``index_copy`` each, both differentiable).

:func:`document_mask` turns ``position_ids`` that restart at 0 (several documents in one row, the convention of
Hugging Face's ``DataCollatorWithFlattening``) into a block-diagonal attention mask.

:class:`PackedBatch` is the descriptor a model's forward passes through its blocks instead of the padded layout:
which positions run (as packed rows), which are padding (never attended), where packed documents start; attention
reads it (per sequence on the packed rows, or scattered back into the padded layout with its masks), every other
sub-layer is position-wise and takes the rows as they are. Its reference is :func:`sublayer.functional.attention`
on the padded layout with the same masks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check_choice
from .attention import causal_mask
from .fused import dropout as fused_dropout

__all__ = ["Packing", "PackedBatch", "document_mask"]


class _Move(torch.autograd.Function):
    """``x.index_select(0, index)`` for unique indices (gather), or rows of x to ``index`` in a zero (rows, ...)
    tensor (``scatter``, the inverse); the backward is the other direction (autograd's generic ``index_add``
    backward of a gather is a slow scatter-add on the CPU)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, rows: int, scatter: bool) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows, ctx.scatter = rows, scatter
        if scatter:
            return x.new_zeros(rows, *x.shape[1:]).index_copy_(0, index, x.contiguous())
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return _Move.apply(grad, index, ctx.rows, not ctx.scatter), None, None, None


class Packing:
    """The real-token rows of a padded batch.

    Args:
        key_padding_mask: (B, T) bool, True = padding; None = no padding (``pack``/``unpack`` only reshape).
        batch, seq_len: (B, T), needed when ``key_padding_mask`` is None.

    Attributes:
        key_padding_mask: as given. index: (N,) flat indices ``b·T + t`` of the real tokens in row-major order
        (None without padding). n_tokens: N.
    """

    def __init__(self, key_padding_mask: Tensor | None, *, batch: int | None = None, seq_len: int | None = None):
        if key_padding_mask is not None:
            batch, seq_len = key_padding_mask.shape
        if batch is None or seq_len is None:
            raise ValueError("Packing needs a key_padding_mask or both batch and seq_len")
        self.batch, self.seq_len = int(batch), int(seq_len)
        self.key_padding_mask = key_padding_mask
        self.index = None if key_padding_mask is None else (~key_padding_mask).reshape(-1).nonzero().squeeze(1)
        self.n_tokens = self.batch * self.seq_len if self.index is None else int(self.index.numel())

    def row_lengths(self) -> list[int]:
        """Real tokens of each row, B ints (the rows of row b are ``pack``'s consecutive rows)."""
        if self.key_padding_mask is None:
            return [self.seq_len] * self.batch
        return (~self.key_padding_mask).sum(1).tolist()

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, *rest) -> (N, *rest): the real rows (a (1, T) tensor is broadcast over the batch first)."""
        if x.shape[0] != self.batch:
            x = x.expand(self.batch, *x.shape[1:])
        flat = x.reshape(self.batch * self.seq_len, *x.shape[2:])
        return flat if self.index is None else _Move.apply(flat, self.index, flat.shape[0], False)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, *rest) -> (B, T, *rest), zeros at the padded positions."""
        rest = x.shape[1:]
        if self.index is not None:
            x = _Move.apply(x, self.index, self.batch * self.seq_len, True)
        return x.view(self.batch, self.seq_len, *rest)


def document_mask(position_ids: Tensor) -> Tensor | None:
    """Block-diagonal mask of packed documents, or None when every row holds one document.

    A document starts wherever ``position_ids`` is 0 (positions before a row's first 0 form one document).

    Args:
        position_ids: (B, T) or (1, T) integer positions.

    Returns:
        (B | 1, 1, T, T) bool, True = NOT allowed (key in another document): the ``attn_mask`` convention of
        :func:`sublayer.functional.attention`; combine it with ``is_causal`` for block-diagonal causal attention.
    """
    if position_ids.shape[-1] < 2 or not bool((position_ids[:, 1:] == 0).any()):
        return None
    doc = (position_ids == 0).cumsum(-1)  # (B|1, T) document number of each position
    return (doc[:, :, None] != doc[:, None, :])[:, None]


# ------------------------------------------------------------------------------------------ packed sequences
# Attention on packed rows takes one of two layouts: "varlen" (one attention per sequence, or per packed document,
# on the packed rows themselves) or "padded" (q/k/v scattered into (B, H, T, d_head) and masked as the padded path
# does); "auto" picks varlen for batches of at most VARLEN_MAX_ROWS rows: each per-sequence attention costs a few
# dispatches forward and backward, which a batch of many short rows does not repay; under CPU autocast (bf16
# attention, where each per-sequence call adds its casts) "auto" picks padded.
ATTENTION = "auto"
VARLEN_MAX_ROWS = 32


class PackedBatch:
    """A padded batch (B, T) whose positions run as packed rows (N, ...): the descriptor that flows through a
    model's forward in place of the padded layout (cu_seqlens-style, as varlen attention kernels take it).

    Position-wise sub-layers (projections, FFN, norms, embeddings, LM head) take the packed rows as they are;
    attention reads this descriptor (:meth:`self_attention`, :meth:`cross_attention`).

    Args:
        key_padding_mask: (B, T) bool, True = padding: keys nobody attends to. None: no padding.
        rows: (B, T) bool, True = the position runs as a packed row. None: every non-padded position. A position
            may run without being a key (e.g. a padded position whose output a loss reads): it then attends as it
            would in the padded layout.
        position_ids: (B | 1, T) positions; a restart at 0 inside a row starts a new document (packed documents,
            HF's ``DataCollatorWithFlattening``): attention is then block-diagonal, each document sees only itself.
        batch, seq_len: (B, T), needed when neither mask is given.
        attention: the layout attention takes (see :data:`ATTENTION`): ``"auto"``, ``"varlen"`` or ``"padded"``;
            None: :data:`ATTENTION`'s value at each call.

    Attributes:
        packing: the :class:`Packing` of the rows (``pack`` / ``unpack``). n_rows: N. key_padding_mask.
        documents: (B | 1, 1, T, T) bool mask of other documents (True = other document), or None.
    """

    def __init__(
        self,
        key_padding_mask: Tensor | None = None,
        *,
        rows: Tensor | None = None,
        position_ids: Tensor | None = None,
        batch: int | None = None,
        seq_len: int | None = None,
        attention: str | None = None,
    ) -> None:
        if attention is not None:
            check_choice("attention", attention, ("auto", "varlen", "padded"))
        self.attention = attention
        if key_padding_mask is not None and not bool(key_padding_mask.any()):
            key_padding_mask = None  # an all-False mask is no mask
        self.key_padding_mask = key_padding_mask
        skip = key_padding_mask if rows is None else (None if bool(rows.all()) else ~rows)  # positions that do not run
        self.packing = Packing(skip, batch=batch, seq_len=seq_len)
        self.batch, self.seq_len = self.packing.batch, self.packing.seq_len
        self.n_rows = self.packing.n_tokens
        self.position_ids = position_ids
        self.documents = None if position_ids is None else document_mask(position_ids)
        # the rows of a sequence are exactly its keys: attention can run per sequence on the packed rows
        self._rows_are_keys = rows is None or (
            bool((rows == ~key_padding_mask).all()) if key_padding_mask is not None else bool(rows.all())
        )
        self._masks: dict = {}  # built once per forward, shared by every layer

    def pack(self, x: Tensor) -> Tensor:
        """(B | 1, T, ...) -> (N, ...)."""
        return self.packing.pack(x)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, ...) -> (B, T, ...), zeros at the positions that did not run."""
        return self.packing.unpack(x)

    def varlen(self) -> bool:
        """Whether attention runs per sequence on the packed rows (else: scattered into the padded layout)."""
        if not self._rows_are_keys:
            return False
        layout = ATTENTION if self.attention is None else self.attention
        if layout == "auto":
            return self.batch <= VARLEN_MAX_ROWS and not torch.is_autocast_enabled("cpu")
        return layout == "varlen"

    def _segments(self) -> list[int]:
        """Rows of each (sequence, document) run of the packed rows, in order."""
        if self.documents is None:
            return self.packing.row_lengths()
        b, t = self.batch, self.seq_len
        pos = self.position_ids.expand(b, t)
        doc = (pos == 0).cumsum(-1) + torch.arange(b, device=pos.device)[:, None] * (t + 1)
        return torch.unique_consecutive(self.pack(doc), return_counts=True)[1].tolist()

    def _self_mask(self, causal: bool, device) -> _Segments | _AttentionMask:
        key = ("self", causal)
        if key not in self._masks:
            self._masks[key] = (_Segments(self._segments(), causal=causal, device=device) if self.varlen()
                                else _AttentionMask(self, self, causal=causal, docs=self.documents, device=device))
        return self._masks[key]

    def self_attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, dropout: float = 0.0) -> Tensor:
        """Self-attention of packed rows: q, k, v (N, H, d_head) -> (N, H, d_head), scaled by 1/sqrt(d_head).

        Each row attends to the keys of its own sequence (and document) that are not padding, causally when
        ``causal``; a row with no key gets zeros. ``dropout`` on the weights (training), Philox.
        """
        return _attend(q, k, v, self, self._self_mask(causal, q.device), dropout)

    def cross_attention(self, q: Tensor, k: Tensor, v: Tensor, memory: PackedBatch, *, dropout: float = 0.0) -> Tensor:
        """Cross-attention of these packed rows q (N, H, d) on ``memory``'s packed rows k, v (N_m, H, d)."""
        key = ("cross", id(memory))
        if key not in self._masks:
            self._masks[key] = (_Segments(self.packing.row_lengths(), memory.packing.row_lengths())
                                if self.varlen() and memory.varlen() else _AttentionMask(self, memory, device=q.device))
        return _attend(q, k, v, self, self._masks[key], dropout)


class _AttentionMask:
    """The padded layout's mask for one attention kind: (B|1, 1, T_q|1, T_k) bool ``blocked`` (True = may not
    attend; rows that see no key opened, and zeroed after through ``dead``)."""

    def __init__(self, queries: PackedBatch, keys: PackedBatch, *, causal=False, docs=None, device=None) -> None:
        self.keys = keys
        kpm, t_q, t_k = keys.key_padding_mask, queries.seq_len, keys.seq_len
        allowed = None if kpm is None else ~kpm[:, None, None, :]
        if causal:
            c = causal_mask(t_q, t_k, device=device)[None, None]
            allowed = c if allowed is None else allowed & c
        if docs is not None:
            allowed = ~docs if allowed is None else allowed & ~docs
        self.dead = None
        if allowed is not None:
            dead = ~allowed.any(dim=-1, keepdim=True)
            if bool(dead.any()):
                self.dead, allowed = dead, allowed | dead
        self.blocked = None if allowed is None else ~allowed
        self._bias: dict = {}

    def bias(self, dtype: torch.dtype) -> Tensor:
        """``blocked`` as an additive mask of ``dtype``: -inf where blocked, 0 elsewhere (built once per dtype; adding
        it gives masked_fill's scores exactly, in place, with a pass-through backward)."""
        if dtype not in self._bias:
            zeros = torch.zeros(self.blocked.shape, dtype=dtype, device=self.blocked.device)
            self._bias[dtype] = zeros.masked_fill_(self.blocked, float("-inf"))
        return self._bias[dtype]


class _Segments:
    """Varlen attention: consecutive segments of packed rows that attend only inside themselves."""

    def __init__(self, q_lengths: list[int], k_lengths: list[int] | None = None, *, causal=False, device=None):
        self.q_lengths = q_lengths
        self.k_lengths = q_lengths if k_lengths is None else k_lengths
        self.causal = causal
        t = max(self.q_lengths, default=0)
        self.blocked = ~causal_mask(t, t, device=device) if causal else None


def _core(
    q: Tensor, k: Tensor, v: Tensor, p: float, blocked: Tensor | None, mask: _AttentionMask | None = None
) -> Tensor:
    """softmax(q k^T / sqrt(d) masked) v over the last two dims; Philox dropout p on the weights. ``mask``: the
    :class:`_AttentionMask` whose ``blocked`` this is (its additive form replaces masked_fill)."""
    if p > 0:  # explicit: eager SDPA with dropout takes its math path and bernoulli_, several times slower here
        s = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-2, -1))
        if mask is not None and blocked is not None:
            s = s.add_(mask.bias(s.dtype))  # in place on the fresh scores: the values of masked_fill(-inf)
        elif blocked is not None:
            s = s.masked_fill(blocked, float("-inf"))
        return torch.matmul(fused_dropout(s.softmax(dim=-1), p, True), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if blocked is None else ~blocked)


def _attend(q: Tensor, k: Tensor, v: Tensor, queries: PackedBatch, mask, p: float) -> Tensor:
    if q.shape[0] == 0:  # nothing runs (a batch of padding only)
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    if isinstance(mask, _Segments):
        outs = []
        for qb, kb, vb in zip(q.split(mask.q_lengths), k.split(mask.k_lengths), v.split(mask.k_lengths)):
            lq, lk = qb.shape[0], kb.shape[0]
            if lq == 0:
                continue
            if lk == 0:  # no key to attend to: zeros, as the padded layout's dead rows
                outs.append(qb.new_zeros(lq, qb.shape[1], vb.shape[-1]))
                continue
            # (1, H, L, d): SDPA's CPU flash kernel takes 4-D inputs only (3-D ones run its slower math path)
            qb, kb, vb = qb.transpose(0, 1)[None], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None]
            if p == 0 and mask.causal:
                ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
            else:
                ob = _core(qb, kb, vb, p, None if mask.blocked is None else mask.blocked[:lq, :lk])
            outs.append(ob[0].transpose(0, 1))
        return torch.cat(outs, 0)
    keys = mask.keys

    def heads(x: Tensor, pk: PackedBatch) -> Tensor:  # (N, H, d) -> (B, H, T, d)
        return pk.unpack(x).transpose(1, 2)

    out = _core(heads(q, queries), heads(k, keys), heads(v, keys), p, mask.blocked, mask)
    if mask.dead is not None:
        out = out.masked_fill(mask.dead, 0.0)
    return queries.pack(out.transpose(1, 2))  # (B, T, H, d) -> (N, H, d)
