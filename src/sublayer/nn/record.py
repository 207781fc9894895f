"""Recording attention maps: every :class:`MultiHeadAttention` inside a module, per call, per head.

Blocks, stacks and models call their attention without asking for weights (so that the fast SDPA kernels run);
:func:`record_attention` makes them compute and keep the per-head weights for the length of a ``with`` block,
without changing what any call returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from .attention import MultiHeadAttention

__all__ = ["record_attention"]


@contextmanager
def record_attention(module: nn.Module, *, detach: bool = True) -> Iterator[dict[str, list[Tensor]]]:
    """Record the per-head attention weights of every :class:`MultiHeadAttention` in ``module``.

    Inside the ``with`` block each attention call computes its weights explicitly (the slower, non-SDPA path;
    outputs are equal within fp32 rounding) and appends them to the yielded dict; what each call returns is
    unchanged (a caller that asked for averaged weights still gets them averaged).

    Example::

        with record_attention(encoder) as maps:
            encoder(x, key_padding_mask=pad)
        maps["layers.0.self_attn"][0]  # (B, n_heads, T_q, T_k), rows sum to 1 (0 for fully masked rows)

    Subclasses with a ``forward`` of their own (:mod:`sublayer.d2l`'s, which keep the book's ``attention_weights``)
    are not recorded.

    Args:
        module: a block, stack or model (or a :class:`MultiHeadAttention` itself, recorded as ``"attention"``).
        detach: keep detached tensors (default); False keeps them in the autograd graph.

    Yields:
        dict: qualified module name (``module.named_modules()`` order) -> list of (B, n_heads, T_q, T_k)
        tensors, one per call (decoding with a KV cache makes one call per step). Attention modules that were
        not called are left out when the block exits. Weights taken in training include attention dropout.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``. ValueError: it holds no :class:`MultiHeadAttention`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    # subclasses with a forward of their own (sublayer.d2l's, which keep ``attention_weights``) are left alone
    targets = [
        (name or "attention", m)
        for name, m in module.named_modules()
        if isinstance(m, MultiHeadAttention) and type(m).forward is MultiHeadAttention.forward
    ]
    if not targets:
        raise ValueError(f"module ({type(module).__name__}) holds no sublayer MultiHeadAttention to record")
    maps: dict[str, list[Tensor]] = {name: [] for name, _ in targets}
    handles = []

    def make_hooks(name: str):
        asked: list[tuple[bool, bool]] = []  # the caller's (need_weights, average_attn_weights), one per call

        def pre(mod, args, kwargs):
            asked.append((kwargs.get("need_weights", False), kwargs.get("average_attn_weights", True)))
            return args, {**kwargs, "need_weights": True, "average_attn_weights": False}

        def post(mod, args, kwargs, output):
            out, weights = output
            need, average = asked.pop()
            maps[name].append(weights.detach() if detach else weights)
            if not need:
                return out, None
            return out, (weights.mean(dim=1) if average else weights)

        return pre, post

    for name, m in targets:
        pre, post = make_hooks(name)
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        yield maps
    finally:
        for h in handles:
            h.remove()
        for name in [n for n, v in maps.items() if not v]:
            del maps[name]
