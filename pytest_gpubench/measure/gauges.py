"""The engine's own gauges during a load point, where it exposes Prometheus `/metrics` (vLLM;
llama-server started with --metrics): running and waiting requests, KV-cache usage, sampled at
an interval; and its token counters and latency histograms' sums and counts before and after,
to set against the client's count and the client's own latencies."""

from __future__ import annotations

import asyncio
import http.client
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pytest_gpubench.config.engine_series import (
    ENGINE_COUNTERS,
    GENERATED,
    SERVER_SERIES,
    TOKEN_COUNTERS,
    EngineCounter,
)
from pytest_gpubench.measure.load_client import StreamConnection
from pytest_gpubench.measure.stream import Endpoint, StreamError


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """({gauge: value}, {counter sample: value}) of a Prometheus text page, a histogram's `_sum`
    and `_count` among the counters; a name's samples with different labels (vLLM's per-model,
    per-engine ones) are added up."""
    from prometheus_client.parser import text_string_to_metric_families

    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("gauge", "counter", "histogram"):
            continue
        into = gauges if family.type == "gauge" else counters
        for sample in family.samples:
            if family.type == "counter" and not sample.name.endswith("_total"):
                continue  # _created timestamps
            if family.type == "histogram" and not sample.name.endswith(("_sum", "_count")):
                continue  # buckets: the means need only the sum and the count
            into[sample.name] = into.get(sample.name, 0.0) + float(sample.value)
    return gauges, counters


@dataclass
class GaugeSamples:
    """What was scraped during a point: gauge columns (`t_ms` from the point's start) and the
    token counters' change from before to after."""

    interval_ms: int
    columns: dict[str, list[float | None]] = field(default_factory=dict)
    counters_before: dict[str, float] = field(default_factory=dict)
    counters_after: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def counter_changes(self) -> dict[str, float]:
        return {
            name: round(self.counters_after[name] - self.counters_before[name], 6)
            for name in TOKEN_COUNTERS
            if name in self.counters_before and name in self.counters_after
        }

    def engine_counters(self) -> dict[str, float]:
        """config/engine_series.ENGINE_COUNTERS over the point, by their names (counter_changes)."""
        return counter_changes(self.counters_before, self.counters_after)

    def server_changes(self) -> dict[str, float]:
        """The change over the point of each SERVER_SERIES the engine exposes."""
        return {
            name: round(self.counters_after[name] - self.counters_before[name], 9)
            for name in SERVER_SERIES
            if name in self.counters_before and name in self.counters_after
        }

    def add(self, t_ms: float, gauges: Mapping[str, float]) -> None:
        rows = len(self.columns.get("t_ms", []))
        for name in gauges:
            self.columns.setdefault(name, [None] * rows)
        self.columns.setdefault("t_ms", []).append(round(t_ms, 3))
        for name, column in self.columns.items():
            if name != "t_ms":
                column.append(gauges.get(name))


