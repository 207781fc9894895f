"""``sublayer.d2l``: the classes of d2l.ai's Transformer chapter (Dive into Deep Learning 1.x, PyTorch tab), with
the book's signatures, attribute names and semantics, running on sublayer's modules and kernels.

The chapter's cells that define and check these classes — 11.3's ``masked_softmax`` and ``DotProductAttention``,
11.5's ``MultiHeadAttention``, 11.7's ``PositionWiseFFN`` ... ``TransformerDecoder`` — run with this module in place
of ``from d2l import torch as d2l``: the base classes they subclass (``d2l.Module``, ``d2l.Encoder``,
``d2l.AttentionDecoder``), ``d2l.add_to_class`` and the helpers they call (``d2l.ones``, ``d2l.tensor``,
``d2l.normal``, ``d2l.check_shape``, ``d2l.show_heatmaps``) are here. The rest of the book is not: 11.3's
``AdditiveAttention``, the training cells (``d2l.MTFraEng``, ``d2l.Seq2Seq``, ``d2l.Trainer``, ``d2l.plot``) and
the training machinery of the book's ``Module``. The classes can also be imported from here::

    from sublayer import d2l
    ffn = d2l.PositionWiseFFN(4, 8); ffn.eval()
    ffn(d2l.ones((2, 3, 4)))[0].shape   # torch.Size([3, 8]), as in the book

What the book's classes are made of here:

==========================  ===============================================  ==========================================
book                        here                                             book parameter names (state dicts load)
==========================  ===============================================  ==========================================
``PositionWiseFFN``         :class:`sublayer.PositionWiseFFN` (lazy input)   ``dense1`` -> ``fc1``, ``dense2`` -> ``fc2``
``AddNorm``                 :class:`sublayer.AddNorm` (fused add + norm)     ``ln`` -> ``norm``
``MultiHeadAttention``      :class:`sublayer.MultiHeadAttention`'s           ``W_q/W_k/W_v/W_o`` -> ``q/k/v/out_proj``
                            projections, the book's forward
``DotProductAttention``     the book's (``attention`` of MultiHeadAttention)
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
    "AttentionDecoder",
    "Decoder",
    "DotProductAttention",
    "Encoder",
    "Module",
    "MultiHeadAttention",
    "PositionWiseFFN",
    "PositionalEncoding",
    "TransformerDecoder",
    "TransformerDecoderBlock",
    "TransformerEncoder",
    "TransformerEncoderBlock",
    "add_to_class",
    "check_shape",
    "masked_softmax",
    "normal",
    "ones",
    "show_heatmaps",
    "tensor",
    "valid_lens_masks",
]

normal = torch.normal
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
    _check_valid_lens(valid_lens, batch, n_queries)
    keys = torch.arange(n_keys, device=valid_lens.device)
    if valid_lens.dim() == 1:
        return keys[None, :] >= valid_lens[:, None], None
    return None, keys[None, None, None, :] >= valid_lens[:, None, :, None]


def _check_valid_lens(valid_lens: Tensor, batch: int, n_queries: int) -> None:
    check_tensor("valid_lens", valid_lens)
    if valid_lens.dim() == 1 and valid_lens.shape[0] != batch:
        raise ValueError(f"valid_lens (1-D) must have shape ({batch},), got {tuple(valid_lens.shape)}")
    if valid_lens.dim() == 2 and tuple(valid_lens.shape) != (batch, n_queries):
        raise ValueError(
            f"valid_lens (2-D) must have shape (batch, queries) = ({batch}, {n_queries}), "
            f"got {tuple(valid_lens.shape)}"
        )
    if valid_lens.dim() not in (1, 2):
        raise ValueError(
            f"valid_lens must be 1-D (batch,) or 2-D (batch, queries), got shape {tuple(valid_lens.shape)}"
        )


def masked_softmax(X: Tensor, valid_lens: Tensor | None) -> Tensor:
    """The book's softmax over the last axis of ``X`` (batch, queries, keys) with the keys beyond ``valid_lens``
    (None, 1-D per sequence or 2-D per query) set to -1e6 first; a row with no valid key gives zeros here."""
    if valid_lens is None:
        return X.softmax(dim=-1)
    if X.dim() != 3:
        raise ValueError(f"X must be 3-D (batch, queries, keys) with valid_lens, got shape {tuple(X.shape)}")
    kpm, mask = valid_lens_masks(valid_lens, *X.shape)
    masked = kpm[:, None, :] if mask is None else mask[:, 0]
    weights = X.masked_fill(masked, max(-1e6, torch.finfo(X.dtype).min)).softmax(dim=-1)  # float16: its min
    return weights.masked_fill(masked.all(dim=-1, keepdim=True), 0.0)


def add_to_class(Class):
    """The book's decorator: the decorated function becomes a method of ``Class``."""

    def wrapper(obj):
        setattr(Class, obj.__name__, obj)

    return wrapper


class Module(nn.Module):
    """The book's base class of its models, as far as the chapter's cells use it (``class
    MultiHeadAttention(d2l.Module)``): an ``nn.Module``; the book's training machinery is not here."""


