"""``sublayer.models``: models made of the sub-layers, one readable file each, dataclass configs."""

from .config import ModelConfig
from .transformer import Transformer, TransformerConfig

__all__ = ["ModelConfig", "Transformer", "TransformerConfig"]

from .bert import Bert, BertConfig  # noqa: E402
from .gpt2 import GPT2, GPT2Config  # noqa: E402

__all__ += ["Bert", "BertConfig", "GPT2", "GPT2Config"]
