"""Resource telemetry's parts: the sample records, the `Sampler` protocol, the sample buffer every
sampler fills, the polling and streaming samplers, and a node's samplers while its cases run.

Each sampler runs in its own thread (or reads its own stream) and never raises into the run: a
GPU or a stream that goes away ends that sampler with a note, kept with the case's samples.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

log = logging.getLogger(__name__)

# How long past a case's end a stream sampler may take to deliver the sample that closes the
# case's window, on top of two intervals (an SSH round trip, a slow nvidia-smi).
SETTLE_SLACK_S = 1.0


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment, in nvidia-smi's units: MiB, %, °C, W, MHz; the energy counter in
    mJ since the driver loaded (None where the GPU has no counter, as through nvidia-smi)."""

    t: float  # time.monotonic() on this machine when the reading was taken or arrived
    gpu: int
    utilization_pct: float | None
    memory_used_mib: float | None
    memory_total_mib: float | None
    temperature_c: float | None
    power_w: float | None
    sm_clock_mhz: float | None
    energy_mj: float | None
    # The memory the engine's processes (the managed engine's pid and its children: vLLM's
    # engine core holds the GPU, not its API server) hold on this GPU, where the sampler can tell
    # (NVML on this machine); None elsewhere. memory_used_mib is the whole GPU's.
    engine_memory_mib: float | None = None
    # The compute processes on this GPU that are not the engine's (pids), where NVML lists them
    # and the engine's processes are known; None elsewhere. Another process's kernels share the
    # GPU with the engine's, as a busy neighbour shares a CPU.
    other_pids: tuple[int, ...] | None = None
    # Why the GPU's clocks are held below their maximum now (NVML's clock event reasons, a
    # bitmask: telemetry/aggregate.CLOCK_EVENTS names the ones that slow the engine down).
    clock_events: int | None = None


@dataclass(frozen=True)
class ProcSample:
    """The engine process (CPU seconds used so far, resident memory) and the node (memory in
    use, 1-minute load) at one moment. Engine fields are None without an engine process."""

    t: float
    engine_pid: int | None
    engine_cpu_s: float | None
    engine_rss_mib: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None
    load1: float | None


Sample = GpuSample | ProcSample
# Turns one line of a stream, arrived at a time.monotonic(), into samples; None for a line that
# is not a sample (an error message: the note if the stream then ends).
LineParser = Callable[[str, float], "list[Sample] | None"]


class Sampler(Protocol):
    """Something that samples a node in the background while its cases run."""

    kind: str  # "gpu" or "cpu"
    source: str  # "nvml", "nvidia-smi" or "proc"
    buffer: SampleBuffer

    def start(self) -> None: ...

    def begin_case(self, engine_pid: int | None) -> None:
        """A case is about to be measured by the engine process engine_pid (None: external)."""
        ...

    def end_case(self, end: float) -> None:
        """The case ended at `end`: make sure a sample at or after it is in the buffer."""
        ...

    def stop(self) -> None: ...


class LineStream(Protocol):
    """The output of a long-running command on a node, line by line."""

    def readline(self) -> str | None:
        """The next line without its newline; None once the command has ended."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class StreamingTarget(Protocol):
    """A target that can run a long-lived command and hand its output over as it comes
    (LocalTarget, SshTarget, ProviderTarget). Targets without it get no stream samplers."""

    def stream(self, argv: Sequence[str]) -> LineStream: ...


class SampleBuffer:
    """Samples in arrival order, shared by a sampler's thread and the harness; ends with a
    note when its sampler stops for good."""

    def __init__(self) -> None:
        self._samples: list[Sample] = []
        self._changed = threading.Condition()
        self.note: str | None = None
        self.ended = False

    def add(self, sample: Sample) -> None:
        with self._changed:
            self._samples.append(sample)
            self._changed.notify_all()

    def end(self, note: str | None) -> None:
        with self._changed:
            if not self.ended:
                self.ended = True
                self.note = note
            self._changed.notify_all()

    def wait_past(self, end: float, timeout_s: float) -> None:
        """Until a sample at or after `end` has arrived, the sampler ended, or the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self.ended and not (self._samples and self._samples[-1].t >= end):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._changed.wait(remaining)

    def window(self, start: float, end: float) -> list[Sample]:
        """The samples of [start, end], with the last one before start and the first one after
        end (counters are read as differences across the window); older samples are dropped."""
        with self._changed:
            samples = self._samples
            first = 0
            for index, sample in enumerate(samples):
                if sample.t <= start:
                    first = index
            # Several GPUs read at one moment: keep every reading of the bracketing moment.
            while first > 0 and samples[first - 1].t == samples[first].t:
                first -= 1
            chosen: list[Sample] = []
            after: float | None = None
            for sample in samples[first:]:
                if sample.t > end:
                    if after is None:
                        after = sample.t
                    elif sample.t != after:
                        break
                chosen.append(sample)
            self._samples = samples[first:]
            return chosen


