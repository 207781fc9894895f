"""Multi-head attention module (self, cross, causal, padding masks, KV cache)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as SF
from ..functional import fused
from ..functional.packing import PackedBatch
from .._checks import check_positive_int, check_probability

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention built on ``F.scaled_dot_product_attention``; ``nn.MultiheadAttention`` math.

    Args:
        d_model: model (query) size. n_heads: heads; must divide ``d_model``.
        dropout: on the attention weights in training.
        bias: biases on the four projections.
        kdim, vdim: key/value input sizes (cross-attention); None -> d_model.

    Attributes:
        q_proj, k_proj, v_proj, out_proj: ``nn.Linear`` projections (separate, so tensor-parallel plans and
        checkpoint key maps can address them).

    Forward:
        query (B, T_q, d_model); key (B, T_k, kdim) / value (B, T_k, vdim), default: self-attention.
        ``key_padding_mask`` (B, T_k) True = padding; ``attn_mask`` bool (True = masked) or additive float,
        (T_q, T_k), (B·H, T_q, T_k) or (B|1, H|1, T_q, T_k); ``is_causal`` (bottom-right aligned);
        ``need_weights`` returns weights (B, T_q, T_k) averaged over heads (or per head with
        ``average_attn_weights=False``); ``kv_cache`` (:class:`sublayer.functional.KVCache`) for decoding.
        ``packing`` (:class:`sublayer.functional.packing.PackedBatch`): the query rows are packed, (N, d_model),
        and attend as the descriptor says (self-attention; cross-attention on ``key``/``value`` rows packed as
        ``memory_packing`` says); masks, weights and caches do not combine with it.
        Returns ``(out (B, T_q, d_model) or (N, d_model), weights or None)``.
        Query rows with every key masked give zeros and finite gradients.

    Raises:
        ValueError: ``d_model % n_heads != 0`` (naming both), non-positive sizes, dropout outside [0, 1);
        at call time: wrong shapes, integer masks, q/k/v dtype or device mismatch.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("n_heads", n_heads)
        check_positive_int("kdim", kdim, allow_none=True)
        check_positive_int("vdim", vdim, allow_none=True)
        check_probability("dropout", dropout)
        if d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.kdim = kdim or d_model
        self.vdim = vdim or d_model
        self.dropout = float(dropout)
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, d_model, bias=bias, **kw)
        self.k_proj = nn.Linear(self.kdim, d_model, bias=bias, **kw)
        self.v_proj = nn.Linear(self.vdim, d_model, bias=bias, **kw)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, **kw)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.MultiheadAttention's init: xavier-uniform projections, zero biases.
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        kv_cache: SF.KVCache | None = None,
        packing: PackedBatch | None = None,
        memory_packing: PackedBatch | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if packing is not None:
            if need_weights or kv_cache is not None or attn_mask is not None or key_padding_mask is not None:
                raise ValueError(
                    "packing does not combine with need_weights, kv_cache, attn_mask or key_padding_mask (the "
                    "descriptor holds the padding)"
                )
            return self._packed(query, key, value, packing, memory_packing, is_causal), None
        return SF.multi_head_attention(
            query,
            key,
            value,
            self.n_heads,
            self.q_proj.weight,
            self.q_proj.bias,
            self.k_proj.weight,
            self.k_proj.bias,
            self.v_proj.weight,
            self.v_proj.bias,
            self.out_proj.weight,
            self.out_proj.bias,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            is_causal=is_causal,
            dropout=self.dropout,
            training=self.training,
            need_weights=need_weights,
            average_attn_weights=average_attn_weights,
            kv_cache=kv_cache,
            linear=fused.linear,
        )

    def _packed(
        self, x: Tensor, key: Tensor | None, value: Tensor | None, packing: PackedBatch,
        memory: PackedBatch | None, is_causal: bool,
    ) -> Tensor:  # fmt: skip
        """Attention of packed query rows x (N, d_model) -> (N, d_model)."""
        lin = fused.linear
        h = self.n_heads

        def heads(t: Tensor) -> Tensor:  # (N, H·d) -> (N, H, d)
            return t.view(t.shape[0], h, t.shape[-1] // h)

        q = heads(lin(x, self.q_proj.weight, self.q_proj.bias))
        src = x if key is None else key
        k = heads(lin(src, self.k_proj.weight, self.k_proj.bias))
        v = heads(lin(src if value is None else value, self.v_proj.weight, self.v_proj.bias))
        p = self.dropout if self.training else 0.0
        if key is None:
            out = packing.self_attention(q, k, v, causal=is_causal, dropout=p)
        else:
            if memory is None:
                raise ValueError("cross-attention on packed rows needs memory_packing (the memory's descriptor)")
            out = packing.cross_attention(q, k, v, memory, dropout=p)
        return lin(out.reshape(out.shape[0], out.shape[1] * out.shape[2]), self.out_proj.weight, self.out_proj.bias)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, dropout={self.dropout}"
