"""Padding-free execution: the real tokens of a padded batch as packed rows, and back.

A padded batch (B, T) with a ``key_padding_mask`` (True = padding) holds N <= B·T real tokens. Every position-wise
sub-layer (projections, FFN, Add & Norm, embeddings, LM head) gives the same numbers on the N real rows alone, so it
can run on a packed ``(N, D)`` tensor; only attention needs the (B, T) layout back. :class:`Packing` computes the
gather index once per forward and every layer reuses it (``pack`` / ``unpack`` are one ``index_select`` /
``index_copy`` each, both differentiable).

:func:`document_mask` turns ``position_ids`` that restart at 0 (several documents in one row, the convention of
Hugging Face's ``DataCollatorWithFlattening``) into a block-diagonal attention mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Packing", "document_mask"]


class _Gather(torch.autograd.Function):
    """``x.index_select(0, index)`` for unique indices: the backward writes rows back with ``index_copy``
    (autograd's generic ``index_add`` backward is a slow scatter-add on the CPU)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, rows: int) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows = rows
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return _Scatter.apply(grad, index, ctx.rows), None, None


class _Scatter(torch.autograd.Function):
    """Rows of x to ``index`` in a zero (rows, ...) tensor; the inverse of :class:`_Gather`."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, rows: int) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows = rows
        return x.new_zeros(rows, *x.shape[1:]).index_copy_(0, index, x.contiguous())

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return _Gather.apply(grad, index, ctx.rows), None, None


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
        if key_padding_mask is None:
            self.index = None
            self.n_tokens = self.batch * self.seq_len
        else:
            self.index = (~key_padding_mask).reshape(-1).nonzero().squeeze(1)
            self.n_tokens = int(self.index.numel())

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
        return flat if self.index is None else _Gather.apply(flat, self.index, flat.shape[0])

    def unpack(self, x: Tensor) -> Tensor:
        """(N, *rest) -> (B, T, *rest), zeros at the padded positions."""
        rest = x.shape[1:]
        if self.index is not None:
            x = _Scatter.apply(x, self.index, self.batch * self.seq_len)
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
