"""One load point while it runs: the connection pool, the window bounds (warm-up, measured,
cool-down), and sending one request at its scheduled time with the send lag stamped. Replies are
kept raw (their reads stamped) while the point runs and parsed once it has ended: a reply parsed
in the event loop held the next scheduled send behind it."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.engines import measure_response, parse_openai_sse
from pytest_gpubench.measure.call_measurement import CallMeasurement
from pytest_gpubench.measure.load_client import (
    ConnectionPool,
    DroppedConnection,
    RawResponse,
    request_bytes,
)
from pytest_gpubench.measure.stream import Endpoint, StreamError, TlsSettings
from pytest_gpubench.run.load.adapters import AdapterChoice

Window = Literal["ramp", "warmup", "measured", "cooldown"]
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
    # A multi-turn session's request (`turns:`): the session's index and this turn (0-based).
    session: int | None = None
    turn: int | None = None

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
    session: int | None = None
    turn: int | None = None

    def parsed(self, backend: str) -> Sent:
        measurement = measure_response(backend, self.raw.streamed(), parse_openai_sse)
        measurement.reconnected = self.reconnected
        measurement.connection_reused = self.connection_reused
        return Sent(
            self.index,
            self.window,
            self.scheduled_ns,
            self.raw.sent_ns,
            measurement,
            self.process,
            self.session,
            self.turn,
        )


@dataclass(frozen=True)
class SessionPlan:
    """How the turns of a session are sent: `turns` requests one after the other on one
    stream, `think_time_s` apart (from an answer's end to the next send); turn t of session s
    asks user turn (s * turns + t) mod n of `user_turns`, after the whole history so far."""

    turns: int
    think_time_s: float
    # The request's JSON body without its messages (model, max_tokens, stream, ...).
    body: bytes
    # Each a conversation of its own (system turn and user turn), its last one the question.
    user_turns: tuple[tuple[tuple[str, str], ...], ...]
    path: str = "/v1/chat/completions"

    def request(
        self,
        endpoint: Endpoint,
        headers: tuple[tuple[str, str], ...],
        history: list[dict[str, str]],
    ) -> bytes:
        body = json.loads(self.body)
        body["messages"] = history
        return request_bytes(endpoint, self.path, json.dumps(body).encode(), headers)


@dataclass(frozen=True)
class Target:
    """What every request of a load point sends, and where."""

    backend: str
    endpoint: Endpoint
    request: bytes
    timeout_s: float
    # The cell's headers (an API key among them), for the engine's /metrics too.
    headers: tuple[tuple[str, str], ...] = ()
    # An https:// endpoint's trust (the cell's ca_file, its text carried, and tls_verify): the
    # settings, not an ssl.SSLContext, so that the target pickles for `processes:` and `clients:`.
    tls: TlsSettings | None = None
    # Where the point sends several requests (a dataset's prompts): request i is the
    # (i mod n)-th of these, and `request` is the first.
    variants: tuple[bytes, ...] = ()
    # Multi-turn sessions (`turns:`): each send is a whole session, its requests built as it
    # goes (the history, the previous answer, the next user turn).
    session: SessionPlan | None = None
    # A cell that chooses LoRA adapters per request: request i names adapter `adapters.of(i)`,
    # and sends its `adapters.prompt_of(i, n)`-th request in `by_adapter` (its prompts).
    adapters: AdapterChoice | None = None
    by_adapter: tuple[tuple[bytes, ...], ...] = ()

    @property
    def context(self) -> ssl.SSLContext | None:
        """The client context of an https:// endpoint (one per setting in each process)."""
        return self.tls.context() if self.tls is not None else None

    def request_for(self, index: int) -> bytes:
        """The bytes of the point's `index`-th request."""
        if self.adapters is not None:
            requests = self.by_adapter[self.adapters.of(index)]
            return requests[self.adapters.prompt_of(index, len(requests))]
        return self.variants[index % len(self.variants)] if self.variants else self.request


class Bounds:
    """Which window a request due now falls in: the ramp for `ramp_s` (a ramped pattern's),
    then warm-up for `warmup_s`, then measured until `duration_s` has passed or `requests`
    were sent, then cool-down for `cooldown_s`; None once all are over (no request is sent
    after that)."""

    def __init__(self, profile: LoadProfile, started_ns: int, ramp_s: float = 0.0) -> None:
        self.ramp_until = started_ns + int(ramp_s * 1e9)
        self.measured_from = self.ramp_until + int(profile.warmup_s * 1e9)
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
        if now_ns < self.ramp_until:
            return "ramp"
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

    def __init__(
        self, target: Target, profile: LoadProfile, process: int = 0, ramp_s: float = 0.0
    ) -> None:
        self.target = target
        self.profile = profile
        self.process = process
        # The pattern's ramp (its first window), or 0.
        self.ramp_s = ramp_s
        self.pool = ConnectionPool(
            target.endpoint, connect_timeout_s=min(target.timeout_s, 10.0), tls=target.context
        )
        self._sent: list[Sent | Received] = []
        self.bounds = Bounds(profile, time.perf_counter_ns(), ramp_s)
        self.started_ns = 0
        self.next_index = 0
        self.next_session = 0

    async def open(self, connections: int) -> None:
        """Open the connections the point needs before its clock starts."""
        await self.pool.fill(connections)
        self.start(time.perf_counter_ns())

    def start(self, started_ns: int) -> None:
        """Start the point's clock (processes of one point share one start)."""
        self.started_ns = started_ns
        self.bounds = Bounds(self.profile, started_ns, self.ramp_s)

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
        """One request, due at `scheduled_ns`: sent as soon as a connection is at hand (a
        multi-turn point's whole session)."""
        if self.target.session is not None:
            await self._session(self.target.session, scheduled_ns, window)
            return
        await self._send_one(scheduled_ns, window, None)

    async def _session(self, plan: SessionPlan, scheduled_ns: int, window: Window) -> None:
        """The turns of one session in order; each sends the history and the previous answer,
        so a turn's reply is parsed as it ends (the next turn needs its text). A turn that
        failed ends its session (there is no answer to go on from)."""
        session, self.next_session = self.next_session, self.next_session + 1
        history: list[dict[str, str]] = []
        due_ns = scheduled_ns
        for turn in range(plan.turns):
            asked = plan.user_turns[(session * plan.turns + turn) % len(plan.user_turns)]
            for role, content in asked:
                if role != "system" or not history:
                    history.append({"role": role, "content": content})
            request = plan.request(self.target.endpoint, self.target.headers, history)
            await self._send_one(due_ns, window, request, session=session, turn=turn)
            # _send_one appended this turn's reply last and returned without yielding to the
            # loop after that: no other send came in between.
            last = self._sent[-1]
            sent = last.parsed(self.target.backend) if isinstance(last, Received) else last
            self._sent[-1] = sent
            if sent.measurement.error is not None:
                return
            history.append({"role": "assistant", "content": sent.measurement.text})
            if turn + 1 < plan.turns:
                await asyncio.sleep(plan.think_time_s)
                due_ns = time.perf_counter_ns()

    async def _send_one(
        self,
        scheduled_ns: int,
        window: Window,
        request: bytes | None,
        *,
        session: int | None = None,
        turn: int | None = None,
    ) -> None:
        target = self.target
        index, self.next_index = self.next_index, self.next_index + 1
        if request is None:
            request = target.request_for(index)
        sent_ns = time.perf_counter_ns()
        reconnected = False
        try:
            connection = await self.pool.take()
            try:
                raw = await connection.exchange(request, target.timeout_s)
            except DroppedConnection:
                if connection.exchanges <= 1 and not connection.lost:
                    raise
                # A kept connection the server had closed: sent again on a new one, once; the
                # send lag counts the lost attempt.
                self.pool.dropped()
                reconnected = True
                connection = await self.pool.take()
                raw = await connection.exchange(request, target.timeout_s)
        except StreamError as exc:
            measurement = CallMeasurement(backend=target.backend, error=str(exc))
            self._sent.append(
                Sent(index, window, scheduled_ns, sent_ns, measurement, self.process, session, turn)
            )
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
                session,
                turn,
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
    more_payloads: tuple[bytes, ...] = (),
    session: SessionPlan | None = None,
    adapters: AdapterChoice | None = None,
    adapter_payloads: tuple[tuple[bytes, ...], ...] = (),
) -> Target:
    """The point's target; `more_payloads` are sent in turn after `payload` (a dataset);
    `adapter_payloads` each adapter's, chosen per request by `adapters`."""
    endpoint = Endpoint.parse(base_url)
    pairs = tuple(headers.items())
    path = "/v1/chat/completions"
    request = request_bytes(endpoint, path, payload, pairs)
    trust = (tls or TlsSettings()).portable() if endpoint.scheme == "https" else None
    if trust is not None:
        trust.context()  # an unreadable CA is one line before the point, not in each process
    variants = (
        (request, *(request_bytes(endpoint, path, more, pairs) for more in more_payloads))
        if more_payloads
        else ()
    )
    by_adapter = tuple(
        tuple(request_bytes(endpoint, path, one, pairs) for one in payloads)
        for payloads in adapter_payloads
    )
    return Target(
        backend,
        endpoint,
        request,
        timeout_s,
        pairs,
        trust,
        variants,
        session,
        adapters if by_adapter else None,
        by_adapter,
    )
