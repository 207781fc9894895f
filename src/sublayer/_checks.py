"""Argument checks shared by the functional ops and the modules.

Every check raises a ``ValueError``/``TypeError`` that names the argument, its value and the rule, so that a
user's mistake never surfaces as a bare ``assert`` or a deep traceback from inside torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = [
    "check_input_ids",
    "check_attention_mask",
    "check_positive_int",
    "check_probability",
    "check_choice",
    "check_eps",
    "check_finite",
    "normalize_shape",
    "check_last_dims",
    "check_same_shape",
    "check_tensor",
    "check_same_dtype_device",
    "check_input_weight",
    "check_param_shape",
]


def check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")


def check_probability(name: str, value: object) -> None:
    """Dropout probabilities live in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {value!r} ({type(value).__name__})")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


def check_eps(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive float, got {value!r} ({type(value).__name__})")
    if not float(value) > 0.0:
        raise ValueError(f"{name} must be > 0, got {value}")


def check_finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a finite float, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float, got {value}")


def check_choice(name: str, value: object, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")


def normalize_shape(name: str, shape: int | Sequence[int] | torch.Size) -> tuple[int, ...]:
    """``int | sequence of int`` -> tuple of positive ints (as ``nn.LayerNorm`` accepts)."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, got {shape!r}") from None
    if not dims:
        raise ValueError(f"{name} must not be empty, got {shape!r}")
    for d in dims:
        check_positive_int(f"{name} entry", d)
    return dims


def check_tensor(name: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_last_dims(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    """The trailing dims of ``x`` must equal ``shape`` (the normalized/feature shape)."""
    check_tensor(name, x)
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != tuple(shape):
        raise ValueError(
            f"{name} must end with dims {tuple(shape)} (normalized_shape/feature size), "
            f"got shape {tuple(x.shape)}"
        )


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def check_same_dtype_device(**tensors: torch.Tensor | None) -> None:
    """All given tensors share one dtype and one device (names appear in the message)."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    n0, t0 = items[0]
    for n, t in items[1:]:
        if t.dtype != t0.dtype:
            raise TypeError(f"{n} dtype {t.dtype} does not match {n0} dtype {t0.dtype}")
        if t.device != t0.device:
            raise ValueError(f"{n} device {t.device} does not match {n0} device {t0.device}")


def check_input_weight(x_name: str, x: torch.Tensor, w_name: str, w: torch.Tensor) -> None:
    """A layer's input ``x`` has its weight ``w``'s dtype and device, unless autocast casts both (the meta device
    has no autocast: ``torch.is_autocast_enabled("meta")`` raises, so it is checked)."""
    if x.device.type == "meta" or not torch.is_autocast_enabled(x.device.type):
        check_same_dtype_device(**{x_name: x, w_name: w})


def check_param_shape(name: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    """``t`` is None or a tensor of exactly ``shape`` (a norm's weight/bias: no silent broadcasting)."""
    if t is None:
        return
    check_tensor(name, t)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (normalized_shape), got {tuple(t.shape)}")


def check_input_ids(
    name: str, ids: object, vocab_size: int | None, max_len: int | None = None, *, limit_name: str = "vocab_size"
) -> None:
    """``ids`` must be an int64/int32 tensor (B, T), T >= 1, values in [0, vocab_size) (>= 0 when vocab_size is
    None), T <= max_len. ``limit_name`` names ``vocab_size`` in the error (``max_positions`` for position ids...)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):  # what embedding lookups take (uint8/bool would mask-index)
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype} (int64 or int32: use .long())")
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"{name} must have shape (batch, seq_len) with seq_len >= 1, got {tuple(ids.shape)}")
    if max_len is not None and ids.shape[1] > max_len:
        raise ValueError(f"{name} has {ids.shape[1]} positions, more than max_positions={max_len}")
    if ids.numel() == 0 or torch.compiler.is_compiling():
        return  # the value checks read the data: skipped while torch.compile traces (a graph cannot branch on data)
    if vocab_size is None:
        if int(ids.min()) < 0:
            raise ValueError(f"{name} must be >= 0, got a minimum of {int(ids.min())}")
    elif int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(
            f"{name} must lie in [0, {limit_name}={vocab_size}), got values in [{int(ids.min())}, {int(ids.max())}]"
        )


def check_attention_mask(mask: object, shape: tuple[int, ...]) -> Tensor:
    """HF attention mask (1 = token, 0 = pad), (B, T) -> our key_padding_mask (True = pad)."""
    check_tensor("attention_mask", mask)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.numel() and not torch.compiler.is_compiling() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    return mask == 0
