"""``sublayer.functional``: the math of every sub-layer, one reference per op; the modules call these."""

from .attention import KVCache, attention, causal_mask, multi_head_attention
from .cross_entropy import linear_cross_entropy
from .ffn import ACTIVATIONS, GATED_ACTIVATIONS, activation_fn, feed_forward
from .norm import NORMS, add_norm, layer_norm, rms_norm
from .rope import ROPE_TYPES, apply_rotary, check_rope_scaling, rotary_cos_sin, rotary_inv_freq

__all__ = [
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "NORMS",
    "ROPE_TYPES",
    "KVCache",
    "activation_fn",
    "add_norm",
    "apply_rotary",
    "attention",
    "causal_mask",
    "check_rope_scaling",
    "feed_forward",
    "layer_norm",
    "linear_cross_entropy",
    "multi_head_attention",
    "rms_norm",
    "rotary_cos_sin",
    "rotary_inv_freq",
]