class PollingSampler:
    """A sampler that reads in this process every interval (NVML, this machine's /proc); it
    also reads at once when a case begins and ends, so short cases are bracketed exactly."""

    def __init__(
        self,
        kind: str,
        source: str,
        interval_s: float,
        read: Callable[[float, int | None], list[Sample]],
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self.kind = kind
        self.source = source
        self.interval_s = interval_s
        self.buffer = SampleBuffer()
        self._read = read
        self._close = close
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"gpubench-{source}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _poll(self) -> None:
        with self._lock:
            if self.buffer.ended:
                return
            try:
                for sample in self._read(time.monotonic(), self._pid):
                    self.buffer.add(sample)
            except Exception as exc:  # the device went away: end this sampler, not the run
                self.buffer.end(f"{self.source} sampler stopped: {_plain(exc)}")

    def _loop(self) -> None:
        while not self._stopping.wait(self.interval_s) and not self.buffer.ended:
            self._poll()

    def begin_case(self, engine_pid: int | None) -> None:
        self._pid = engine_pid
        self._poll()

    def end_case(self, end: float) -> None:
        self._poll()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        with self._lock:
            self.buffer.end(self.buffer.note)
            try:
                self._close()
            except Exception:
                log.debug("%s sampler: closing failed", self.source, exc_info=True)


class StreamSampler:
    """A sampler fed by one long-lived command on the node, line by line (nvidia-smi -lms, the
    /proc loop over SSH). One that follows the engine's pid opens a new stream when it changes
    (a managed engine restarted for a cold case)."""

    def __init__(
        self,
        kind: str,
        source: str,
        interval_s: float,
        open_stream: Callable[[int | None], LineStream],
        make_parser: Callable[[int | None], LineParser],
        *,
        follows_pid: bool = False,
    ) -> None:
        self.kind = kind
        self.source = source
        self.interval_s = interval_s
        self.buffer = SampleBuffer()
        self._open_stream = open_stream
        self._make_parser = make_parser
        self._follows_pid = follows_pid
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._stream: LineStream | None = None
        self._generation = 0
        self._stopped = False

    def start(self) -> None:
        self._open(None)

    def _open(self, pid: int | None) -> None:
        with self._lock:
            if self._stopped or self.buffer.ended:
                return
            old, self._stream = self._stream, None
            self._generation += 1
            generation = self._generation
        if old is not None:
            old.close()
        try:
            stream = self._open_stream(pid)
        except Exception as exc:
            self.buffer.end(f"{self.source} sampler could not start: {_plain(exc)}")
            return
        with self._lock:
            if self._stopped or generation != self._generation:
                stream.close()
                return
            self._stream = stream
            self._pid = pid
        threading.Thread(
            target=self._read, args=(stream, generation, pid), name=f"gpubench-{self.source}",
            daemon=True,
        ).start()  # fmt: skip

    def _read(self, stream: LineStream, generation: int, pid: int | None) -> None:
        parse = self._make_parser(pid)
        last_unparsed = ""
        try:
            while (line := stream.readline()) is not None:
                now = time.monotonic()
                if not line.strip():
                    continue
                try:
                    samples = parse(line, now)
                except (ValueError, IndexError):
                    samples = None
                if samples is None:
                    last_unparsed = line.strip()[:300]
                    continue
                for sample in samples:
                    self.buffer.add(sample)
        except Exception as exc:
            last_unparsed = _plain(exc)
        with self._lock:
            current = generation == self._generation and not self._stopped
        if current:
            said = f": {last_unparsed}" if last_unparsed else ""
            self.buffer.end(f"{self.source} stream ended during the run{said}")

    def begin_case(self, engine_pid: int | None) -> None:
        if self._follows_pid and engine_pid != self._pid:
            self._open(engine_pid)

    def end_case(self, end: float) -> None:
        self.buffer.wait_past(end, 2 * self.interval_s + SETTLE_SLACK_S)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        self.buffer.end(self.buffer.note)


@dataclass
class CaseSamples:
    """What a node's samplers saw during one case, with the notes of those that ended."""

    start: float
    end: float
    interval_ms: int
    gpu_source: str | None = None
    cpu_source: str | None = None
    gpu: list[GpuSample] = field(default_factory=list)
    cpu: list[ProcSample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class NodeTelemetry:
    """The samplers of one node, started when its first cell goes live, stopped with the node."""

    def __init__(self, node_id: str, interval_ms: int, samplers: list[Sampler], notes: list[str]):
        self.node_id = node_id
        self.interval_ms = interval_ms
        self.samplers = samplers
        # Why a sampler the settings asked for is missing (no GPU found, no stream on the node).
        self.notes = notes

    def start(self) -> None:
        for sampler in self.samplers:
            sampler.start()

    def begin_case(self, engine_pid: int | None) -> float:
        """Before a case's call: point the samplers at its engine; returns the start time."""
        for sampler in self.samplers:
            sampler.begin_case(engine_pid)
        return time.monotonic()

    def end_case(self, start: float, *, gpu: bool, cpu: bool) -> CaseSamples:
        """After the call: the case's window of samples (only the kinds its cell asked for)."""
        end = time.monotonic()
        case = CaseSamples(start=start, end=end, interval_ms=self.interval_ms)
        case.notes.extend(self.notes)
        for sampler in self.samplers:
            wanted = gpu if sampler.kind == "gpu" else cpu
            if not wanted:
                sampler.buffer.window(start, end)  # another cell wants them: still drop the old
                continue
            sampler.end_case(end)
            samples = sampler.buffer.window(start, end)
            if sampler.kind == "gpu":
                case.gpu_source = sampler.source
                case.gpu.extend(s for s in samples if isinstance(s, GpuSample))
            else:
                case.cpu_source = sampler.source
                case.cpu.extend(s for s in samples if isinstance(s, ProcSample))
            if sampler.buffer.note:
                case.notes.append(sampler.buffer.note)
        return case

    def stop(self) -> None:
        for sampler in self.samplers:
            try:
                sampler.stop()
            except Exception:
                log.warning("node %s: stopping a sampler failed", self.node_id, exc_info=True)


def _plain(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
