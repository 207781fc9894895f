"""``sublayer.functional``: the math of every sub-layer, one reference per op; the modules call these."""

from .attention import KVCache, attention, causal_mask, multi_head_attention
from .cross_entropy import linear_cross_entropy
from .ffn import ACTIVATIONS, GATED_ACTIVATIONS, activation_fn, feed_forward
from .norm import NORMS, add_norm, layer_norm, rms_norm

__all__ = [
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "NORMS",
    "KVCache",
    "activation_fn",
    "add_norm",
    "attention",
    "causal_mask",
    "feed_forward",
    "layer_norm",
    "linear_cross_entropy",
    "multi_head_attention",
    "rms_norm",
]
