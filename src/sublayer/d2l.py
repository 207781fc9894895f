"""``sublayer.d2l``: the classes of d2l.ai's Transformer chapter (Dive into Deep Learning 1.x, PyTorch tab), with
the book's signatures, attribute names and semantics, running on sublayer's modules and kernels.

The book's cells run with this module in place of ``from d2l import torch as d2l`` (the chapter's helpers
``d2l.ones``, ``d2l.tensor``, ``d2l.check_shape`` are here too) or with the classes imported from it::

    from sublayer import d2l
    ffn = d2l.PositionWiseFFN(4, 8); ffn.eval()
    ffn(d2l.ones((2, 3, 4)))[0].shape   # torch.Size([3, 8]), as in the book

What the book's classes are made of here:

==========================  ===============================================  ==========================================
book                        here                                             book parameter names (state dicts load)
==========================  ===============================================  ==========================================
``PositionWiseFFN``         :class:`sublayer.PositionWiseFFN` (lazy input)   ``dense1`` -> ``fc1``, ``dense2`` -> ``fc2``
``AddNorm``                 :class:`sublayer.AddNorm` (fused add + norm)     ``ln`` -> ``norm``
``MultiHeadAttention``      :class:`sublayer.MultiHeadAttention`             ``W_q/W_k/W_v/W_o`` -> ``q/k/v/out_proj``
``PositionalEncoding``      the book's table (fp32 arithmetic, as printed)   (not in the state dict, as in the book)
==========================  ===============================================  ==========================================

The blocks and stacks (``TransformerEncoderBlock``, ``TransformerEncoder``, ``TransformerDecoderBlock``,
``TransformerDecoder``) are the book's wiring of those modules, attribute for attribute, so a state dict saved from
the book's classes loads here (``load_state_dict`` renames the book's parameter names), and every number equals the
book's within fp32 rounding (tests/test_d2l.py checks forward and backward against a transcription of the book).

``valid_lens`` are read as the book's ``masked_softmax`` reads them: 1-D (batch,) — the first ``valid_lens[b]``
keys of sequence ``b`` are attended to — or 2-D (batch, queries) — per query. One deliberate difference: a row with
no valid key (valid length 0) gives zeros here, where the book's ``-1e6`` fill averages all keys uniformly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import nn as snn
from ._checks import check_tensor

__all__ = [
    "AddNorm",
    "MultiHeadAttention",
    "PositionWiseFFN",
    "PositionalEncoding",
    "TransformerDecoder",
    "TransformerDecoderBlock",
    "TransformerEncoder",
    "TransformerEncoderBlock",
    "check_shape",
    "ones",
    "show_heatmaps",
    "tensor",
    "valid_lens_masks",
]

ones = torch.ones
tensor = torch.tensor


def check_shape(a: Tensor, shape: tuple[int, ...]) -> None:
    """The book's shape check.

    Raises:
        ValueError: ``a.shape != shape`` (both named).
    """
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"tensor's shape {tuple(a.shape)} != expected shape {tuple(shape)}")


def show_heatmaps(matrices, xlabel, ylabel, titles=None, figsize=(2.5, 2.5), cmap="Reds"):
    """The book's heatmap grid, drawn by :func:`sublayer.plot.attention`: ``matrices`` (rows, columns, queries,
    keys), one column title per entry of ``titles``; returns the matplotlib ``Figure``."""
    from . import plot

    fig = plot.attention(matrices, xlabel=xlabel, ylabel=ylabel, cmap=cmap)
    fig.set_size_inches(*figsize)
    if titles is not None:
        for ax in fig.get_axes()[: -1]:  # the last axes is the colour bar
            ax.set_title(titles[ax.get_subplotspec().colspan.start], fontsize=8)
    return fig


def valid_lens_masks(
    valid_lens: Tensor | None, batch: int, n_queries: int, n_keys: int
) -> tuple[Tensor | None, Tensor | None]:
    """The book's ``valid_lens`` as sublayer masks (True = masked): ``(key_padding_mask, attn_mask)``.

    Args:
        valid_lens: None, (batch,) valid keys per sequence, or (batch, n_queries) valid keys per query.

    Returns:
        1-D: ``(key_padding_mask (batch, n_keys), None)``; 2-D: ``(None, attn_mask (batch, 1, n_queries,
        n_keys))``; None: ``(None, None)``.

    Raises:
        TypeError: not a tensor. ValueError: another rank or shape (expected and got named).
    """
    if valid_lens is None:
        return None, None
    check_tensor("valid_lens", valid_lens)
    keys = torch.arange(n_keys, device=valid_lens.device)
    if valid_lens.dim() == 1:
        if valid_lens.shape[0] != batch:
            raise ValueError(f"valid_lens (1-D) must have shape ({batch},), got {tuple(valid_lens.shape)}")
        return keys[None, :] >= valid_lens[:, None], None
    if valid_lens.dim() == 2:
        if tuple(valid_lens.shape) != (batch, n_queries):
            raise ValueError(
                f"valid_lens (2-D) must have shape (batch, queries) = ({batch}, {n_queries}), "
                f"got {tuple(valid_lens.shape)}"
            )
        return None, keys[None, None, None, :] >= valid_lens[:, None, :, None]
    raise ValueError(f"valid_lens must be 1-D (batch,) or 2-D (batch, queries), got shape {tuple(valid_lens.shape)}")


def _rename_book_keys(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    # load_state_dict pre-hook: the book's parameter names -> ours, so the book's state dicts load here
    for book, ours in module._book_names.items():
        head = prefix + book + "."
        for key in [k for k in state_dict if k.startswith(head)]:
            state_dict[prefix + ours + "." + key[len(head):]] = state_dict.pop(key)


class PositionWiseFFN(snn.PositionWiseFFN):
    """The book's positionwise FFN: ``dense2(relu(dense1(X)))``, input size inferred at the first call.

    Args:
        ffn_num_hiddens: hidden size. ffn_num_outputs: output size.

    Shape:
        X (..., any) -> (..., ffn_num_outputs).
    """

    _book_names = {"dense1": "fc1", "dense2": "fc2"}

    def __init__(self, ffn_num_hiddens: int, ffn_num_outputs: int) -> None:
        super().__init__(None, ffn_num_hiddens, d_out=ffn_num_outputs)
        self.register_load_state_dict_pre_hook(_rename_book_keys)

    def _materialize(self, num_inputs: int) -> PositionWiseFFN:
        # in the book's blocks the input size is known: make the lazy layer real at once (a LazyLinear cannot be
        # deep-copied or wrapped by DDP before its first call)
        self.fc1(torch.zeros(0, num_inputs))
        self.d_model = num_inputs
        return self

    @property
    def dense1(self) -> nn.Module:
        return self.fc1

    @property
    def dense2(self) -> nn.Module:
        return self.fc2


class AddNorm(snn.AddNorm):
    """The book's residual connection followed by layer normalization: ``ln(dropout(Y) + X)``.

    Args:
        norm_shape: the normalized trailing shape. dropout: on ``Y`` in training.
    """

    _book_names = {"ln": "norm"}

    def __init__(self, norm_shape, dropout: float) -> None:
        super().__init__(norm_shape, dropout)
        self.register_load_state_dict_pre_hook(_rename_book_keys)

    @property
    def ln(self) -> nn.Module:
        return self.norm


class MultiHeadAttention(snn.MultiHeadAttention):
    """The book's multi-head attention: ``forward(queries, keys, values, valid_lens)``, recording
    ``attention_weights`` (batch·num_heads, queries, keys) as the book's ``DotProductAttention`` does (before
    dropout in eval; in training the weights that were applied).

    Args:
        num_hiddens: the model size (queries, keys and values must have it: the book infers it lazily).
        num_heads: heads. dropout: on the attention weights. bias: biases on the four projections.

    Shape:
        queries (B, T_q, num_hiddens), keys/values (B, T_k, num_hiddens), valid_lens None, (B,) or (B, T_q)
        -> (B, T_q, num_hiddens).
    """

    _book_names = {"W_q": "q_proj", "W_k": "k_proj", "W_v": "v_proj", "W_o": "out_proj"}

    def __init__(self, num_hiddens: int, num_heads: int, dropout: float, bias: bool = False, **kwargs) -> None:
        super().__init__(num_hiddens, num_heads, dropout=dropout, bias=bias, **kwargs)
        self.num_heads = num_heads
        self.attention_weights: Tensor | None = None
        self.register_load_state_dict_pre_hook(_rename_book_keys)

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None) -> Tensor:
        check_tensor("queries", queries)
        check_tensor("keys", keys)
        b, t_q, t_k = queries.shape[0], queries.shape[1], keys.shape[1]
        kpm, mask = valid_lens_masks(valid_lens, b, t_q, t_k)
        out, w = super().forward(
            queries, keys, values, key_padding_mask=kpm, attn_mask=mask, need_weights=True, average_attn_weights=False
        )
        self.attention_weights = w.reshape(b * self.num_heads, t_q, t_k)  # the book's (B·H, T_q, T_k) layout
        return out


class PositionalEncoding(nn.Module):
    """The book's sinusoidal positional encoding: ``dropout(X + P[:, :T])``, ``P[t, 2i] = sin(t / 10000^(2i/d))``,
    ``P[t, 2i+1] = cos(...)``, computed in fp32 the book's way (so the numbers are the book's).

    Args:
        num_hiddens: the feature size (odd sizes drop the last cosine column). dropout: after the sum.
        max_len: the longest sequence.

    Shape:
        X (B, T, num_hiddens), T <= max_len -> same.
    """

    def __init__(self, num_hiddens: int, dropout: float, max_len: int = 1000) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        pos = torch.arange(max_len, dtype=torch.float32).reshape(-1, 1)
        angle = pos / torch.pow(10000, torch.arange(0, num_hiddens, 2, dtype=torch.float32) / num_hiddens)
        P = torch.zeros((1, max_len, num_hiddens))
        P[:, :, 0::2] = torch.sin(angle)
        P[:, :, 1::2] = torch.cos(angle)[:, : num_hiddens // 2]
        self.register_buffer("P", P, persistent=False)  # moves with .to(); not in the state dict (as the book)

    def forward(self, X: Tensor) -> Tensor:
        if X.shape[1] > self.P.shape[1]:
            raise ValueError(f"X has {X.shape[1]} positions, more than max_len ({self.P.shape[1]})")
        return self.dropout(X + self.P[:, : X.shape[1], :].to(X.dtype))


class TransformerEncoderBlock(nn.Module):
    """The book's Transformer encoder block: ``Y = addnorm1(X, attention(X, X, X, valid_lens))``,
    ``addnorm2(Y, ffn(Y))`` (post-norm; the attention has no biases unless ``use_bias``).

    Shape:
        X (B, T, num_hiddens), valid_lens None, (B,) or (B, T) -> (B, T, num_hiddens).
    """

    def __init__(
        self, num_hiddens: int, ffn_num_hiddens: int, num_heads: int, dropout: float, use_bias: bool = False
    ) -> None:
        super().__init__()
        self.attention = MultiHeadAttention(num_hiddens, num_heads, dropout, use_bias)
        self.addnorm1 = AddNorm(num_hiddens, dropout)
        self.ffn = PositionWiseFFN(ffn_num_hiddens, num_hiddens)._materialize(num_hiddens)
        self.addnorm2 = AddNorm(num_hiddens, dropout)

    def forward(self, X: Tensor, valid_lens: Tensor | None) -> Tensor:
        Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
        return self.addnorm2(Y, self.ffn(Y))


def _embed_and_blocks(stack: nn.Module, vocab_size: int, num_hiddens: int, dropout: float, num_blks: int, block):
    """The book's stack attributes, made in its order: ``embedding``, ``pos_encoding``, ``blks`` (``block(i)``
    named ``block{i}``)."""
    stack.num_hiddens = num_hiddens
    stack.embedding = nn.Embedding(vocab_size, num_hiddens)
    stack.pos_encoding = PositionalEncoding(num_hiddens, dropout)
    stack.blks = nn.Sequential()
    for i in range(num_blks):
        stack.blks.add_module("block" + str(i), block(i))


class TransformerEncoder(nn.Module):
    """The book's Transformer encoder: embeddings scaled by sqrt(num_hiddens) plus :class:`PositionalEncoding`,
    then ``num_blks`` :class:`TransformerEncoderBlock` s (``blks.block0`` ...). After a call,
    ``attention_weights[i]`` is block ``i``'s (B·num_heads, T, T) self-attention.

    Shape:
        X (B, T) token ids, valid_lens None, (B,) or (B, T) -> (B, T, num_hiddens).
    """

    def __init__(self, vocab_size: int, num_hiddens: int, ffn_num_hiddens: int, num_heads: int, num_blks: int,
                 dropout: float, use_bias: bool = False) -> None:  # fmt: skip
        super().__init__()
        _embed_and_blocks(self, vocab_size, num_hiddens, dropout, num_blks,
                          lambda i: TransformerEncoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias))
        self.attention_weights: list[Tensor | None] = [None] * num_blks

    def forward(self, X: Tensor, valid_lens: Tensor | None, *args) -> Tensor:
        # positional encodings are in [-1, 1]: the embeddings are scaled up by sqrt(num_hiddens) before the sum
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        self.attention_weights = [None] * len(self.blks)
        for i, blk in enumerate(self.blks):
            X = blk(X, valid_lens)
            self.attention_weights[i] = blk.attention.attention_weights
        return X


class TransformerDecoderBlock(nn.Module):
    """The book's ``i``-th Transformer decoder block, with its state protocol.

    ``state = [enc_outputs, enc_valid_lens, [keys_so_far per block]]``. The block's self-attention attends to
    ``key_values``: ``X`` itself when ``state[2][i]`` is None, else the previous ``key_values`` followed by ``X``
    (token-by-token prediction); ``state[2][i]`` is then set to it. In training the self-attention is causal
    (``dec_valid_lens = [1, ..., T]`` per row); in eval it is not masked (the book decodes one token at a time).

    Shape:
        X (B, T, num_hiddens) -> ``(output (B, T, num_hiddens), state)``.
    """

    def __init__(self, num_hiddens: int, ffn_num_hiddens: int, num_heads: int, dropout: float, i: int) -> None:
        super().__init__()
        self.i = i
        self.attention1 = MultiHeadAttention(num_hiddens, num_heads, dropout)
        self.addnorm1 = AddNorm(num_hiddens, dropout)
        self.attention2 = MultiHeadAttention(num_hiddens, num_heads, dropout)
        self.addnorm2 = AddNorm(num_hiddens, dropout)
        self.ffn = PositionWiseFFN(ffn_num_hiddens, num_hiddens)._materialize(num_hiddens)
        self.addnorm3 = AddNorm(num_hiddens, dropout)

    def forward(self, X: Tensor, state: list) -> tuple[Tensor, list]:
        enc_outputs, enc_valid_lens = state[0], state[1]
        if state[2][self.i] is None:
            key_values = X
        else:
            key_values = torch.cat((state[2][self.i], X), dim=1)
        state[2][self.i] = key_values
        if self.training:
            batch_size, num_steps, _ = X.shape
            # (batch_size, num_steps), every row [1, 2, ..., num_steps]: query t sees keys 0..t
            dec_valid_lens = torch.arange(1, num_steps + 1, device=X.device).repeat(batch_size, 1)
        else:
            dec_valid_lens = None
        X2 = self.attention1(X, key_values, key_values, dec_valid_lens)
        Y = self.addnorm1(X, X2)
        Y2 = self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens)
        Z = self.addnorm2(Y, Y2)
        return self.addnorm3(Z, self.ffn(Z)), state


class TransformerDecoder(nn.Module):
    """The book's Transformer decoder: embeddings scaled by sqrt(num_hiddens) plus :class:`PositionalEncoding`,
    ``num_blks`` :class:`TransformerDecoderBlock` s, then ``dense`` to the vocabulary.

    ``init_state(enc_outputs, enc_valid_lens)`` gives ``[enc_outputs, enc_valid_lens, [None] * num_blks]``.
    After a call, ``attention_weights`` is ``[self-attention per block, encoder-decoder attention per block]``,
    each (B·num_heads, T, keys).

    Shape:
        X (B, T) token ids -> ``(logits (B, T, vocab_size), state)``.
    """

    def __init__(
        self, vocab_size: int, num_hiddens: int, ffn_num_hiddens: int, num_heads: int, num_blks: int, dropout: float
    ) -> None:
        super().__init__()
        self.num_blks = num_blks
        _embed_and_blocks(self, vocab_size, num_hiddens, dropout, num_blks,
                          lambda i: TransformerDecoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, i))
        self.dense = nn.Linear(num_hiddens, vocab_size)
        self._attention_weights: list[list[Tensor | None]] = [[None] * num_blks for _ in range(2)]

    def init_state(self, enc_outputs: Tensor, enc_valid_lens: Tensor | None, *args) -> list:
        return [enc_outputs, enc_valid_lens, [None] * self.num_blks]

    def forward(self, X: Tensor, state: list) -> tuple[Tensor, list]:
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        self._attention_weights = [[None] * len(self.blks) for _ in range(2)]
        for i, blk in enumerate(self.blks):
            X, state = blk(X, state)
            self._attention_weights[0][i] = blk.attention1.attention_weights  # decoder self-attention
            self._attention_weights[1][i] = blk.attention2.attention_weights  # encoder-decoder attention
        return self.dense(X), state

    @property
    def attention_weights(self) -> list[list[Tensor | None]]:
        return self._attention_weights
