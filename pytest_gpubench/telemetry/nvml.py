"""GPU samples on this machine through NVML (the `nvidia-ml-py` bindings, module `pynvml`),
imported only when a local node is sampled."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Collection
from types import ModuleType
from typing import Any

from pytest_gpubench.core.processes import process_tree
from pytest_gpubench.telemetry.samplers import GpuSample, PollingSampler, Sample

MIB = 1024 * 1024


class NvmlUnavailable(Exception):
    """NVML cannot be used here: no bindings, no library, no GPU."""


def _load() -> tuple[ModuleType, list[Any]]:
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError as exc:
        raise NvmlUnavailable(f"pynvml not importable: {exc}") from None
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise NvmlUnavailable(f"NVML library not loaded: {exc}") from None
    try:
        count = int(nvml.nvmlDeviceGetCount())
        handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
    except Exception as exc:
        _shutdown(nvml)
        raise NvmlUnavailable(f"NVML lists no GPU: {exc}") from None
    if not handles:
        _shutdown(nvml)
        raise NvmlUnavailable("NVML lists no GPU")
    return nvml, handles


def _shutdown(nvml: ModuleType) -> None:
    with contextlib.suppress(Exception):
        nvml.nvmlShutdown()


def _optional(nvml: ModuleType, read: Any) -> float | None:
    """A reading the GPU may not support (energy counter, power on some boards): None then."""
    try:
        return float(read())
    except nvml.NVMLError as exc:
        if isinstance(exc, _not_supported(nvml)):
            return None
        raise


def _not_supported(nvml: ModuleType) -> tuple[type[BaseException], ...]:
    names = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
    return tuple(getattr(nvml, name) for name in names if hasattr(nvml, name))


def read_gpus(
    nvml: ModuleType, handles: list[Any], now: float, engine_pids: Collection[int] = ()
) -> list[GpuSample]:
    """One sample per GPU, converted to nvidia-smi's units (bytes → MiB, mW → W), with the
    memory `engine_pids` hold on it; a GPU that cannot be read at all (lost, reset) raises, which
    ends the sampler with a note."""
    return [
        _read_gpu(nvml, index, handle, now, engine_pids) for index, handle in enumerate(handles)
    ]


def compute_processes(nvml: ModuleType, handle: Any) -> list[Any] | None:
    """NVML's compute processes on this GPU; None where the driver does not say."""
    try:
        return list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except nvml.NVMLError as exc:
        if isinstance(exc, _not_supported(nvml)):
            return None
        raise


def engine_memory_mib(processes: list[Any] | None, engine_pids: Collection[int]) -> float | None:
    """What the engine's processes hold on a GPU (MiB), from NVML's list of its compute
    processes: 0 when none of them is listed (a CPU-only engine), None when there is no engine
    process, or the driver does not say (no list, or a process's `usedGpuMemory` unknown, as
    under some virtualisation)."""
    if not engine_pids or processes is None:
        return None
    used = [p.usedGpuMemory for p in processes if int(p.pid) in engine_pids]
    if any(value is None for value in used):
        return None
    return sum(int(value) for value in used) / MIB


def other_pids(processes: list[Any] | None, engine_pids: Collection[int]) -> tuple[int, ...] | None:
    """The compute processes NVML listed on this GPU that are not the engine's (sorted pids);
    None where there is no engine process to tell them from, or the driver does not say."""
    if not engine_pids or processes is None:
        return None
    return tuple(sorted({int(p.pid) for p in processes} - set(engine_pids)))


def clock_events(nvml: ModuleType, handle: Any) -> int | None:
    """NVML's reasons the clocks are held down now (a bitmask; the bindings' newer name first);
    None where the driver does not say."""
    read = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    if read is None:
        return None
    value = _optional(nvml, lambda: read(handle))
    return int(value) if value is not None else None


def _read_gpu(
    nvml: ModuleType, index: int, handle: Any, now: float, engine_pids: Collection[int]
) -> GpuSample:
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    utilization = nvml.nvmlDeviceGetUtilizationRates(handle)
    temperature = _optional(
        nvml, lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
    )
    milliwatts = _optional(nvml, lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    clock = _optional(nvml, lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
    energy = _optional(nvml, lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    # One list of the GPU's compute processes a sample: the engine's memory and the others.
    processes = compute_processes(nvml, handle) if engine_pids else None
    return GpuSample(
        t=now,
        gpu=index,
        utilization_pct=float(utilization.gpu),
        memory_used_mib=memory.used / MIB,
        memory_total_mib=memory.total / MIB,
        temperature_c=temperature,
        power_w=milliwatts / 1000.0 if milliwatts is not None else None,
        sm_clock_mhz=clock,
        energy_mj=energy,
        engine_memory_mib=engine_memory_mib(processes, engine_pids),
        other_pids=other_pids(processes, engine_pids),
        clock_events=clock_events(nvml, handle),
    )


def nvml_sampler(interval_s: float) -> PollingSampler:
    """A sampler of every GPU of this machine; raises NvmlUnavailable where NVML cannot load."""
    nvml, handles = _load()

    def read(now: float, pid: int | None) -> list[Sample]:
        return list(read_gpus(nvml, handles, now, process_tree(pid) if pid is not None else ()))

    return PollingSampler("gpu", "nvml", interval_s, read, close=lambda: _shutdown(nvml))
