"""Encoder and decoder blocks: attention and FFN sub-layers wrapped in post- or pre-norm residuals."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as SF
from ..functional.packing import PackedBatch
from .._checks import check_positive_int
from .attention import MultiHeadAttention
from .convert import block_from_torch
from .ffn import PositionWiseFFN
from .norm import LayerNorm
from .residual import AddNorm, PreNormResidual

__all__ = ["EncoderBlock", "DecoderBlock"]


class _Block(nn.Module):
    """What encoder and decoder blocks share: arguments, the FFN, the attentions (``attns``: attribute name ->
    extra :class:`MultiHeadAttention` arguments), the residuals (``residuals``: attribute names) and their wiring."""

    def __init__(
        self, d_model, n_heads, d_ff, *, dropout, activation, norm_first, norm, eps, bias, kw, attns, residuals
    ) -> None:
        super().__init__()
        # n_heads, dropout, norm, eps and d_model % n_heads: checked by the sub-layers below, with the same messages
        check_positive_int("d_model", d_model)  # (the FFN alone would take None as a lazy input size)
        self.d_model, self.n_heads = d_model, n_heads
        self.norm_first, self.norm = norm_first, norm
        self.ffn = PositionWiseFFN(d_model, d_ff, activation=activation, dropout=dropout, bias=bias, **kw)
        for name, extra in attns.items():
            setattr(self, name, MultiHeadAttention(d_model, n_heads, dropout=dropout, bias=bias, **extra, **kw))
        for name in residuals:
            residual = (PreNormResidual if norm_first else AddNorm)(d_model, dropout, norm=norm, eps=eps, **kw)
            if not bias and norm == "layer":  # as nn.TransformerEncoderLayer(bias=False): no LayerNorm bias
                residual.norm = LayerNorm(d_model, eps, bias=False, **kw)
            setattr(self, name, residual)

    @classmethod
    def from_torch(cls, layer: nn.Module) -> _Block:
        """A block with the weights and options of a torch layer — ``nn.TransformerEncoderLayer`` for an
        :class:`EncoderBlock`, ``nn.TransformerDecoderLayer`` for a :class:`DecoderBlock` (equal to the layer called
        with a causal ``tgt_mask``): ``in_proj_weight`` split into q/k/v, norms, activation, ``norm_first``, eps,
        bias, dropout; see :mod:`sublayer.nn.convert`.

        Raises:
            TypeError: not the matching torch layer. ValueError: an option with no counterpart, named.
        """
        return block_from_torch(cls, layer)

    def _sublayer(self, residual: nn.Module, x: Tensor, fn) -> Tensor:
        # post-norm: norm(x + dropout(fn(x))); pre-norm: x + dropout(fn(norm(x)))
        return residual(x, fn) if self.norm_first else residual(x, fn(x))


class EncoderBlock(_Block):
    """Transformer encoder block: self-attention then FFN, each in a residual; ``nn.TransformerEncoderLayer``
    math (``batch_first=True``).

    post-norm (``norm_first=False``): ``x = norm1(x + drop(attn(x))); x = norm2(x + drop(ffn(x)))``;
    pre-norm: ``x = x + drop(attn(norm1(x))); x = x + drop(ffn(norm2(x)))``.

    Args:
        d_model, n_heads: sizes (``d_model % n_heads == 0``). d_ff: FFN hidden size, None -> 4·d_model.
        dropout: on attention weights, the FFN hidden and both residual branches (as torch does).
        activation: FFN activation name (see :class:`PositionWiseFFN`).
        norm_first: pre-norm when True. norm: ``"layer"`` or ``"rms"``. eps: the norms' eps.
        bias: biases in the attention and FFN linears and the LayerNorms (``bias=False``: none, as in torch).

    Attributes:
        self_attn (:class:`MultiHeadAttention`), ffn (:class:`PositionWiseFFN`), attn_residual / ffn_residual
        (:class:`AddNorm` or :class:`PreNormResidual`, each with ``.norm``).

    Shape:
        x (B, T, d_model), key_padding_mask (B, T) True = padding, attn_mask as in MultiHeadAttention
        -> (B, T, d_model). With ``packing`` (:class:`sublayer.functional.packing.PackedBatch`) x holds packed
        rows (N, d_model) and the descriptor replaces the masks.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        *,
        dropout: float = 0.0,
        activation: str = "relu",
        norm_first: bool = False,
        norm: str = "layer",
        eps: float = 1e-5,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            d_model, n_heads, d_ff, dropout=dropout, activation=activation, norm_first=norm_first, norm=norm, eps=eps,
            bias=bias, kw={"device": device, "dtype": dtype}, attns={"self_attn": {}},
            residuals=("attn_residual", "ffn_residual"),
        )  # fmt: skip

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        packing: PackedBatch | None = None,
    ) -> Tensor:
        def attn(h: Tensor) -> Tensor:
            return self.self_attn(
                h, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal, packing=packing
            )[0]

        x = self._sublayer(self.attn_residual, x, attn)
        return self._sublayer(self.ffn_residual, x, self.ffn)


class DecoderBlock(_Block):
    """Transformer decoder block: causal self-attention, cross-attention on ``memory``, FFN — each in a
    residual; ``nn.TransformerDecoderLayer`` math (``batch_first=True``) with a causal ``tgt_mask``.

    Args: as :class:`EncoderBlock`; ``memory_dim`` is the memory's feature size (None -> d_model).

    Attributes:
        self_attn, cross_attn, ffn, and self_attn_residual / cross_attn_residual / ffn_residual.

    Shape:
        x (B, T, d_model), memory (B, S, memory_dim), tgt_key_padding_mask (B, T) (covering the cached keys too
        when decoding with a cache), memory_key_padding_mask (B, S) -> (B, T, d_model).
        With ``self_attn_cache``/``cross_attn_cache`` (:class:`sublayer.functional.KVCache`) the block decodes
        incrementally: ``x`` holds only the new positions. With ``packing`` / ``memory_packing``
        (:class:`sublayer.functional.packing.PackedBatch`) x (N, d_model) and memory (N_m, memory_dim) hold packed
        rows.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        *,
        dropout: float = 0.0,
        activation: str = "relu",
        norm_first: bool = False,
        norm: str = "layer",
        eps: float = 1e-5,
        bias: bool = True,
        memory_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            d_model, n_heads, d_ff, dropout=dropout, activation=activation, norm_first=norm_first, norm=norm, eps=eps,
            bias=bias, kw={"device": device, "dtype": dtype},
            attns={"self_attn": {}, "cross_attn": {"kdim": memory_dim, "vdim": memory_dim}},
            residuals=("self_attn_residual", "cross_attn_residual", "ffn_residual"),
        )  # fmt: skip

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        self_attn_cache: SF.KVCache | None = None,
        cross_attn_cache: SF.KVCache | None = None,
        packing: PackedBatch | None = None,
        memory_packing: PackedBatch | None = None,
    ) -> Tensor:
        def self_attn(h: Tensor) -> Tensor:
            return self.self_attn(
                h, key_padding_mask=tgt_key_padding_mask, is_causal=True, kv_cache=self_attn_cache, packing=packing
            )[0]

        def cross_attn(h: Tensor) -> Tensor:
            return self.cross_attn(
                h, memory, key_padding_mask=memory_key_padding_mask, kv_cache=cross_attn_cache, packing=packing,
                memory_packing=memory_packing,
            )[0]  # fmt: skip

        x = self._sublayer(self.self_attn_residual, x, self_attn)
        x = self._sublayer(self.cross_attn_residual, x, cross_attn)
        return self._sublayer(self.ffn_residual, x, self.ffn)
