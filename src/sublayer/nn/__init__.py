"""``sublayer.nn``: the sub-layer modules."""

from .attention import MultiHeadAttention
from .blocks import DecoderBlock, EncoderBlock
from .conv1d import Conv1D
from .ffn import PositionWiseFFN
from .norm import LayerNorm, RMSNorm, make_norm
from .record import record_attention
from .rope import RotaryEmbedding
from .residual import AddNorm, PreNormResidual, ResidualConnection
from .stacks import TransformerDecoder, TransformerEncoder

__all__ = [
    "AddNorm",
    "Conv1D",
    "DecoderBlock",
    "EncoderBlock",
    "LayerNorm",
    "MultiHeadAttention",
    "PositionWiseFFN",
    "PreNormResidual",
    "RMSNorm",
    "ResidualConnection",
    "RotaryEmbedding",
    "TransformerDecoder",
    "TransformerEncoder",
    "make_norm",
    "record_attention",
]