class GaugeScraper:
    """Reads `/metrics` on a connection of its own for each scrape (llama-server closes after
    every reply), outside the timed requests' connections."""

    def __init__(
        self,
        endpoint: Endpoint,
        headers: Sequence[tuple[str, str]],
        interval_ms: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.tls = tls
        self.headers = dict(headers)
        head = [f"GET {endpoint.target('/metrics')} HTTP/1.1", f"Host: {endpoint.address}"]
        head += [f"{name}: {value}" for name, value in headers]
        self.request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        self.samples = GaugeSamples(interval_ms)

    async def scrape(self) -> tuple[dict[str, float], dict[str, float]] | None:
        """The page parsed, or None when the engine exposes none (and why, in the notes)."""
        text = await self.fetch()
        return self._parse(text) if text is not None else None

    async def fetch(self) -> str | None:
        """The page's text, unparsed (None when the engine exposes none, and why in the notes)."""
        try:
            connection = await StreamConnection.open(self.endpoint, 5.0, self.tls)
            try:
                raw = await connection.exchange(self.request, 5.0)
            finally:
                connection.close()
        except StreamError as exc:
            self._note(f"/metrics not read: {exc}")
            return None
        if raw.status != 200:
            self._note(f"/metrics answered HTTP {raw.status} (llama-server needs --metrics)")
            return None
        return b"".join(piece for _, piece in raw.pieces).decode("utf-8", "replace")

    def _parse(self, text: str) -> tuple[dict[str, float], dict[str, float]] | None:
        try:
            return parse_metrics(text)
        except ValueError as exc:
            self._note(f"/metrics is not Prometheus text: {exc}")
            return None

    async def settled_counters(self, timeout_s: float = 3.0) -> dict[str, float] | None:
        """The token counters once two reads 100 ms apart agree (an engine may count a step
        after its reply went out), or the last read at the timeout."""
        page = await self.settled_page(timeout_s)
        return None if page is None else page[1]

    async def settled_page(
        self, timeout_s: float = 3.0
    ) -> tuple[dict[str, float], dict[str, float]] | None:
        """The page (gauges, counters) once its counters hold still, as settled_counters."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, float] | None = None
        previous: tuple[dict[str, float], dict[str, float]] | None = None
        while True:
            page = await self.scrape()
            if page is None:
                return previous
            # The histograms too: vLLM observes a request's latencies when it finishes, and a
            # read between its last token and that would miss them.
            counters = {
                name: page[1][name] for name in (*TOKEN_COUNTERS, *SERVER_SERIES) if name in page[1]
            }
            if counters == last or time.monotonic() > deadline:
                return page
            last, previous = counters, page
            await asyncio.sleep(0.1)

    def _note(self, note: str) -> None:
        if note not in self.samples.notes:
            self.samples.notes.append(note)

    def fetch_blocking(self) -> str | None:
        """fetch, on a plain socket (the scraping thread's): a few system calls, each giving the
        GIL back, where an event loop of its own needed many turns of the GIL per scrape."""
        secure = self.tls if self.endpoint.scheme == "https" else None
        connection: http.client.HTTPConnection = (
            http.client.HTTPSConnection(self.endpoint.host, self.endpoint.port, timeout=5.0,
                                        context=secure)
            if secure is not None
            else http.client.HTTPConnection(self.endpoint.host, self.endpoint.port, timeout=5.0)
        )  # fmt: skip
        try:
            connection.request("GET", self.endpoint.target("/metrics"), headers=self.headers)
            reply = connection.getresponse()
            body = reply.read()
        except (OSError, http.client.HTTPException) as exc:
            self._note(f"/metrics not read: cannot read {self.endpoint.address}: {exc}")
            return None
        finally:
            connection.close()
        if reply.status != 200:
            self._note(f"/metrics answered HTTP {reply.status} (llama-server needs --metrics)")
            return None
        return body.decode("utf-8", "replace")

    async def run(self, started_ns: int, stop: asyncio.Event) -> None:
        """Scrape every interval until `stop` is set, on a thread of its own with a plain socket:
        on the load client's event loop a scrape waited behind every stream's reads, and under
        four streams on two cores a real vLLM's c4 point (0.8 s) got two scrapes, one before its
        first request and one after its last."""
        pages: list[tuple[float, str]] = []
        await asyncio.to_thread(self._scrape_until, started_ns, stop, pages)
        # Parsed once the point has ended: prometheus_client's parser is pure Python, and a vLLM
        # page (histograms) kept the load client's event loop from its sends for 100-500 ms.
        for t_ms, text in pages:
            page = self._parse(text)
            if page is not None:
                self.samples.add(t_ms, page[0])

    def _scrape_until(
        self, started_ns: int, stop: asyncio.Event, pages: list[tuple[float, str]]
    ) -> None:
        """The scrapes, on the scraping thread; `stop` belongs to the client's loop and is only
        read here (is_set), every 10 ms between scrapes."""
        interval_s = self.samples.interval_ms / 1000.0
        while not stop.is_set():
            text = self.fetch_blocking()
            if text is not None:
                pages.append(((time.perf_counter_ns() - started_ns) / 1e6, text))
            wake = time.monotonic() + interval_s
            while not stop.is_set() and time.monotonic() < wake:
                time.sleep(min(0.01, interval_s))


# A page as case_counters reads it: its gauges and its counters in one mapping.
Page = Mapping[str, float]


def _reading(counter: EngineCounter, page: Page) -> float | None:
    """The counter's value on a page: its first alternative whose every series is there."""
    for names in counter.series:
        if all(name in page for name in names):
            return sum(page[name] for name in names)
    return None


def counter_changes(before: Page, after: Page) -> dict[str, float]:
    """config/engine_series.ENGINE_COUNTERS over a call from the pages read before and after it:
    each counter's change, each gauge's peak of the two readings; a counter the engine does not
    expose is left out."""
    changes: dict[str, float] = {}
    for counter in ENGINE_COUNTERS:
        first, last = _reading(counter, before), _reading(counter, after)
        if first is None or last is None:
            continue
        value = max(first, last) if counter.kind == "peak" else last - first
        changes[counter.name] = round(value, 6)
    return changes


class CaseCounters:
    """The engine's `/metrics` read before and after each warm call of a cell, on a connection of
    its own outside the timed call (the load points' GaugeScraper, one read at a time, on a plain
    socket as its scraping thread reads). An engine that exposes none is asked once: `absent`
    then says why, and it is not asked again (an engine that answered once is asked again after a
    failed read).

    No event loop: a read is a few blocking system calls in the run's own thread, so that Ctrl-C
    or SIGTERM landing inside one is an ordinary KeyboardInterrupt that ends the run as anywhere
    else. On an event loop of its own (asyncio.run, twice a warm call) a signal that landed inside
    a task's step left that task holding the KeyboardInterrupt, and the interpreter printed it as
    a traceback ("Task exception was never retrieved") after the run's last line."""

    # How long a settled read waits for the counters to hold still, and between its reads.
    SETTLE_S = 3.0
    SETTLE_STEP_S = 0.1

    def __init__(
        self,
        endpoint: Endpoint,
        headers: Sequence[tuple[str, str]],
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.scraper = GaugeScraper(endpoint, headers, 1000, tls)
        self.absent: str | None = None
        # A page was read once: a later failed read is that read's, not an engine without one.
        self.seen = False

    def read(
        self, *, settled: bool = False, since: Page | None = None, generated: int | None = None
    ) -> Page | None:
        """The page's gauges and counters (None where the engine exposes none); `settled`: once
        its counters hold still (an engine may count a step after its reply went out). A first
        read whose count of generated tokens has already moved by the call's `generated` since
        `since` is taken at once: the engine has counted the call, and the settling's 100 ms
        wait (and second read) is spared on every warm call."""
        if self.absent is not None:
            return None
        page = self._page()
        if page is not None and settled and not _counted(since, page, generated):
            page = self._settled()
        if page is not None:
            self.seen = True
            return page
        if not self.seen:
            self.absent = "; ".join(self.scraper.samples.notes) or "/metrics not read"
        return None

    def _page(self) -> Page | None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # the run's own thread, as it should be
        else:
            # An async test's loop: a blocking read would stall it; measure without counters.
            self.scraper._note("/metrics not read: called inside a running event loop")
            return None
        try:
            text = self.scraper.fetch_blocking()
            page = self.scraper._parse(text) if text is not None else None
        except Exception as exc:  # counters are never worth a case: measure without them
            self.scraper._note(f"/metrics not read: {exc}")
            return None
        return None if page is None else {**page[0], **page[1]}

    def _settled(self) -> Page | None:
        """The page once its counters hold still (GaugeScraper.settled_page's rule, read afresh):
        two reads SETTLE_STEP_S apart that agree, or the last read after SETTLE_S."""
        deadline = time.monotonic() + self.SETTLE_S
        last: dict[str, float] | None = None
        previous: Page | None = None
        while True:
            page = self._page()
            if page is None:
                return previous
            counters = _settling(page)
            if counters == last or time.monotonic() > deadline:
                return page
            last, previous = counters, page
            time.sleep(self.SETTLE_STEP_S)


def _settling(page: Page) -> dict[str, float]:
    """What must hold still for a page to be settled: the token counters and the histograms (vLLM
    observes a request's latencies when it finishes, and a read between its last token and that
    would miss them)."""
    return {name: page[name] for name in (*TOKEN_COUNTERS, *SERVER_SERIES) if name in page}


def _counted(before: Page | None, after: Page, generated: int | None) -> bool:
    """Whether `after` already counts a call that generated `generated` tokens since `before`."""
    if before is None or not generated:
        return False
    for name in GENERATED:
        if name in before and name in after:
            return after[name] - before[name] >= generated
    return False
