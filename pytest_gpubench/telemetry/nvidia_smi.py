"""GPU samples from one long-lived `nvidia-smi --query-gpu=… -lms N` stream per node (this
machine or over SSH): one CSV line per GPU per interval, parsed as it arrives."""

from __future__ import annotations

from dataclasses import replace

from pytest_gpubench.telemetry.samplers import (
    GpuSample,
    LineStream,
    Sample,
    StreamingTarget,
    StreamSampler,
)

# In this order on every line; `--format=csv,noheader,nounits` leaves the units out: MiB for
# memory, % for utilisation, °C, W, MHz. nvidia-smi has no field for the energy counter.
SAMPLE_FIELDS = (
    "index",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
    "clocks.sm",
)
# What nvidia-smi prints for a value the GPU does not report.
MISSING = ("[N/A]", "N/A", "[Not Supported]", "[Unknown Error]", "")


def sample_argv(interval_ms: int) -> list[str]:
    return [
        "nvidia-smi",
        f"--query-gpu={','.join(SAMPLE_FIELDS)}",
        "--format=csv,noheader,nounits",
        "-lms",
        str(interval_ms),
    ]


def _number(text: str) -> float | None:
    value = text.strip()
    return None if value in MISSING else float(value)


def parse_sample_line(line: str, now: float) -> list[Sample] | None:
    """One GPU's line (`0, 45, 1234, 81559, 38, 71.23, 1980`); None for any other line (an
    error message), which becomes the note when the stream ends."""
    values = [value.strip() for value in line.split(",")]
    if len(values) != len(SAMPLE_FIELDS) or not values[0].isdigit():
        return None
    index, util, used, total, temperature, power, clock = values
    return [
        GpuSample(
            t=now,
            gpu=int(index),
            utilization_pct=_number(util),
            memory_used_mib=_number(used),
            memory_total_mib=_number(total),
            temperature_c=_number(temperature),
            power_w=_number(power),
            sm_clock_mhz=_number(clock),
            energy_mj=None,
        )
    ]


class BatchedLineParser:
    """Gives every GPU's line of one loop the arrival time of the loop's first line, so that the
    GPUs of one moment stay together when a case's window is cut."""

    def __init__(self) -> None:
        self.last_index: int | None = None
        self.batch_t = 0.0

    def __call__(self, line: str, now: float) -> list[Sample] | None:
        samples = parse_sample_line(line, now)
        if not samples:
            return samples
        (sample,) = samples
        assert isinstance(sample, GpuSample)
        if self.last_index is None or sample.gpu <= self.last_index:
            self.batch_t = now
        self.last_index = sample.gpu
        return [replace(sample, t=self.batch_t)]


def nvidia_smi_sampler(target: StreamingTarget, interval_s: float) -> StreamSampler:
    interval_ms = max(1, round(interval_s * 1000))

    def open_stream(_pid: int | None) -> LineStream:
        return target.stream(sample_argv(interval_ms))

    return StreamSampler(
        "gpu", "nvidia-smi", interval_s, open_stream, lambda _pid: BatchedLineParser()
    )
