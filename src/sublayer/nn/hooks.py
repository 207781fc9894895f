"""Whether a module must run through its submodules' own forwards: a hook is registered on one of them.

sublayer's modules compute with their children's parameters (the fused FFN reads ``fc1.weight``; attention reads
its projections'), which skips the children's ``forward`` and so their hooks. Where :func:`hooked` says a child
has one, the module calls its children instead, so a probe or steering hook on ``ffn.fc1`` or ``self_attn.q_proj``
sees every call.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module  # the global hook registries live there

__all__ = ["hooked"]


def hooked(*modules: nn.Module, backward: bool = False) -> bool:
    """Whether a forward hook or pre-hook is registered on any of ``modules`` or their submodules, or globally
    (``torch.nn.modules.module.register_module_forward_hook``); with ``backward``, backward hooks count too.

    A module with DTensor parameters does not count: its hooks are the tensor-parallel plan's
    (:mod:`sublayer.parallel`), whose style on the parent runs the fused math on the local shards."""
    g = _module
    if g._global_forward_hooks or g._global_forward_pre_hooks:
        return True
    if backward and (g._global_backward_hooks or g._global_backward_pre_hooks):
        return True
    return any(
        (m._forward_hooks or m._forward_pre_hooks or (backward and (m._backward_hooks or m._backward_pre_hooks)))
        and not _sharded(m)
        for mod in modules
        for m in mod.modules()
    )


def _sharded(m: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in m._parameters.values())
