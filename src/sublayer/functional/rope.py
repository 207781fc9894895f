"""Rotary position embeddings (RoPE): the one reference of their math.

Convention (Hugging Face ``LlamaRotaryEmbedding`` / ``rotate_half``, not the interleaved pairs of the original
paper): the head dim is split in two halves ``x = [x1, x2]``, and position ``p`` rotates the pair
``(x1[i], x2[i])`` by the angle ``p · inv_freq[i]``::

    inv_freq[i] = theta ** (-2i / head_dim),  i < head_dim / 2
    cos, sin    = cos(p · [inv_freq, inv_freq]), sin(p · [inv_freq, inv_freq])     (head_dim each)
    rotary(x)   = x · cos + [-x2, x1] · sin

Frequencies and angles are computed in float32, as Hugging Face does for every model dtype (also float64), so
that positions map to the same rotations as the checkpoints were trained with; :func:`rotary_cos_sin` returns
them in the dtype asked for.

Scaling (``rope_scaling`` of a Hugging Face config): ``{"rope_type": "llama3", "factor", "low_freq_factor",
"high_freq_factor", "original_max_position_embeddings"}`` (Llama 3.1/3.2): long wavelengths are divided by
``factor``, short ones kept, those in between interpolated smoothly. Other types are refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .._checks import check_positive_int, check_tensor

__all__ = ["ROPE_TYPES", "apply_rotary", "check_rope_scaling", "rotary_cos_sin", "rotary_inv_freq"]

ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling: object) -> dict[str, Any] | None:
    """A ``rope_scaling`` dict checked and normalised (``"type"`` read as ``"rope_type"``), or None for none.

    Returns:
        None for no scaling (None, or ``rope_type`` ``"default"``), else ``{"rope_type": "llama3", factor,
        low_freq_factor, high_freq_factor, original_max_position_embeddings}``.

    Raises:
        TypeError: not a dict. ValueError: a type other than those of :data:`ROPE_TYPES` (naming it), a missing
        llama3 key, a non-positive value, ``high_freq_factor <= low_freq_factor``.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling rope_type={kind!r}; supported: {', '.join(map(repr, ROPE_TYPES))}")
    if kind == "default":
        return None
    out: dict[str, Any] = {"rope_type": kind}
    for key in _LLAMA3_KEYS:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope_scaling {key} must be a number > 0 for rope_type 'llama3', got {value!r}")
        out[key] = value
    if not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(
            f"rope_scaling high_freq_factor ({out['high_freq_factor']}) must be greater than low_freq_factor "
            f"({out['low_freq_factor']})"
        )
    return out


def rotary_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """The rotation frequencies, (head_dim / 2,) float32 (HF's ``inv_freq``, bit for bit).

    Args:
        head_dim: even size of a head. theta: the base (HF ``rope_theta``). scaling: see :func:`check_rope_scaling`.

    Raises:
        ValueError: odd or non-positive head_dim, theta <= 0, bad scaling.
    """
    check_positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings (pairs of dims are rotated), got {head_dim}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"theta must be a number > 0, got {theta!r}")
    scaling = check_rope_scaling(scaling)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(
    position_ids: Tensor,
    head_dim: int,
    theta: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Cosines and sines of the rotation angles at ``position_ids`` (HF ``LlamaRotaryEmbedding.forward``).

    Args:
        position_ids: integer positions, any shape ``(...)``, typically (B, T) or (1, T).
        head_dim: even head size. theta: the base. scaling: see :func:`check_rope_scaling`.
        dtype: of the result (angles are computed in float32 whatever it is).

    Returns:
        ``(cos, sin)``, each ``(..., head_dim)``: the two halves repeat the same ``head_dim / 2`` angles.

    Raises:
        TypeError: positions not an integer tensor. ValueError: see :func:`rotary_inv_freq`.
    """
    check_tensor("position_ids", position_ids)
    if position_ids.is_floating_point() or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor, got dtype {position_ids.dtype}")
    inv_freq = rotary_inv_freq(head_dim, theta, scaling, device=position_ids.device)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs ``(x[..., i], x[..., i + d/2])`` by the angles of ``cos``/``sin``:
    ``x·cos + rotate_half(x)·sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``.

    Args:
        x: (B, H, T, head_dim) (or any ``(..., T, head_dim)``).
        cos, sin: (B | 1, T, head_dim) as :func:`rotary_cos_sin` gives (a head axis is inserted), or already
            broadcastable to ``x``.

    Returns:
        Tensor of the shape and dtype of ``x``.

    Raises:
        ValueError: ``cos``/``sin`` shapes that differ from each other or whose last dim is not ``x``'s.
    """
    check_tensor("x", x)
    check_tensor("cos", cos)
    check_tensor("sin", sin)
    if cos.shape != sin.shape or cos.shape[-1] != x.shape[-1] or x.shape[-1] % 2:
        raise ValueError(
            f"cos and sin must have one shape whose last dim is x's (even) head dim: got x {tuple(x.shape)}, "
            f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    if x.dim() == 4 and cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
