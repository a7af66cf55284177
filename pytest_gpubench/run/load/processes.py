"""`processes: N`: one load point sent from N client processes (spawned, each with its own event
loop and connections), their clocks started together; each request keeps the process that sent
it, so that each process's send lag is its own. A process that dies mid-point is named with how
it ended: the point then has only the others' requests, and no figure is drawn from them."""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import time
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any

from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.run.load import LoadPattern, ramp_seconds
from pytest_gpubench.run.load.closed_loop import ClosedLoop
from pytest_gpubench.run.load.driver import LoadRun, Sent, Target, wait_until
from pytest_gpubench.run.load.open_loop import OpenLoop

# The start is set this far ahead of the moment every process said it was ready.
START_AHEAD_NS = 100_000_000
READY_TIMEOUT_S = 60.0


def share(pattern: LoadPattern, process: int, processes: int) -> LoadPattern:
    """What one process sends: its streams of a closed loop (spread as evenly as they go), or
    rate/N of an open loop (Poisson and gamma with a seed of its own: N independent Poisson
    arrivals at rate/N are one Poisson at the rate; constant ones interleave)."""
    if isinstance(pattern, ClosedLoop):
        base, extra = divmod(pattern.concurrency, processes)
        return ClosedLoop(base + (1 if process < extra else 0), pattern.ramp)
    if isinstance(pattern, OpenLoop):
        rate = pattern.rate / processes
        return replace(
            pattern,
            rate=rate,
            seed=pattern.seed * 1000 + process,
            offset_s=process / pattern.rate if pattern.arrival == "constant" else 0.0,
        )
    raise GpubenchError(f"processes: cannot split a {type(pattern).__name__} load")


def profile_share(profile: LoadProfile, process: int, processes: int) -> LoadProfile:
    """One client's profile: its share of `requests` (spread as evenly as they go)."""
    if profile.requests is None:
        return profile
    base, extra = divmod(profile.requests, processes)
    return profile.model_copy(update={"requests": max(1, base + (1 if process < extra else 0))})


def _worker(
    target: Target, profile: LoadProfile, pattern: Any, process: int, pipe: Connection
) -> None:
    async def main() -> list[Sent]:
        run = LoadRun(target, profile, process, ramp_seconds(pattern))
        try:
            await run.pool.fill(pattern.connections)
            pipe.send("ready")
            started_ns = pipe.recv()
            run.start(started_ns)
            await wait_until(started_ns)
            await pattern.drive(run)
        finally:
            await run.close()
        return run.sent

    try:
        pipe.send(("sent", asyncio.run(main())))
    except Exception as exc:  # the parent turns it into one line
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))


def _ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


def run_in_processes(
    target: Target, profile: LoadProfile, pattern: LoadPattern
) -> tuple[int, list[Sent], list[str]]:
    """(the shared start, every request of the processes that ended whole, why each other one
    is lost: it died mid-point, or failed)."""
    processes = profile.processes
    context = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    for process in range(processes):
        parent, child = context.Pipe()
        worker = context.Process(
            target=_worker,
            args=(
                target,
                profile_share(profile, process, processes),
                share(pattern, process, processes),
                process,
                child,
            ),
            daemon=True,
        )
        worker.start()
        # Only the worker holds its end: once it dies, reading the pipe ends (EOFError).
        child.close()
        pipes.append(parent)
        workers.append(worker)
    try:
        for pipe in pipes:
            if not pipe.poll(READY_TIMEOUT_S):
                raise GpubenchError(
                    f"processes: a client process did not start in {READY_TIMEOUT_S:g} s"
                )
            answer = pipe.recv()
            if answer != "ready":
                raise GpubenchError(f"processes: a client process failed: {answer[1]}")
        started_ns = time.perf_counter_ns() + START_AHEAD_NS
        for pipe in pipes:
            pipe.send(started_ns)
        sent: list[Sent] = []
        lost: list[str] = []
        for process, (pipe, worker) in enumerate(zip(pipes, workers, strict=True)):
            wait([pipe, worker.sentinel])
            try:
                kind, value = pipe.recv()
            except EOFError:
                worker.join(timeout=5)
                lost.append(
                    f"client process {process} of {processes} died mid-point "
                    f"({_ended(worker.exitcode)})"
                )
                continue
            if kind == "error":
                lost.append(f"client process {process} of {processes} failed: {value}")
                continue
            sent.extend(value)
        return started_ns, sorted(sent, key=lambda item: (item.scheduled_ns, item.process)), lost
    finally:
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.terminate()
