"""The encoder pass of :meth:`Transformer.translate` on the inference kernels (tested against
:meth:`Transformer.encode`, which stays the reference).

Per layer: one GEMM for q, k and v together; attention read straight from that GEMM's output
(:func:`sublayer.runtime.encoder.attention`: each sequence on its own rows, no transposes, no (B, H, S, S) scores);
the output projection; residual add + LayerNorm fused (``add_norm_fwd``); the FFN with its bias + activation in
place. A pre-norm layer's closing residual add is fused with the next LayerNorm (the next layer's first, or the
final norm).

With a padding mask only the real tokens go through the GEMMs, the attention, LayerNorms and FFNs (packed rows, as
the reference's padding-free path does), and the memory is zero at padded positions. Inference only: no dropout,
no autograd.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional.fused import linear
from ..functional.packing import Packing
from ..runtime.encoder import attention, runs
from ..runtime.rows import ffn_hidden, kernels_on, residual_out
from . import decoding

__all__ = ["supports", "encode"]


def supports(model) -> bool:
    """Whether :func:`encode` runs ``model``'s encoder: the kernels on, float32 CPU weights, LayerNorms and linears
    with bias, and the fast-path rule (:mod:`sublayer.runtime.rules`: no hooks, not sharded)."""
    enc = model.encoder
    norms = [n for layer in enc.layers for n in (layer.attn_residual.norm, layer.ffn_residual.norm)]
    return (
        kernels_on()
        and decoding.float32_cpu(model, [*norms, enc.norm])
        and all(
            lin.bias is not None
            for layer in enc.layers
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.self_attn.out_proj, layer.ffn.fc1, layer.ffn.fc2)
        )  # fmt: skip
    )


def _build(encoder) -> dict:
    layers = []
    for layer in encoder.layers:
        a = layer.self_attn
        layers.append({
            "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).detach(),
            "qkv_b": torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0).detach(),
            "out": (a.out_proj.weight.detach(), a.out_proj.bias.detach()),
            "fc1": (layer.ffn.fc1.weight.detach(), layer.ffn.fc1.bias.detach()),
            "fc2": (layer.ffn.fc2.weight.detach(), layer.ffn.fc2.bias.detach()),
            "norms": [decoding.norm_params(layer.attn_residual.norm), decoding.norm_params(layer.ffn_residual.norm)],
        })  # fmt: skip
    return {"layers": layers, "final": None if encoder.norm is None else decoding.norm_params(encoder.norm)}


def encode(model, src: Tensor, src_key_padding_mask: Tensor | None = None) -> Tensor | None:
    """``model.encode(src, src_key_padding_mask=...)`` on the kernels, or None when :func:`supports` says no.

    Args:
        src: (B, S) source ids, already checked. src_key_padding_mask: (B, S) bool, True = padding, or None.

    Returns:
        memory (B, S, d_model) float32; zeros at padded positions.
    """
    if not supports(model):
        return None
    cfg = model.config
    W = decoding.prepared_weights(model.encoder, _build)
    b, s = src.shape
    d = cfg.d_model
    pad = pk = None
    if src_key_padding_mask is not None and bool(src_key_padding_mask.any()):
        pad = src_key_padding_mask
        pk = Packing(pad)  # the real tokens' rows
    x = model.src_embed.weight.detach()[src] * math.sqrt(d) + model.pos_encoding[:s]  # (B, S, d)
    x = x.reshape(b * s, d) if pk is None else pk.pack(x)
    layers, pre = W["layers"], cfg.norm_first
    scale, segments = 1.0 / math.sqrt(d // cfg.n_heads), runs(pad, (b, s))
    h = F.layer_norm(x, (d,), *layers[0]["norms"][0][:2], layers[0]["norms"][0][2]) if pre else x
    for i, L in enumerate(layers):
        # pre-norm: the norm after this layer's FFN is the next layer's first, or the final one (or none)
        after = layers[i + 1]["norms"][0] if i + 1 < len(layers) else W["final"]
        ctx = attention(linear(h, L["qkv"], L["qkv_b"]), segments, cfg.n_heads, scale)
        x, h = residual_out(pre, x, linear(ctx, *L["out"]), L["norms"][0], L["norms"][1])
        f = ffn_hidden(linear(h, L["fc1"][0]), L["fc1"][1], cfg.activation)
        x, h = residual_out(pre, x, linear(f, *L["fc2"]), L["norms"][1], after)
    if not pre and W["final"] is not None:
        h = F.layer_norm(h, (d,), *W["final"][:2], W["final"][2])
    return h.view(b, s, d) if pk is None else pk.unpack(h)
