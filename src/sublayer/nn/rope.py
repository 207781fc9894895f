"""The rotary position embedding module: positions -> the ``(cos, sin)`` that attention rotates q and k by."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .. import functional as SF

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotary position embeddings (HF ``LlamaRotaryEmbedding`` math; see :mod:`sublayer.functional.rope`).

    No parameters and no buffers: the frequencies (head_dim / 2 numbers) are derived at each call, so the module
    survives ``to_empty``, ``.to(dtype)`` and the meta device without a stale or down-cast table.

    Args:
        head_dim: even size of one attention head.
        theta: the base (HF ``rope_theta``).
        scaling: HF ``rope_scaling`` dict (``llama3``) or None.
        device, dtype: accepted like every module's factory kwargs; there are no parameters to place.

    Forward:
        ``position_ids`` (B, T) or (1, T) integers; ``dtype`` of the result (default float32). Returns
        ``(cos, sin)``, each (B | 1, T, head_dim), for :class:`~sublayer.nn.MultiHeadAttention`'s ``rotary=``.

    Raises:
        ValueError: odd or non-positive head_dim, theta <= 0, an unsupported scaling type (naming it).
    """

    def __init__(
        self,
        head_dim: int,
        *,
        theta: float = 10000.0,
        scaling: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.scaling = SF.check_rope_scaling(scaling)
        SF.rotary_inv_freq(head_dim, theta, self.scaling)  # validates head_dim and theta
        self.head_dim, self.theta = head_dim, float(theta)

    def forward(self, position_ids: Tensor, *, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        return SF.rotary_cos_sin(position_ids, self.head_dim, self.theta, self.scaling, dtype=dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}"