class Encoder(nn.Module):
    """The book's encoder interface: ``forward(X, *args)``."""

    def forward(self, X: Tensor, *args):
        raise NotImplementedError


class Decoder(nn.Module):
    """The book's decoder interface: ``init_state(enc_all_outputs, *args)``, ``forward(X, state)``."""

    def init_state(self, enc_all_outputs, *args):
        raise NotImplementedError

    def forward(self, X: Tensor, state):
        raise NotImplementedError


class AttentionDecoder(Decoder):
    """The book's attention-decoder interface: a :class:`Decoder` with ``attention_weights``."""

    @property
    def attention_weights(self):
        raise NotImplementedError


class DotProductAttention(nn.Module):
    """The book's scaled dot-product attention: ``attention_weights = masked_softmax(Q K^T / sqrt(d), valid_lens)``
    (recorded before dropout, so its rows sum to 1 in training too), output ``dropout(attention_weights) V``.

    Shape:
        queries (B, T_q, d), keys (B, T_k, d), values (B, T_k, d_v), valid_lens None, (B,) or (B, T_q)
        -> (B, T_q, d_v).
    """

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.attention_weights: Tensor | None = None

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None) -> Tensor:
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


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
        self.relu = nn.ReLU()  # the book's attribute; the forward runs the fused relu of activation="relu"
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
    """The book's multi-head attention: sublayer's projections, then the book's forward — ``transpose_qkv`` the
    projected queries, keys and values to (batch·num_heads, T, num_hiddens / num_heads), run ``attention`` (a
    :class:`DotProductAttention`, ``valid_lens`` repeated per head), ``transpose_output`` and project.
    ``attention_weights`` (batch·num_heads, queries, keys) are ``attention``'s.

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
        self.attention = DotProductAttention(dropout)
        self.register_load_state_dict_pre_hook(_rename_book_keys)

    @property
    def attention_weights(self) -> Tensor | None:
        return self.attention.attention_weights

    def transpose_qkv(self, X: Tensor) -> Tensor:
        """(B, T, num_hiddens) -> (B·num_heads, T, num_hiddens / num_heads)."""
        X = X.reshape(X.shape[0], X.shape[1], self.num_heads, -1).permute(0, 2, 1, 3)
        return X.reshape(-1, X.shape[2], X.shape[3])

    def transpose_output(self, X: Tensor) -> Tensor:
        """The inverse of :meth:`transpose_qkv`: (B·num_heads, T, d) -> (B, T, num_heads·d)."""
        X = X.reshape(-1, self.num_heads, X.shape[1], X.shape[2]).permute(0, 2, 1, 3)
        return X.reshape(X.shape[0], X.shape[1], -1)

    def _kv_heads(self, X: Tensor) -> Tensor:
        """:meth:`transpose_qkv` of keys or values; with ``n_kv_heads`` < ``num_heads`` (grouped-query attention)
        each key/value head repeated for its group of query heads."""
        if self.n_kv_heads != self.num_heads:
            X = X.unflatten(-1, (self.n_kv_heads, -1)).repeat_interleave(self.num_heads // self.n_kv_heads, dim=2)
        return self.transpose_qkv(X.flatten(2))

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None) -> Tensor:
        for name, t, size in (("queries", queries, self.d_model), ("keys", keys, self.kdim),
                              ("values", values, self.vdim)):  # fmt: skip
            check_tensor(name, t)
            if t.dim() == 0 or t.shape[-1] != size:  # (the book's lazy projections would take any size)
                label = "num_hiddens" if size == self.d_model else ("kdim" if name == "keys" else "vdim")
                raise ValueError(f"{name} must have last dim {label}={size}, got shape {tuple(t.shape)}")
        if valid_lens is not None:  # checked against the batch here, so that errors name it (not batch·heads)
            _check_valid_lens(valid_lens, queries.shape[0], queries.shape[1])
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        lin = self._linear()
        queries = self.transpose_qkv(lin(queries, self.q_proj.weight, self.q_proj.bias))
        keys = self._kv_heads(lin(keys, self.k_proj.weight, self.k_proj.bias))
        values = self._kv_heads(lin(values, self.v_proj.weight, self.v_proj.bias))
        output = self.attention(queries, keys, values, valid_lens)
        return lin(self.transpose_output(output), self.out_proj.weight, self.out_proj.bias)


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


class TransformerEncoder(Encoder):
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
        key_values = X if state[2][self.i] is None else torch.cat((state[2][self.i], X), dim=1)
        state[2][self.i] = key_values
        dec_valid_lens = None
        if self.training:
            batch_size, num_steps, _ = X.shape
            # (batch_size, num_steps), every row [1, 2, ..., num_steps]: query t sees keys 0..t
            dec_valid_lens = torch.arange(1, num_steps + 1, device=X.device).repeat(batch_size, 1)
        X2 = self.attention1(X, key_values, key_values, dec_valid_lens)
        Y = self.addnorm1(X, X2)
        Y2 = self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens)
        Z = self.addnorm2(Y, Y2)
        return self.addnorm3(Z, self.ffn(Z)), state


class TransformerDecoder(AttentionDecoder):
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
