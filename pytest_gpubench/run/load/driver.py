"""One load point while it runs: the connection pool, the window bounds (warm-up, measured,
cool-down), and sending one request at its scheduled time with the send lag stamped. Replies are
kept raw (their reads stamped) while the point runs and parsed once it has ended: a reply parsed
in the event loop held the next scheduled send behind it."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.engines import measure_response, parse_openai_sse
from pytest_gpubench.measure.load_client import (
    ConnectionPool,
    DroppedConnection,
    RawResponse,
    request_bytes,
)
from pytest_gpubench.measure.stream import CallMeasurement, Endpoint, StreamError, TlsSettings

Window = Literal["warmup", "measured", "cooldown"]
# Before a scheduled send the loop sleeps until this long before it, then spins: epoll rounds
# its timeout up to whole milliseconds, and the wake-up came up to 1.1 ms after the target on a
# quiet 2-core VM (a 1.2 ms spin left p99 0.8 ms; 2.5-3 ms, 0.004-0.03 ms). Not much longer: on a
# machine busy with other work a process that spins is the first to lose its core (3 ms made the
# send lag p99 worse there, 4-10 ms against 0.6-0.9 ms). At most SPIN_SHARE of the gap.
SPIN_NS = 2_500_000
SPIN_SHARE = 0.1
TIMED_OUT = "did not finish within"


@dataclass(frozen=True)
class Sent:
    """One request of a load point: when it was due, when it went out, and what it measured.
    Times are perf_counter_ns."""

    index: int
    window: Window
    scheduled_ns: int
    sent_ns: int
    measurement: CallMeasurement
    # Which of the point's client processes sent it (`processes: N`; 0 with one).
    process: int = 0

    @property
    def send_lag_ms(self) -> float:
        return round(max(0, self.sent_ns - self.scheduled_ns) / 1e6, 4)


@dataclass(frozen=True)
class Received:
    """A reply as it came, not parsed yet: what `send` keeps while the point runs."""

    index: int
    window: Window
    scheduled_ns: int
    raw: RawResponse
    reconnected: bool
    connection_reused: bool
    process: int

    def parsed(self, backend: str) -> Sent:
        measurement = measure_response(backend, self.raw.streamed(), parse_openai_sse)
        measurement.reconnected = self.reconnected
        measurement.connection_reused = self.connection_reused
        return Sent(
            self.index, self.window, self.scheduled_ns, self.raw.sent_ns, measurement, self.process
        )


@dataclass(frozen=True)
class Target:
    """What every request of a load point sends, and where."""

    backend: str
    endpoint: Endpoint
    request: bytes
    timeout_s: float
    # The cell's headers (an API key among them), for the engine's /metrics too.
    headers: tuple[tuple[str, str], ...] = ()
    # An https:// endpoint's client context (the cell's ca_file, tls_verify).
    tls: ssl.SSLContext | None = None


class Bounds:
    """Which window a request due now falls in: warm-up for `warmup_s`, then measured until
    `duration_s` has passed or `requests` were sent, then cool-down for `cooldown_s`; None once
    all three are over (no request is sent after that)."""

    def __init__(self, profile: LoadProfile, started_ns: int) -> None:
        self.measured_from = started_ns + int(profile.warmup_s * 1e9)
        self.measured_until = (
            self.measured_from + int(profile.duration_s * 1e9)
            if profile.duration_s is not None
            else None
        )
        self.requests = profile.requests
        self.cooldown_ns = int(profile.cooldown_s * 1e9)
        self.cooldown_until: int | None = None
        self.measured = 0

    def window(self, now_ns: int) -> Window | None:
        if now_ns < self.measured_from:
            return "warmup"
        if self.cooldown_until is None:
            in_time = self.measured_until is None or now_ns < self.measured_until
            in_count = self.requests is None or self.measured < self.requests
            if in_time and in_count:
                self.measured += 1
                return "measured"
            self.cooldown_until = now_ns + self.cooldown_ns
        return "cooldown" if now_ns < self.cooldown_until else None


class LoadRun:
    """Sends the requests of one load point and keeps every one it sent."""

    def __init__(self, target: Target, profile: LoadProfile, process: int = 0) -> None:
        self.target = target
        self.profile = profile
        self.process = process
        self.pool = ConnectionPool(
            target.endpoint, connect_timeout_s=min(target.timeout_s, 10.0), tls=target.tls
        )
        self._sent: list[Sent | Received] = []
        self.bounds = Bounds(profile, time.perf_counter_ns())
        self.started_ns = 0
        self.next_index = 0

    async def open(self, connections: int) -> None:
        """Open the connections the point needs before its clock starts."""
        await self.pool.fill(connections)
        self.start(time.perf_counter_ns())

    def start(self, started_ns: int) -> None:
        """Start the point's clock (processes of one point share one start)."""
        self.started_ns = started_ns
        self.bounds = Bounds(self.profile, started_ns)

    def window(self) -> Window | None:
        return self.bounds.window(time.perf_counter_ns())

    @property
    def sent(self) -> list[Sent]:
        """Every request sent, its reply parsed now (once): read it after the point."""
        backend = self.target.backend
        self._sent = [
            item.parsed(backend) if isinstance(item, Received) else item for item in self._sent
        ]
        return [item for item in self._sent if isinstance(item, Sent)]

    async def send(self, scheduled_ns: int, window: Window) -> None:
        """One request, due at `scheduled_ns`: sent as soon as a connection is at hand."""
        target = self.target
        index, self.next_index = self.next_index, self.next_index + 1
        sent_ns = time.perf_counter_ns()
        reconnected = False
        try:
            connection = await self.pool.take()
            try:
                raw = await connection.exchange(target.request, target.timeout_s)
            except DroppedConnection:
                if connection.exchanges <= 1 and not connection.lost:
                    raise
                # A kept connection the server had closed: sent again on a new one, once; the
                # send lag counts the lost attempt.
                self.pool.dropped()
                reconnected = True
                connection = await self.pool.take()
                raw = await connection.exchange(target.request, target.timeout_s)
        except StreamError as exc:
            measurement = CallMeasurement(backend=target.backend, error=str(exc))
            self._sent.append(Sent(index, window, scheduled_ns, sent_ns, measurement, self.process))
            return
        if not raw.keep_alive:
            self.pool.server_closes = True
        # Reused only after a whole 200 reply (the reader found its end): its stream's content is
        # parsed after the point, and an error event inside it leaves the HTTP framing intact.
        self.pool.give_back(connection, raw.keep_alive and raw.status == 200)
        self._sent.append(
            Received(
                index,
                window,
                scheduled_ns,
                raw,
                reconnected,
                connection.exchanges > 1,
                self.process,
            )
        )

    async def close(self) -> None:
        await self.pool.close()


def spin_ns(rate: float) -> int:
    """How long to spin before each send at `rate` requests/s."""
    return int(min(SPIN_NS, SPIN_SHARE * 1e9 / rate))


async def wait_until(
    target_ns: int, spin: int = SPIN_NS, clock: Callable[[], int] = time.perf_counter_ns
) -> None:
    """Sleep until `spin` ns before `target_ns`, then spin to it (sub-millisecond send lag).
    Yields to the loop at least once, so that a send just scheduled goes out before the spin."""
    delay_ns = target_ns - clock() - spin
    await asyncio.sleep(max(0.0, delay_ns / 1e9))
    while clock() < target_ns:
        pass


def build_target(
    backend: str,
    base_url: str,
    payload: bytes,
    headers: dict[str, str],
    timeout_s: float,
    tls: TlsSettings | None = None,
) -> Target:
    endpoint = Endpoint.parse(base_url)
    pairs = tuple(headers.items())
    request = request_bytes(endpoint, "/v1/chat/completions", payload, pairs)
    context = (tls or TlsSettings()).context() if endpoint.scheme == "https" else None
    return Target(backend, endpoint, request, timeout_s, pairs, context)
