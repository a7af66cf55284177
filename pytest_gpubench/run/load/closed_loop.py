"""Closed loop: N requests in flight at all times, each sent as soon as the one before it on its
stream ended."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pytest_gpubench.run.load.driver import LoadRun


@dataclass(frozen=True)
class ClosedLoop:
    concurrency: int

    @property
    def connections(self) -> int:
        return self.concurrency

    @property
    def offered_rate(self) -> float | None:
        return None  # a closed loop offers what the engine takes

    async def drive(self, run: LoadRun) -> None:
        await asyncio.gather(*(self._stream(run) for _ in range(self.concurrency)))

    async def _stream(self, run: LoadRun) -> None:
        while True:
            window = run.window()
            if window is None:
                return
            await run.send(time.perf_counter_ns(), window)
