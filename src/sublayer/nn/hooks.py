"""Whether a module must run through its submodules' own forwards: a hook is registered on one of them.

sublayer's modules compute with their children's parameters (the fused FFN reads ``fc1.weight``; attention reads
its projections'), which skips the children's ``forward`` and so their hooks. Where :func:`hooked` says a child
has one, the module calls its children instead, so a probe or steering hook on ``ffn.fc1`` or ``self_attn.q_proj``
sees every call.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _module  # the global hook registries live there

__all__ = ["hooked"]


def hooked(*modules: nn.Module, backward: bool = False) -> bool:
    """Whether a forward hook or pre-hook is registered on any of ``modules`` or their submodules, or globally
    (``torch.nn.modules.module.register_module_forward_hook``); with ``backward``, backward hooks count too.

    The hooks torch's tensor-parallel API registers on a sharded linear (``torch.distributed.tensor``) do not
    count: the parallel plan's style on the parent (:mod:`sublayer.parallel`) runs the fused math on the local
    shards.

    Raises:
        ValueError: a hook of the user's on such a sharded module, which its parent's style cannot run.
    """
    g = _module
    if g._global_forward_hooks or g._global_forward_pre_hooks:
        return True
    if backward and (g._global_backward_hooks or g._global_backward_pre_hooks):
        return True
    found = False
    for mod in modules:
        for m in mod.modules():
            kinds = [m._forward_hooks, m._forward_pre_hooks]
            if backward:
                kinds += [m._backward_hooks, m._backward_pre_hooks]
            if not any(kinds):
                continue
            hooks = [h for kind in kinds for h in kind.values()]
            mine = [h for h in hooks if not _tensor_parallel(h)]
            if mine and len(mine) < len(hooks):
                raise ValueError(
                    f"a hook on {type(m).__name__} cannot run: its parameters are tensor-parallel shards that the "
                    "parent's parallel style multiplies directly; register it on the parent (FFN, attention, block)"
                )
            found = found or bool(mine)
    return found


def _tensor_parallel(hook) -> bool:
    """Whether ``hook`` is one that torch's tensor-parallel API registered (``distribute_module``)."""
    return getattr(getattr(hook, "func", hook), "__module__", "").startswith("torch.distributed.tensor")
