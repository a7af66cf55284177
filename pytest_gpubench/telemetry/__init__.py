"""Resource telemetry: the factory that picks a node's samplers (NVML, nvidia-smi, /proc), and
the parts they are made of (`telemetry/samplers.py`: the sample records, the `Sampler` protocol,
the sample buffer, a node's samplers while its cases run), named here as before.

The samplers' modules import their parts from `telemetry/samplers.py`, not from this package,
which imports them lazily: no import circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pytest_gpubench.targets import on_this_machine
from pytest_gpubench.telemetry.nvidia_smi import nvidia_smi_sampler
from pytest_gpubench.telemetry.nvml import NvmlUnavailable, nvml_sampler
from pytest_gpubench.telemetry.proc import proc_sampler
from pytest_gpubench.telemetry.samplers import (
    SETTLE_SLACK_S,
    CaseSamples,
    GpuSample,
    LineParser,
    LineStream,
    NodeTelemetry,
    PollingSampler,
    ProcSample,
    Sample,
    SampleBuffer,
    Sampler,
    StreamingTarget,
    StreamSampler,
)

if TYPE_CHECKING:
    from pytest_gpubench.config.cell import TelemetrySettings
    from pytest_gpubench.targets import Target

__all__ = [
    "SETTLE_SLACK_S",
    "CaseSamples",
    "GpuSample",
    "LineParser",
    "LineStream",
    "NodeTelemetry",
    "PollingSampler",
    "ProcSample",
    "Sample",
    "SampleBuffer",
    "Sampler",
    "StreamSampler",
    "StreamingTarget",
    "node_telemetry",
]


def node_telemetry(
    node_id: str,
    target: Target,
    settings: Sequence[TelemetrySettings],
    gpus: list[dict[str, str]],
) -> NodeTelemetry | None:
    """The samplers for a node whose cells have these telemetry settings (the shortest interval
    of those that sample anything), not yet started; None when every cell turned it off."""
    wanted = [s for s in settings if s.gpu != "off" or s.cpu != "off"]
    if not wanted:
        return None
    interval_ms = min(s.interval_ms for s in wanted)
    interval_s = interval_ms / 1000.0
    samplers: list[Sampler] = []
    notes: list[str] = []
    if any(s.gpu != "off" for s in wanted):
        sampler, note = _gpu_sampler(target, gpus, interval_s)
        if sampler is not None:
            samplers.append(sampler)
        if note:
            notes.append(note)
    if any(s.cpu != "off" for s in wanted):
        cpu = proc_sampler(target, interval_s)
        if cpu is None:
            notes.append("cpu: this node cannot stream a command; no CPU samples")
        else:
            samplers.append(cpu)
    return NodeTelemetry(node_id, interval_ms, samplers, notes)


def _gpu_sampler(
    target: Target, gpus: list[dict[str, str]], interval_s: float
) -> tuple[Sampler | None, str | None]:
    """NVML on this machine where its library loads, else an nvidia-smi stream where the node
    has GPUs; (None, why) otherwise."""

    nvml_note = None
    if on_this_machine(target):
        try:
            return nvml_sampler(interval_s), None
        except NvmlUnavailable as exc:
            nvml_note = str(exc)
    if not gpus:
        return None, None  # no GPU on the node: nothing to sample, nothing to explain
    if not isinstance(target, StreamingTarget):
        return None, "gpu: this node cannot stream a command; no GPU samples"
    sampler = nvidia_smi_sampler(target, interval_s)
    return sampler, (f"gpu: NVML unavailable ({nvml_note}); sampled with nvidia-smi"
                     if nvml_note else None)  # fmt: skip
