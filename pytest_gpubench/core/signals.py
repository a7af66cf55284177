"""SIGTERM, which CI sends when it cancels a job, handled as Ctrl-C: pytest then runs its own
teardown, so the end record, the summary, stopped servers and given-back rentals all happen."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class TerminateAsInterrupt:
    """Installs a SIGTERM handler that raises KeyboardInterrupt, and puts the old one back."""

    def __init__(self) -> None:
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        # Signal handlers can only be set from the main thread of the main interpreter.
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, _interrupt)
        self._installed = True

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"terminated by signal {signum}")
