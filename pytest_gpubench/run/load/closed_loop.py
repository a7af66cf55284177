"""Closed loop: N requests in flight at all times, each sent as soon as the one before it on its
stream ended."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pytest_gpubench.run.load.driver import LoadRun, wait_until
from pytest_gpubench.run.load.ramp import Ramp


@dataclass(frozen=True)
class ClosedLoop:
    concurrency: int
    # The concurrency's ramp (`ramp_s`): each stream starts when it is due, or None.
    ramp: Ramp | None = None

    @property
    def connections(self) -> int:
        return self.concurrency

    @property
    def offered_rate(self) -> float | None:
        return None  # a closed loop offers what the engine takes

    def facts(self) -> dict[str, object]:
        ramp = self.ramp.facts() if self.ramp is not None else None
        return {"pattern": "closed", "concurrency": self.concurrency, "rate": None, "ramp": ramp}

    async def drive(self, run: LoadRun) -> None:
        starts = (
            self.ramp.stream_starts_s(self.concurrency)
            if self.ramp is not None
            else [0.0] * self.concurrency
        )
        await asyncio.gather(*(self._stream(run, start_s) for start_s in starts))

    async def _stream(self, run: LoadRun, start_s: float) -> None:
        if start_s > 0:
            await wait_until(run.started_ns + int(start_s * 1e9))
        while True:
            window = run.window()
            if window is None:
                return
            await run.send(time.perf_counter_ns(), window)
