"""Ctrl-C (SIGINT) and SIGTERM during the demo: both stop training with a checkpoint, never inside a step.

While :func:`interrupts_raise` is active, both signals raise :class:`KeyboardInterrupt` (SIGTERM's default would
kill the process without a checkpoint: ``timeout``, ``docker stop``, a scheduler's time limit). Inside
:func:`hold_signals` (an optimizer step with its bookkeeping, a checkpoint's files) a signal is held and raised
when the block ends, so a checkpoint always sees whole steps. Only the main thread can handle signals; elsewhere
both are no-ops.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _raise(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def _handled(handler):
    """``handler`` for SIGINT and SIGTERM inside the block, the previous handlers after (off the main thread:
    nothing, signals cannot be handled there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def interrupts_raise():
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (previous handlers restored after)."""
    return _handled(_raise)


@contextlib.contextmanager
def hold_signals():
    """Hold SIGINT and SIGTERM until the block ends, then raise KeyboardInterrupt if one came."""
    got: list[int] = []
    try:
        with _handled(lambda signum, frame: got.append(signum)):
            yield
    finally:
        if got:
            raise KeyboardInterrupt(signal.Signals(got[0]).name)
