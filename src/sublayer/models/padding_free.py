"""The old import path of :mod:`sublayer.runtime.padding_free` (re-exported)."""

from ..runtime.padding_free import *  # noqa: F403
from ..runtime.padding_free import __all__  # noqa: F401
