"""SIGTERM, which CI sends when it cancels a job, handled as Ctrl-C: pytest then runs its own
teardown, so the end record, the summary, stopped servers and given-back rentals all happen. Both
wait out the instructions where Python knows no line, which pytest cannot report (_redelivered)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

# What `held` keeps back: Ctrl-C (SIGINT) and CI's cancel (SIGTERM, once installed).
_HELD = (signal.SIGINT, signal.SIGTERM)


class TerminateAsInterrupt:
    """Installs a SIGTERM handler that raises KeyboardInterrupt, and puts the old one back. Ctrl-C
    (SIGINT) keeps Python's own behaviour, through a handler that also waits out an instruction
    without a line (_redelivered); a SIGINT handler someone else installed is left alone."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._installed = False

    def install(self) -> None:
        # Signal handlers can only be set from the main thread of the main interpreter.
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _interrupt)}
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, _ctrl_c)
        self._installed = True

    def restore(self) -> None:
        if self._installed:
            for number, handler in self._previous.items():
                signal.signal(number, handler)
            self._installed = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Ctrl-C and SIGTERM that land inside are delivered at its end, so that what is done
        inside is never done by half: a call record kept in memory is also in the ledger (the
        end record's count of calls matched the ledger's lines less one otherwise)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        pending: list[int] = []
        previous = {number: signal.signal(number, _hold(pending)) for number in _HELD}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
            for signum in pending[:1]:
                signal.raise_signal(signum)  # now handled as it would have been


# How long a signal that landed where no line is known waits to be sent again.
REDELIVER_S = 0.01


def _interrupt(signum: int, frame: FrameType | None) -> None:
    if not _redelivered(signum, frame):
        raise KeyboardInterrupt(f"terminated by signal {signum}")


def _ctrl_c(signum: int, frame: FrameType | None) -> None:
    """Python's own Ctrl-C (signal.default_int_handler), where the frame has a line."""
    if not _redelivered(signum, frame):
        signal.default_int_handler(signum, frame)


def _redelivered(signum: int, frame: FrameType | None) -> bool:
    """Python 3.11 can stop a frame for a signal at an instruction that has no line number
    (python/cpython#94485). A KeyboardInterrupt raised there cannot be reported by pytest (its
    report of the interrupt failed with a TypeError on the missing line: exit 1 and a
    traceback): the signal is sent again in REDELIVER_S, when the frame has moved on, by a
    timer thread (sent from here it would be handled inside this handler and raised at the same
    instruction). False where the frame has a line, or where no thread can start (the
    interpreter is shutting down): then the handler raises now."""
    if frame is None or frame.f_lineno is not None:
        return False
    timer = threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum))
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:
        return False
    return True


def _hold(pending: list[int]) -> Any:
    def hold(signum: int, frame: FrameType | None) -> None:
        pending.append(signum)

    return hold
