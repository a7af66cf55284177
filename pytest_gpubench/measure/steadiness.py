"""The machine's readings beside one measured call, opened just before it and closed just after:
the CPU pressure, the engine's and the client's own run-queue wait, and the machine's CPU time
with the benchmark's own taken out (the neighbours' share, and a hypervisor's steal); a warm
call's record carries them (ledger/schema.SteadinessFields) and the gate's steadiness reads them
(results/steadiness.Steadiness)."""

from __future__ import annotations

from typing import Any

from pytest_gpubench.measure.control import CpuPressure, MachineCpu
from pytest_gpubench.measure.engine_wait import (
    EngineWait,
    client_wait,
    client_wait_fields,
    engine_wait_fields,
)


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

    def fields(self) -> dict[str, Any]:
        """The call record's fields of what the readings saw over the call (each where read)."""
        own_waited = self.own_wait.since(self.own_mark)
        waited = self.engine_wait.since(self.wait_mark) if self.engine_wait is not None else None
        cpu_pressure = self.pressure.share(self.pressure_mark)
        # The benchmark's own CPU time over the call: the engine's, where it is read here, and
        # this process's; the rest of the machine's busy time is the neighbours'.
        own_cpu_ms = sum(w.cpu_ms for w in (waited, own_waited) if w is not None)
        neighbours = self.machine_cpu.neighbours(self.cpu_mark, own_cpu_ms)
        fields: dict[str, Any] = {}
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
