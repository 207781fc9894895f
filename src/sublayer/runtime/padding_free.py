"""Padding-free execution: a padded batch runs as packed rows through the model's own blocks.

When a padding mask marks padding (or GPT-2's ``position_ids`` restart at 0: packed documents), a model builds a
:class:`sublayer.functional.packing.PackedBatch` and passes it through its one forward: the embeddings, projections,
FFNs, norms and the LM head run on the packed rows only, attention reads the descriptor (one attention per
sequence on the packed rows for few rows, else scattered into the padded layout with its masks). The modules are
the model's own (same parameters, dropout placement and probabilities), so with dropout 0 the outputs and every
gradient equal the padded path's; with dropout the masks are drawn over the rows that run (the same distribution,
not the same stream).

Which positions run is decided on the padded layout's meaning, so the switch changes speed only: a loss runs every
position that has a target (with left padding the last padded position predicts the first token; with
``labels=input_ids`` padded positions carry labels), BERT's pooler runs position 0 even when it is padding.
Outputs keep their shapes; positions that did not run hold zeros (the padded path returns zeros there too).

The path steps aside (the padded path runs) by the rule of :mod:`sublayer.runtime.rules`: a sharded model or any
forward hook on a submodule. ``set_enabled(False)`` (or ``with padding_free.disabled():``) switches it off for
every model: the padded path is the reference the tests compare with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ..functional.packing import PackedBatch
from .rules import fast_path_allowed

__all__ = ["enabled", "set_enabled", "disabled", "applies", "PackedBatch"]

_enabled = True


def enabled() -> bool:
    """Whether the models take the padding-free path when a mask marks padding."""
    return _enabled


def set_enabled(flag: bool) -> None:
    """Switch the padding-free path on or off for every model (on by default).

    Raises:
        TypeError: ``flag`` is not a bool.
    """
    global _enabled
    if not isinstance(flag, bool):
        raise TypeError(f"flag must be a bool, got {flag!r}")
    _enabled = flag


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the block with the padded path (restores the previous setting afterwards)."""
    old = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(old)


def applies(model: nn.Module, *masks: Tensor | None) -> bool:
    """True when the path is on, one of the bool masks (True = padding / another document) marks something, and
    the fast-path rule allows it (:func:`sublayer.runtime.rules.fast_path_allowed`)."""
    return (
        _enabled
        and any(m is not None and m.dtype == torch.bool and m.numel() > 0 and bool(m.any()) for m in masks)
        and fast_path_allowed(model)
    )

