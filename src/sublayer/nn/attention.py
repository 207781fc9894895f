"""Multi-head attention module (self, cross, causal, padding masks, KV cache)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as SF
from ..functional import fused
from ..functional.packing import PackedBatch
from .._checks import check_positive_int, check_probability
from .hooks import hooked

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention built on ``F.scaled_dot_product_attention``; ``nn.MultiheadAttention`` math.

    Args:
        d_model: model (query) size. n_heads: heads; must divide ``d_model``.
        dropout: on the attention weights in training.
        bias: biases on the four projections.
        kdim, vdim: key/value input sizes (cross-attention); None -> d_model.
        n_kv_heads: key/value heads (grouped-query attention; 1 = multi-query); None -> n_heads; must divide
            ``n_heads``. Each key/value head serves ``n_heads / n_kv_heads`` consecutive query heads.
        head_dim: size of one head; None -> d_model / n_heads (then ``n_heads`` must divide ``d_model``).

    Attributes:
        q_proj, k_proj, v_proj, out_proj: ``nn.Linear`` projections (separate, so tensor-parallel plans and
        checkpoint key maps can address them): q ``(n_heads·head_dim, d_model)``, k/v ``(n_kv_heads·head_dim,
        kdim/vdim)``, out ``(d_model, n_heads·head_dim)``.

    Forward:
        query (B, T_q, d_model); key (B, T_k, kdim) / value (B, T_k, vdim), default: self-attention.
        ``key_padding_mask`` (B, T_k) True = padding; ``attn_mask`` bool (True = masked) or additive float,
        (T_q, T_k), (B·H, T_q, T_k) or (B|1, H|1, T_q, T_k); ``is_causal`` (bottom-right aligned);
        ``need_weights`` returns weights (B, T_q, T_k) averaged over heads (or per head with
        ``average_attn_weights=False``); ``kv_cache`` (:class:`sublayer.functional.KVCache`) for decoding;
        ``rotary`` ``(cos, sin)`` (B | 1, T_q, head_dim) rotary position embeddings for q and k (see
        :class:`~sublayer.nn.RotaryEmbedding`), applied before the cache update.
        ``packing`` (:class:`sublayer.functional.packing.PackedBatch`): the query rows are packed, (N, d_model),
        and attend as the descriptor says (self-attention; cross-attention on ``key``/``value`` rows packed as
        ``memory_packing`` says; ``rotary`` then (N, head_dim)); masks, weights and caches do not combine with it.
        Returns ``(out (B, T_q, d_model) or (N, d_model), weights or None)``.
        Query rows with every key masked give zeros and finite gradients.

    Raises:
        ValueError: ``d_model % n_heads != 0`` without ``head_dim`` (naming both), ``n_heads % n_kv_heads != 0``
        (naming both), non-positive sizes, dropout outside [0, 1);
        at call time: wrong shapes, integer masks or masks on another device, q/k/v dtype or device mismatch
        (between themselves, or with the weights outside autocast).
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
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("n_heads", n_heads)
        for name, v in (("kdim", kdim), ("vdim", vdim), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            check_positive_int(name, v, allow_none=True)
        check_probability("dropout", dropout)
        if head_dim is None and d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        inner, kv_inner = n_heads * self.head_dim, n_kv_heads * self.head_dim
        self.kdim = kdim or d_model
        self.vdim = vdim or d_model
        self.dropout = float(dropout)
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, inner, bias=bias, **kw)
        self.k_proj = nn.Linear(self.kdim, kv_inner, bias=bias, **kw)
        self.v_proj = nn.Linear(self.vdim, kv_inner, bias=bias, **kw)
        self.out_proj = nn.Linear(inner, d_model, bias=bias, **kw)
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
        rotary: tuple[Tensor, Tensor] | None = None,
        packing: PackedBatch | None = None,
        memory_packing: PackedBatch | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if packing is not None:
            if need_weights or kv_cache is not None or attn_mask is not None or key_padding_mask is not None:
                raise ValueError(
                    "packing does not combine with need_weights, kv_cache, attn_mask or key_padding_mask (the "
                    "descriptor holds the padding)"
                )
            return self._packed(query, key, value, packing, memory_packing, is_causal, rotary), None
        return SF.multi_head_attention(
            query, key, value, self.n_heads,
            self.q_proj.weight, self.q_proj.bias, self.k_proj.weight, self.k_proj.bias,
            self.v_proj.weight, self.v_proj.bias, self.out_proj.weight, self.out_proj.bias,
            key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal, dropout=self.dropout,
            training=self.training, need_weights=need_weights, average_attn_weights=average_attn_weights,
            kv_cache=kv_cache, linear=self._linear(), rotary=rotary,
        )  # fmt: skip

    def _packed(
        self, x: Tensor, key: Tensor | None, value: Tensor | None, packing: PackedBatch,
        memory: PackedBatch | None, is_causal: bool, rotary: tuple[Tensor, Tensor] | None,
    ) -> Tensor:  # fmt: skip
        """Attention of packed query rows x (N, d_model) -> (N, d_model)."""
        lin = self._linear()
        d = self.head_dim

        def heads(t: Tensor) -> Tensor:  # (N, H·d) -> (N, H, d)
            return t.view(t.shape[0], t.shape[-1] // d, d)

        q = heads(lin(x, self.q_proj.weight, self.q_proj.bias))
        src = x if key is None else key
        k = heads(lin(src, self.k_proj.weight, self.k_proj.bias))
        v = heads(lin(src if value is None else value, self.v_proj.weight, self.v_proj.bias))
        if rotary is not None:
            cos, sin = (t[:, None] for t in rotary)  # (N, 1, head_dim)
            q, k = SF.apply_rotary(q, cos, sin), SF.apply_rotary(k, cos, sin)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves its group of query heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        p = self.dropout if self.training else 0.0
        if key is None:
            out = packing.self_attention(q, k, v, causal=is_causal, dropout=p)
        else:
            if memory is None:
                raise ValueError("cross-attention on packed rows needs memory_packing (the memory's descriptor)")
            out = packing.cross_attention(q, k, v, memory, dropout=p)
        return lin(out.reshape(out.shape[0], out.shape[1] * out.shape[2]), self.out_proj.weight, self.out_proj.bias)

    def _linear(self):
        """The projections' ``linear(x, weight, bias)``: the fused one, or, when a projection has a hook
        (:func:`~sublayer.nn.hooks.hooked`), the projection module's own call."""
        projs = (self.q_proj, self.k_proj, self.v_proj, self.out_proj)
        if not hooked(*projs, backward=True):
            return fused.linear
        by_weight = {id(m.weight): m for m in projs}
        return lambda x, w, b: by_weight[id(w)](x)

    def extra_repr(self) -> str:
        kv = f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads != self.n_heads else ""
        hd = f", head_dim={self.head_dim}" if self.head_dim * self.n_heads != self.d_model else ""
        return f"d_model={self.d_model}, n_heads={self.n_heads}{kv}{hd}, dropout={self.dropout}"
