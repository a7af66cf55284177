"""The machine's readings beside one measured call, opened just before it and closed just after:
the CPU pressure, the engine's and the client's own run-queue wait, and the machine's CPU time
with the benchmark's own taken out (the neighbours' share, and a hypervisor's steal); a warm
call's record carries them (SteadinessFields) and the gate's steadiness reads them
(results/steadiness.Steadiness)."""

from __future__ import annotations

from typing import TypedDict

from pytest_gpubench.measure.control import CpuPressure, MachineCpu
from pytest_gpubench.measure.engine_wait import EngineWait, EngineWaiting, client_wait


class SteadinessFields(TypedDict, total=False):
    """A warm call's readings of the machine beside it (CallReadings: measure/control.py,
    measure/engine_wait.py), after its other fields; each absent where not read (steadiness
    off, a remote engine) and from a ledger of an older version."""

    control_ms: float
    cpu_pressure: float
    # The engine's own threads over the call: a managed engine's, or the process found serving
    # a local endpoint (measure/listener.py).
    engine_wait_ms: float
    engine_cpu_ms: float
    engine_wait_per_cpu: float
    engine_cpus_filled: float
    engine_cpus: str
    # The harness's own threads over the call (the client's): its wait for a CPU, and ran.
    client_wait_ms: float
    client_cpu_ms: float
    client_wait_per_cpu: float
    # The machine's CPU time over the call less the engine's and this process's: the
    # neighbours' share; and the share a hypervisor stole (/proc/stat's steal).
    neighbour_cpu_share: float
    steal_share: float


class CallReadings:
    """Marks taken before a call (`engine_wait`: the reader of a local engine's threads, None
    where none is read); `fields()` after it reads each again and says what moved."""

    def __init__(
        self, pressure: CpuPressure, machine_cpu: MachineCpu, engine_wait: EngineWait | None
    ) -> None:
        self.pressure = pressure
        self.machine_cpu = machine_cpu
        self.engine_wait = engine_wait
        self.own_wait = client_wait()
        self.pressure_mark = pressure.start()
        self.cpu_mark = machine_cpu.read()
        self.wait_mark = engine_wait.mark() if engine_wait is not None else None
        self.own_mark = self.own_wait.mark()

    def fields(self) -> SteadinessFields:
        """The call record's fields of what the readings saw over the call (each where read)."""
        own_waited = self.own_wait.since(self.own_mark)
        waited = self.engine_wait.since(self.wait_mark) if self.engine_wait is not None else None
        cpu_pressure = self.pressure.share(self.pressure_mark)
        # The benchmark's own CPU time over the call: the engine's, where it is read here, and
        # this process's; the rest of the machine's busy time is the neighbours'.
        own_cpu_ms = sum(w.cpu_ms for w in (waited, own_waited) if w is not None)
        neighbours = self.machine_cpu.neighbours(self.cpu_mark, own_cpu_ms)
        fields: SteadinessFields = {}
        if cpu_pressure is not None:
            fields["cpu_pressure"] = round(cpu_pressure, 4)
        if waited is not None and self.engine_wait is not None:
            fields.update(engine_wait_fields(waited, self.engine_wait))
        if own_waited is not None:
            fields.update(client_wait_fields(own_waited))
        if neighbours is not None:
            fields["neighbour_cpu_share"] = round(neighbours.cpu_share, 4)
            fields["steal_share"] = round(neighbours.steal_share, 4)
        return fields


def engine_wait_fields(waited: EngineWaiting, engine_wait: EngineWait) -> SteadinessFields:
    """A call record's fields of the engine's own run-queue wait and CPU time over the call
    (measure/engine_wait), how busy it kept the CPUs it may use, and the CPUs it was pinned to,
    if any (A/B's two engines placed alike: results/paired)."""
    fields: SteadinessFields = {
        "engine_wait_ms": round(waited.wait_ms, 3),
        "engine_cpu_ms": round(waited.cpu_ms, 3),
    }
    if waited.cpu_ms > 0:
        fields["engine_wait_per_cpu"] = round(waited.wait_ms / waited.cpu_ms, 4)
    allowed = engine_wait.allowed_cpus(waited.pids)
    if allowed and waited.wall_ms > 0:
        # How busy the engine kept the CPUs it may use (1.0: every one, all the call long): an
        # engine that fills them waits for its own threads too (results/engine_checks).
        fields["engine_cpus_filled"] = round(waited.cpu_ms / (waited.wall_ms * len(allowed)), 3)
    pinned = engine_wait.pinned_cpus(allowed)
    if pinned is not None:
        fields["engine_cpus"] = pinned
    return fields


def client_wait_fields(waited: EngineWaiting) -> SteadinessFields:
    """A call record's fields of the harness's own threads' run-queue wait and CPU time over the
    call, and their ratio (measure/engine_wait.client_wait): a client that waited for a CPU
    read the engine's bytes late."""
    fields: SteadinessFields = {
        "client_wait_ms": round(waited.wait_ms, 3),
        "client_cpu_ms": round(waited.cpu_ms, 3),
    }
    if waited.cpu_ms > 0:
        fields["client_wait_per_cpu"] = round(waited.wait_ms / waited.cpu_ms, 4)
    return fields
