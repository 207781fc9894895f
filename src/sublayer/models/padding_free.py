"""The old import path of :mod:`sublayer.runtime.padding_free` (re-exported)."""

from ..runtime.padding_free import PackedBatch, applies, disabled, enabled, set_enabled

__all__ = ["enabled", "set_enabled", "disabled", "applies", "PackedBatch"]
