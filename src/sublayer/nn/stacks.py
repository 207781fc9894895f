"""Stacks of encoder/decoder blocks, with exactly one final norm for a pre-norm stack."""

from __future__ import annotations

import copy

from torch import Tensor, nn

from .. import functional as SF
from ..functional.packing import PackedBatch
from .._checks import check_positive_int
from .blocks import DecoderBlock, EncoderBlock
from .norm import LayerNorm, make_norm

__all__ = ["TransformerEncoder", "TransformerDecoder"]


def _stack(block: nn.Module, n_layers: int, cls: type, final_norm: bool | None):
    if not isinstance(block, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"block must be {article} {cls.__name__}, got {type(block).__name__}")
    check_positive_int("n_layers", n_layers)
    layers = nn.ModuleList([block] + [copy.deepcopy(block) for _ in range(n_layers - 1)])
    for layer in list(layers)[1:]:  # fresh initialisation for each copy (the first keeps the given weights)
        # children before parents, so a parent's own init (MultiHeadAttention: xavier q/k/v, zero biases) wins
        # over its nn.Linear children's default, as in a newly built block
        for m in reversed(list(layer.modules())):
            if m is not layer and hasattr(m, "reset_parameters"):
                m.reset_parameters()
    if not (block.norm_first if final_norm is None else final_norm):  # pre-norm: exactly one final norm; post: none
        return layers, None
    ref = block.ffn_residual.norm  # the final norm is made as the block's: kind, eps, bias, device, dtype
    kw = {"device": ref.weight.device, "dtype": ref.weight.dtype}
    if isinstance(ref, LayerNorm):
        return layers, LayerNorm(block.d_model, ref.eps, bias=ref.bias is not None, **kw)
    return layers, make_norm(block.norm, block.d_model, ref.eps, **kw)


class TransformerEncoder(nn.Module):
    """``n_layers`` copies of an :class:`EncoderBlock` (the first is ``block`` itself, the others freshly
    initialised), then a final norm.

    Args:
        block: the block to repeat. n_layers: how many.
        final_norm: None -> one final norm iff the block is pre-norm (``norm_first``); True/False force it.

    Shape:
        x (B, T, d_model), key_padding_mask (B, T) True = padding -> (B, T, d_model); with ``packing``, packed
        rows (N, d_model) -> (N, d_model).
    """

    def __init__(self, block: EncoderBlock, n_layers: int, *, final_norm: bool | None = None) -> None:
        super().__init__()
        self.layers, self.norm = _stack(block, n_layers, EncoderBlock, final_norm)

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        packing: PackedBatch | None = None,
    ) -> Tensor:
        for layer in self.layers:
            x = layer(x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal, packing=packing)
        return x if self.norm is None else self.norm(x)


class TransformerDecoder(nn.Module):
    """``n_layers`` copies of a :class:`DecoderBlock`, then a final norm (as :class:`TransformerEncoder`).

    Shape:
        x (B, T, d_model), memory (B, S, d_memory) -> (B, T, d_model). ``caches``: from :meth:`new_caches`, for
        incremental decoding (``x`` then holds only the new positions).
    """

    def __init__(self, block: DecoderBlock, n_layers: int, *, final_norm: bool | None = None) -> None:
        super().__init__()
        self.layers, self.norm = _stack(block, n_layers, DecoderBlock, final_norm)

    def new_caches(self) -> list[tuple[SF.KVCache, SF.KVCache]]:
        """One (self-attention, cross-attention) cache pair per layer."""
        return [(SF.KVCache(), SF.KVCache(static=True)) for _ in self.layers]

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        caches: list[tuple[SF.KVCache, SF.KVCache]] | None = None,
        packing: PackedBatch | None = None,
        memory_packing: PackedBatch | None = None,
    ) -> Tensor:
        if caches is not None and len(caches) != len(self.layers):
            raise ValueError(f"caches must hold one pair per layer ({len(self.layers)}), got {len(caches)}")
        for i, layer in enumerate(self.layers):
            sc, cc = caches[i] if caches is not None else (None, None)
            x = layer(x, memory, tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask, self_attn_cache=sc, cross_attn_cache=cc,
                      packing=packing, memory_packing=memory_packing)  # fmt: skip
        return x if self.norm is None else self.norm(x)
