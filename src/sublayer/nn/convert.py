"""Converting live ``torch.nn`` Transformer layers into sublayer blocks (used by ``EncoderBlock.from_torch`` and
``DecoderBlock.from_torch``).

``nn.TransformerEncoderLayer`` -> :class:`EncoderBlock`, ``nn.TransformerDecoderLayer`` -> :class:`DecoderBlock`:

===========================================  ===========================================================
torch                                        sublayer
===========================================  ===========================================================
``self_attn.in_proj_weight`` (3d, d) rows    ``self_attn.{q,k,v}_proj.weight`` (split in three, q first)
``self_attn.in_proj_bias``                   ``self_attn.{q,k,v}_proj.bias``
``self_attn.out_proj``                       ``self_attn.out_proj``
``multihead_attn`` (decoder)                 ``cross_attn``
``linear1`` / ``linear2``                    ``ffn.fc1`` / ``ffn.fc2``
``norm1, norm2`` (encoder)                   ``attn_residual.norm, ffn_residual.norm``
``norm1, norm2, norm3`` (decoder)            ``self_attn_residual.norm, cross_attn_residual.norm, ffn_residual.norm``
``activation`` (relu / gelu / tanh-gelu /    ``activation="relu" / "gelu" / "gelu_tanh" / "silu"``
silu, function or module)
``norm_first``, ``norm1.eps``, ``bias``,     the same options
``dropout``
``multihead_attn.kdim`` (= ``vdim``)         ``memory_dim``
===========================================  ===========================================================

The weights are copied (the block does not share memory with the layer); the block keeps the layer's device,
dtype and train/eval mode. sublayer blocks are batch-first: a layer built with ``batch_first=False`` converts,
but the block then takes (B, T, D). The decoder block's self-attention is always causal: it equals the torch layer
called with a causal ``tgt_mask`` (``tgt_is_causal=True``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["block_from_torch"]


def _activation(layer: nn.Module) -> str:
    a = layer.activation
    if a is F.relu or isinstance(a, nn.ReLU):
        return "relu"
    if a is F.gelu:
        return "gelu"
    if isinstance(a, nn.GELU):
        return "gelu" if a.approximate == "none" else "gelu_tanh"
    if a is F.silu or isinstance(a, nn.SiLU):
        return "silu"
    raise ValueError(
        f"{type(layer).__name__}.activation {a!r} has no sublayer equivalent; "
        "supported: relu, gelu (erf or tanh), silu (as functions or modules)"
    )


def _attention(mha: nn.MultiheadAttention, name: str, ours: str) -> dict[str, Tensor | None]:
    if not isinstance(mha, nn.MultiheadAttention):
        raise ValueError(f"{name} must be an nn.MultiheadAttention, got {type(mha).__name__}")
    if mha.bias_k is not None or mha.bias_v is not None:
        raise ValueError(f"{name} has add_bias_kv=True: sublayer's MultiHeadAttention has no bias_k/bias_v")
    if mha.add_zero_attn:
        raise ValueError(f"{name} has add_zero_attn=True: sublayer's MultiHeadAttention has no zero-attention slot")
    d = mha.embed_dim
    if mha._qkv_same_embed_dim:
        w = dict(zip("qkv", mha.in_proj_weight.split(d, dim=0)))
    else:
        w = {"q": mha.q_proj_weight, "k": mha.k_proj_weight, "v": mha.v_proj_weight}
    b = dict(zip("qkv", mha.in_proj_bias.split(d))) if mha.in_proj_bias is not None else dict.fromkeys("qkv")
    out = {f"{ours}.{n}_proj.weight": w[n] for n in "qkv"}
    out |= {f"{ours}.{n}_proj.bias": b[n] for n in "qkv"}
    out[f"{ours}.out_proj.weight"], out[f"{ours}.out_proj.bias"] = mha.out_proj.weight, mha.out_proj.bias
    return out


def _linear(lin: nn.Module, ours: str) -> dict[str, Tensor | None]:
    return {f"{ours}.weight": lin.weight, f"{ours}.bias": lin.bias}


def _norm(norm: nn.Module, name: str, ours: str, d_model: int) -> dict[str, Tensor | None]:
    if not isinstance(norm, nn.LayerNorm):
        raise ValueError(f"{name} must be an nn.LayerNorm, got {type(norm).__name__}")
    if not norm.elementwise_affine:
        raise ValueError(f"{name} has elementwise_affine=False: sublayer's blocks have affine norms")
    if tuple(norm.normalized_shape) != (d_model,):
        raise ValueError(f"{name} normalizes shape {tuple(norm.normalized_shape)}, the block needs ({d_model},)")
    return {f"{ours}.weight": norm.weight, f"{ours}.bias": norm.bias}


def _one(values: dict[str, object], what: str) -> object:
    """The single value shared by every entry, else a ValueError listing them."""
    if len(set(values.values())) != 1:
        listed = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise ValueError(f"sublayer blocks use one {what} everywhere; this layer has {listed}")
    return next(iter(values.values()))


def block_from_torch(cls: type, layer: nn.Module) -> nn.Module:
    """A sublayer ``EncoderBlock`` or ``DecoderBlock`` (``cls``) with the weights and options of a torch layer.

    Args:
        cls: the block class to build (``EncoderBlock`` or ``DecoderBlock``, or a subclass).
        layer: an ``nn.TransformerEncoderLayer`` (for ``EncoderBlock``) or ``nn.TransformerDecoderLayer``.

    Returns:
        The block, on the layer's device and dtype, in its train/eval mode, outputs and gradients equal.

    Raises:
        TypeError: the layer is not the torch class that matches ``cls``.
        ValueError: something with no counterpart, named: an activation other than relu/gelu/silu, ``add_bias_kv``,
        ``add_zero_attn``, norms without affine weights or with different eps, some biases present and others not,
        different dropout probabilities or numbers of heads in different places, key/value sizes other than
        d_model (self-attention) or than each other (cross-attention; one size other than d_model becomes the
        block's ``memory_dim``).
    """
    decoder = any(c.__name__ == "DecoderBlock" for c in cls.__mro__)
    want = nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer
    if not isinstance(layer, want):
        raise TypeError(f"{cls.__name__}.from_torch needs an nn.{want.__name__}, got {type(layer).__name__}")
    d_model = layer.self_attn.embed_dim
    if decoder:
        attns = {"self_attn": ("self_attn", layer.self_attn), "multihead_attn": ("cross_attn", layer.multihead_attn)}
        norms = {"norm1": "self_attn_residual.norm", "norm2": "cross_attn_residual.norm", "norm3": "ffn_residual.norm"}
        dropouts = ("dropout", "dropout1", "dropout2", "dropout3")
    else:
        attns = {"self_attn": ("self_attn", layer.self_attn)}
        norms = {"norm1": "attn_residual.norm", "norm2": "ffn_residual.norm"}
        dropouts = ("dropout", "dropout1", "dropout2")
    activation = _activation(layer)
    n_heads = _one({f"{n}.num_heads": m.num_heads for n, (_, m) in attns.items()}, "number of heads")
    memory_dim = None
    for name, (ours, mha) in attns.items():
        if mha.kdim != mha.vdim or (name == "self_attn" and mha.kdim != d_model):
            rule = f"its keys and values have size d_model={d_model}" if name == "self_attn" else "one memory size"
            raise ValueError(f"{name} has kdim={mha.kdim} and vdim={mha.vdim}: the block's {ours} takes {rule}")
        if name == "multihead_attn" and mha.kdim != d_model:
            memory_dim = mha.kdim
    state: dict[str, Tensor | None] = {}
    for name, (ours, mha) in attns.items():
        state |= _attention(mha, name, ours)
    state |= _linear(layer.linear1, "ffn.fc1") | _linear(layer.linear2, "ffn.fc2")
    for name, ours in norms.items():
        state |= _norm(getattr(layer, name), name, ours, d_model)
    if layer.linear1.out_features != layer.linear2.in_features or layer.linear2.out_features != d_model:
        raise ValueError(
            f"linear1 {tuple(layer.linear1.weight.shape)} and linear2 {tuple(layer.linear2.weight.shape)} "
            f"do not form a d_model={d_model} feed-forward network"
        )
    eps = _one({f"{n}.eps": getattr(layer, n).eps for n in norms}, "norm eps")
    p = {f"{n}.p": getattr(layer, n).p for n in dropouts} | {f"{n}.dropout": m.dropout for n, (_, m) in attns.items()}
    dropout = _one(p, "dropout probability")
    has_bias = {k: v is not None for k, v in state.items() if k.endswith(".bias")}
    if len(set(has_bias.values())) != 1:
        present = sorted(k for k, v in has_bias.items() if v)
        absent = sorted(k for k, v in has_bias.items() if not v)
        raise ValueError(
            "sublayer blocks have biases everywhere or nowhere (bias=True/False); this layer has biases for "
            f"{', '.join(present)} but none for {', '.join(absent)}"
        )
    bias = next(iter(has_bias.values()))
    ref = layer.self_attn.out_proj.weight
    extra = {"memory_dim": memory_dim} if memory_dim is not None else {}
    block = cls(
        d_model, n_heads, layer.linear1.out_features, dropout=dropout, activation=activation,
        norm_first=bool(layer.norm_first), eps=eps, bias=bias, device=ref.device, dtype=ref.dtype, **extra,
    )  # fmt: skip
    with torch.no_grad():
        block.load_state_dict({k: v.detach() for k, v in state.items() if v is not None})  # strict: all filled
    return block.train(layer.training)
