"""sublayer: the Transformer's sub-layers, exact to torch.nn and Hugging Face transformers.

Shapes are batch-first (B, T, D); ``key_padding_mask`` True = padding.
"""

import warnings

from . import settings

if settings.command_line_process():  # before torch's import, which starts OpenMP: see settings.apply_wait_policy
    try:
        settings.apply_wait_policy()
    except ValueError:  # a bad SUBLAYER_WAIT_POLICY: the command reports it in one line
        pass
try:  # before torch's import: torch, oneDNN and MKL read their instruction-set caps when they start
    settings.apply_isa()
except ValueError:  # a bad SUBLAYER_ISA is reported where the kernels read it
    pass

with warnings.catch_warnings():  # torch's import warns when NumPy is absent; sublayer does not need NumPy
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from . import d2l, functional, hf, memory, models, plot
from .functional import KVCache
from .memory import set_memory_reuse
from .nn import (
    AddNorm,
    Conv1D,
    DecoderBlock,
    EncoderBlock,
    LayerNorm,
    MultiHeadAttention,
    PositionWiseFFN,
    PreNormResidual,
    ResidualConnection,
    RMSNorm,
    TransformerDecoder,
    TransformerEncoder,
)
from .nn.record import record_attention

__version__ = "0.1.0"

__all__ = [
    "AddNorm",
    "Conv1D",
    "DecoderBlock",
    "EncoderBlock",
    "KVCache",
    "LayerNorm",
    "MultiHeadAttention",
    "PositionWiseFFN",
    "PreNormResidual",
    "RMSNorm",
    "ResidualConnection",
    "TransformerDecoder",
    "TransformerEncoder",
    "__version__",
    "d2l",
    "functional",
    "hf",
    "memory",
    "models",
    "plot",
    "record_attention",
    "set_memory_reuse",
]
