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


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def interrupts_raise():
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (previous handlers restored after)."""
    if not _on_main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def hold_signals():
    """Hold SIGINT and SIGTERM until the block ends, then raise KeyboardInterrupt if one came."""
    if not _on_main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            raise KeyboardInterrupt(signal.Signals(got[0]).name)
