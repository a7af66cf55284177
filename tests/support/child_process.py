"""A test's timed server (a proxy, a stand-in engine) in a process of its own, so that a load
client run in the test's own process (pytester's in-process runs) shares no interpreter lock with
its threads: its timing is then its own. The parent reads and sets its knobs through values shared
with the child (`SPAWN.RawValue`)."""

from __future__ import annotations

import multiprocessing

# Imported here, at collection: pytester drops the modules first imported during a test, and a
# later test's shared value would then pickle a class that is no longer the module's.
import multiprocessing.heap
import multiprocessing.popen_spawn_posix
import multiprocessing.sharedctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

SPAWN = multiprocessing.get_context("spawn")


@contextmanager
def server_process(target: Callable[..., None], args: tuple[Any, ...], what: str) -> Iterator[str]:
    """Run `target(*args, ready)` in a spawned process until the block ends; the URL it sends on
    `ready` (see `serve_until_killed`)."""
    receiving, sending = SPAWN.Pipe(duplex=False)
    process = SPAWN.Process(target=target, args=(*args, sending), daemon=True)
    process.start()
    try:
        if not receiving.poll(60):
            raise RuntimeError(f"{what} did not start within 60 s")
        yield receiving.recv()
    finally:
        process.kill()
        process.join(timeout=10)


def serve_until_killed(url: str, ready: Connection) -> None:
    """In the child: tell the parent the server's URL, then serve (on the server's own threads)
    until the parent kills the process."""
    ready.send(url)
    threading.Event().wait()
