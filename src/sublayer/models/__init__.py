"""``sublayer.models``: models made of the sub-layers, one readable file each, dataclass configs."""

from .config import ModelConfig

__all__ = ["ModelConfig"]
