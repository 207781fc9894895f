"""Prepared weights: the one place that derives them from a module's parameters, and notices every change.

A fast path multiplies weights in a prepared form (packed panels, fused q|k|v, a float16 screening copy of the LM
head, another dtype). :func:`prepared` builds that form once per module and key, keeps it (weakly, per module)
and rebuilds it when the parameters it came from change, whichever way they changed:

* an optimizer step — for-loop, ``foreach`` or ``fused``: every ``torch.optim.Optimizer.step`` is seen through
  ``torch.optim.optimizer.register_optimizer_step_post_hook`` (fused steps do not move the parameters' version counters);
* an in-place write under ``no_grad``, ``load_state_dict``, ``.to()`` / a replaced parameter: version counter,
  storage, dtype, device and shape;
* a write through ``param.data`` (which bypasses the version counter): each weight is sampled at fixed positions
  (up to :data:`SAMPLES` per tensor) on every use, so a write that touches the whole weight (scaling, copying,
  re-initialising) is noticed; after a write to a few elements through ``.data``, call :func:`clear_cache` (or
  write without ``.data``, under ``torch.no_grad()``, which the version counter records);
* inference tensors (made under ``torch.inference_mode``) have no version counter: a checksum of each one's whole
  contents (an integer sum of its bits: one read of the weights per use) stands in for it;
* a norm's ``eps`` or an FFN's ``activation`` set after construction: the modules' ``eps`` and ``activation``
  attributes are part of the stamp.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["prepared", "pinned", "clear_cache", "stamp", "SAMPLES"]

SAMPLES = 16  # positions sampled per weight tensor (spread evenly over its elements)

_steps: dict[int, int] = {}  # id(parameter) -> optimizer steps taken on it


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            _steps[id(p)] = _steps.get(id(p), 0) + 1


register_optimizer_step_post_hook(_after_step)

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {key: (stamp, value)}
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (meta, each parameter's sample view)


def _sample(p: Tensor) -> Tensor:
    """Up to :data:`SAMPLES` elements spread evenly over ``p`` (views: one strided slice, no copy)."""
    flat = p.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES]


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> the int view summed


def _version(p: Tensor) -> int:
    """``p``'s version counter; for an inference tensor (none kept), the integer sum of its bits."""
    if not p.is_inference():
        return p._version
    with torch.inference_mode():
        return int(p.detach().reshape(-1).view(_INT[p.element_size()]).sum())


def stamp(module: nn.Module) -> tuple:
    """What the prepared form of ``module`` depends on: per parameter its version counter (a checksum for inference
    tensors), storage, strides, dtype, device, shape and optimizer steps, the sampled values of every parameter, and
    the submodules' ``eps`` and ``activation``.

    The sample views of contiguous parameters are kept while their storage and layout stay the same (a view reads
    what is in the storage now, writes through ``.data`` included); the others are sampled anew each time."""
    params, settings, seen = [], [], set()  # one walk: module.parameters()' order, every float eps and str activation
    for m in module.modules():
        if isinstance(e := m.__dict__.get("eps"), float):
            settings.append(e)
        if isinstance(a := m.__dict__.get("activation"), str):
            settings.append(a)
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    meta = tuple(
        (_version(p), p.data_ptr(), p.stride(), p.dtype, p.device, tuple(p.shape), _steps.get(id(p), 0))
        for p in params
    ) + tuple(settings)
    if not params:
        return meta, ()
    kept = _VIEWS.get(module)
    if kept is None or kept[0] != meta:
        kept = (meta, [_sample(p) if p.is_contiguous() else None for p in params])
        _VIEWS[module] = kept
    with torch.no_grad():
        samples = torch.cat([_sample(p) if v is None else v for p, v in zip(params, kept[1])]).tolist()
    return meta, tuple(samples)


_PINNED: ContextVar[dict | None] = ContextVar("sublayer_pinned_weights", default=None)


@contextlib.contextmanager
def pinned(on: bool = True) -> Iterator[None]:
    """Inside the block each ``(module, key)`` is checked once and each module's parameters stamped once: one call
    (a ``generate``) that asks for the same prepared form several times (prompt, steps, head), or for two forms of
    one model, reads the parameters' stamp once. ``pinned(False)``: every use checked again inside (a user's
    callback in the middle of such a call, which may change weights)."""
    token = _PINNED.set({} if on else None)
    try:
        yield
    finally:
        _PINNED.reset(token)


def prepared(module: nn.Module, key: Hashable, build: Callable[[nn.Module], Any]) -> Any:
    """``build(module)``'s result, built once per ``(module, key)`` and rebuilt whenever a parameter of ``module``
    changed (see the module docstring). ``key`` tells apart forms that depend on more than the weights (e.g.
    whether the kernels are on, a compute dtype)."""
    memo = _PINNED.get()
    if memo is None:
        return _prepared(module, key, build, stamp(module))
    if (hit := memo.get((id(module), key))) is not None and hit[0] is module:
        return hit[1]
    if (s := memo.get(id(module))) is None or s[0] is not module:  # the module's stamp, once per block
        s = memo[id(module)] = (module, stamp(module))
    value = _prepared(module, key, build, s[1])
    memo[(id(module), key)] = (module, value)
    return value


def _prepared(module: nn.Module, key: Hashable, build: Callable[[nn.Module], Any], s: tuple) -> Any:
    """``prepared`` given ``module``'s :func:`stamp` ``s``."""
    entries = _CACHE.setdefault(module, {})
    hit = entries.get(key)
    if hit is not None and hit[0] == s:
        return hit[1]
    entries.pop(key, None)  # free the old form before building the new one
    with torch.no_grad(), torch.inference_mode(False):
        value = build(module)
    entries[key] = (s, value)
    return value


def clear_cache(module: nn.Module | None = None) -> None:
    """Drop the prepared forms of ``module`` (None: of every module)."""
    if module is None:
        _CACHE.clear()
    else:
        _CACHE.pop(module, None)
