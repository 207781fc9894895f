"""The encoder pass of :meth:`Transformer.translate` on the inference kernels (tested against
:meth:`Transformer.encode`, which stays the reference).

The layers run through :func:`sublayer.runtime.encoder.run_layers` (pre- or post-norm) on the float32 weights
themselves: one GEMM for q, k and v together, attention read straight from its output (each sequence on its own
rows, no (B, H, S, S) scores), residual add + LayerNorm fused, the FFN's bias + activation in place.

With a padding mask only the real tokens go through the GEMMs, the attention, LayerNorms and FFNs (packed rows, as
the reference's padding-free path does), and the memory is zero at padded positions. Inference only: no dropout,
no autograd.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..functional.fused import linear
from ..functional.packing import Packing
from ..runtime.encoder import run_layers
from ..runtime.rows import ffn_hidden, kernels_on
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


def _linear(weight: Tensor, bias: Tensor):
    """A linear of :func:`~sublayer.runtime.encoder.run_layers` on the float32 weight itself (``fused.linear``; an
    FFN activation in its own pass, with the bias)."""
    w, b = weight.detach(), bias.detach()
    return lambda x, activation=None: linear(x, w, b) if activation is None else ffn_hidden(linear(x, w), b, activation)


def _build(encoder) -> dict:
    layers = []
    for layer in encoder.layers:
        a, f = layer.self_attn, layer.ffn
        layers.append({
            "qkv": _linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0),
                           torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0)),
            **{k: _linear(m.weight, m.bias) for k, m in (("out", a.out_proj), ("fc1", f.fc1), ("fc2", f.fc2))},
            "norm1": decoding.norm_params(layer.attn_residual.norm),
            "norm2": decoding.norm_params(layer.ffn_residual.norm),
            "act": f.activation,  # the module's own, as its forward reads it (set after construction too)
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
    h = run_layers(x, W["layers"], pad=pad, shape=(b, s), heads=cfg.n_heads, scale=1.0 / math.sqrt(d // cfg.n_heads),
                   activation=cfg.activation, norm_first=cfg.norm_first, final=W["final"])  # fmt: skip
    return h.view(b, s, d) if pk is None else pk.unpack(h)
