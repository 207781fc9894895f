"""When a fast path may run instead of the modules' own forwards: one rule for every fast path.

A fast path (padding-free rows, the decoding step, the translate encoder, ``fast_inference``) computes what the
modules compute without calling every module's ``forward``. It therefore steps aside for the reference path when

* any module it would replace has a forward hook or pre-hook (blocks, attention, FFN, norms, embeddings — any
  submodule, and the global hooks of ``torch.nn.modules.module.register_module_forward_hook``), so hooks always see
  the modules' own calls with the padded layout (:func:`sublayer.record_attention`, steering hooks, probes);
* the model is sharded (DTensor parameters: tensor parallel, FSDP2), whose redistributing hooks the fast paths do
  not reproduce.

The decoding step and the translate encoder, which multiply in their weights' dtype, also step aside while CPU
autocast is on (:func:`autocast_on`): ``generate`` and ``translate`` then run every forward under autocast, as
Hugging Face's ``generate`` does. (``fast_inference``'s forms ignore autocast: their dtype decides.)
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.hooks import hooked

__all__ = ["has_hooks", "sharded", "fast_path_allowed", "autocast_on"]


def has_hooks(model: nn.Module) -> bool:
    """Whether a forward hook or pre-hook is registered on ``model``'s submodules (or globally)."""
    return hooked(*model.children())


def sharded(model: nn.Module) -> bool:
    """Whether some parameter is a DTensor (tensor-parallel / FSDP2 model)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def fast_path_allowed(model: nn.Module) -> bool:
    """The rule of the module docstring: not sharded and no hooks."""
    return not has_hooks(model) and not sharded(model)


def autocast_on() -> bool:
    """Whether ``torch.autocast("cpu", ...)`` is on: the fast paths that compute in their weights' dtype (the
    decoding step, the translate encoder) step aside for the modules' own forwards, which follow it."""
    return torch.is_autocast_enabled("cpu")
