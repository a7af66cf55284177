"""Stand-ins for a GPU, which this machine does not have: an `nvidia-smi` executable and an NVML
module injected as `pynvml`.

The nvidia-smi stand-in follows nvidia-smi's documented query interface (`nvidia-smi
--help-query-gpu`, the man page's "--query-gpu" and "--format" sections) field by field:
`--query-gpu=f1,f2,...` prints one line per GPU with the fields in the order asked, separated by
", "; `--format=csv` prints a header line of the field names with their units (`memory.used
[MiB]`), `noheader` leaves it out, `nounits` drops the units from header and values (`81559`
instead of `81559 MiB`); `-lms N` / `--loop-ms=N` repeats the query every N milliseconds until
killed. Units as the real tool prints them: memory MiB, utilisation %, temperature °C (no unit
printed), power W with two decimals, clocks MHz. Made to vanish mid-run, it prints the message a
GPU that fell off the bus gives (`Unable to determine the device handle for GPU...: Unknown
Error`) and exits with status 15, as the real one does.

The NVML stand-in follows the `nvidia-ml-py` bindings' API (pynvml.py) for the calls the
sampler makes: nvmlInit/nvmlShutdown, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex,
nvmlDeviceGetMemoryInfo (bytes: total, free, used), nvmlDeviceGetUtilizationRates (gpu, memory
in %), nvmlDeviceGetTemperature (°C), nvmlDeviceGetPowerUsage (milliwatts),
nvmlDeviceGetClockInfo (MHz), nvmlDeviceGetTotalEnergyConsumption (millijoules since the driver
loaded), nvmlDeviceGetCurrentClocksEventReasons (the nvmlClocksEventReason* bitmask: 0x4 power
cap, 0x8 hardware slowdown, 0x20 and 0x40 thermal), the NVMLError class with its per-code subclasses, NVML_TEMPERATURE_GPU = 0,
NVML_CLOCK_SM = 1.
"""

from __future__ import annotations

import stat
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What one stand-in GPU reports (a H100 at light load), in the units nvidia-smi prints.
GPU_NAME = "NVIDIA H100 80GB HBM3"
MEMORY_TOTAL_MIB = 81559
MEMORY_USED_MIB = 1234  # grows by MEMORY_STEP_MIB per loop: peaks are visible
MEMORY_STEP_MIB = 10
UTILIZATION_PCT = 45
TEMPERATURE_C = 38
POWER_W = 71.23
SM_CLOCK_MHZ = 1980

NVIDIA_SMI_SCRIPT = r'''#!/usr/bin/python3
"""Stand-in for nvidia-smi (tests/support/gpu_standins.py says what it follows)."""
import sys, time

GPUS = {gpus}
VANISH_AFTER = {vanish_after}  # loops printed before the GPU falls off the bus (None: never)
UNITS = {{"memory.total": "MiB", "memory.used": "MiB", "memory.free": "MiB",
          "utilization.gpu": "%", "utilization.memory": "%", "power.draw": "W",
          "power.limit": "W", "clocks.sm": "MHz", "clocks.max.sm": "MHz"}}

def value(field, gpu, loop):
    used = {used} + {step} * loop
    return {{
        "index": str(gpu), "name": "{name}", "driver_version": "550.90.12",
        "pci.bus_id": "00000000:%02X:00.0" % (gpu + 1), "compute_cap": "9.0",
        "memory.total": "{total}", "memory.used": str(used),
        "memory.free": str({total} - used), "utilization.gpu": "{util}",
        "utilization.memory": "3", "temperature.gpu": "{temp}",
        "power.draw": "{power:.2f}", "power.limit": "700.00", "clocks.sm": "{clock}",
        "clocks.max.sm": "1980", "timestamp": time.strftime("%Y/%m/%d %H:%M:%S.000"),
    }}.get(field, "[N/A]")

fields, fmt, loop_ms = [], "csv", None
args = sys.argv[1:]
for i, arg in enumerate(args):
    if arg.startswith("--query-gpu="):
        fields = arg.split("=", 1)[1].split(",")
    elif arg.startswith("--format="):
        fmt = arg.split("=", 1)[1]
    elif arg in ("-lms", "--loop-ms"):
        loop_ms = int(args[i + 1])
    elif arg.startswith("--loop-ms="):
        loop_ms = int(arg.split("=", 1)[1])
if not fields:
    print("stand-in: only --query-gpu is supported", file=sys.stderr)
    sys.exit(2)
nounits = "nounits" in fmt
if "noheader" not in fmt:
    print(", ".join(f if nounits or f not in UNITS else f"{{f}} [{{UNITS[f]}}]" for f in fields))
loop = 0
while True:
    if VANISH_AFTER is not None and loop >= VANISH_AFTER:
        print("Unable to determine the device handle for GPU0000:01:00.0: Unknown Error",
              flush=True)
        sys.exit(15)
    for gpu in range(GPUS):
        values = []
        for f in fields:
            v = value(f, gpu, loop)
            values.append(v if nounits or f not in UNITS or v.startswith("[")
                          else f"{{v}} {{UNITS[f]}}")
        print(", ".join(values), flush=True)
    if loop_ms is None:
        break
    loop += 1
    time.sleep(loop_ms / 1000)
'''


def write_nvidia_smi(directory: Path, *, gpus: int = 1, vanish_after: int | None = None) -> Path:
    """Write the stand-in as `directory/nvidia-smi` (readable and runnable by every user, so an
    SSH test user can run it too); put `directory` first on PATH to use it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvidia-smi"
    path.write_text(
        NVIDIA_SMI_SCRIPT.format(
            gpus=gpus,
            vanish_after=vanish_after,
            used=MEMORY_USED_MIB,
            step=MEMORY_STEP_MIB,
            name=GPU_NAME,
            total=MEMORY_TOTAL_MIB,
            util=UTILIZATION_PCT,
            temp=TEMPERATURE_C,
            power=POWER_W,
            clock=SM_CLOCK_MHZ,
        ),
        encoding="utf-8",
    )
    path.chmod(path.stat().st_mode | stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH
               | stat.S_IXOTH)  # fmt: skip
    return path


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {2: "Not Supported", 9: "Driver Not Loaded", 12: "Library Not Found",
                15: "GPU is lost"}.get(self.value, "Unknown Error")  # fmt: skip


class NVMLError_NotSupported(NVMLError):  # pynvml's own name
    def __init__(self) -> None:
        super().__init__(3)

    def __str__(self) -> str:
        return "Not Supported"


class NVMLError_GpuIsLost(NVMLError):  # pynvml's own name
    def __init__(self) -> None:
        super().__init__(15)


class NVMLError_LibraryNotFound(NVMLError):  # pynvml's own name
    def __init__(self) -> None:
        super().__init__(12)


@dataclass
class _Memory:
    total: int
    free: int
    used: int


@dataclass
class _Utilization:
    gpu: int
    memory: int


@dataclass
class _ProcessInfo:
    """nvidia-ml-py's c_nvmlProcessInfo_t as its nvmlDeviceGetComputeRunningProcesses returns
    it: `usedGpuMemory` in bytes, None where the driver cannot tell (NVML_VALUE_NOT_AVAILABLE)."""

    pid: int
    usedGpuMemory: int | None  # NVML's own field names
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


class NvmlState:
    """What the stand-in module reports; a test changes it while the sampler runs."""

    def __init__(self, gpus: int, energy_counter: bool, library: bool) -> None:
        self.gpus = gpus
        self.energy_counter = energy_counter
        self.library = library
        self.reads = 0
        self.lost = False
        self.energy_mj = 5_000_000  # since the driver loaded
        self.milliwatts = round(POWER_W * 1000)
        self.shut_down = False
        # The compute processes on each GPU: {gpu index: {pid: bytes used, or None}}.
        self.processes: dict[int, dict[int, int | None]] = {}
        # Why the clocks are held down (nvmlClocksEventReason* bits): none, at full clocks.
        self.clock_events = 0


def nvml_module(
    *, gpus: int = 1, energy_counter: bool = True, library: bool = True
) -> tuple[types.ModuleType, NvmlState]:
    """A module to put in sys.modules as `pynvml`, and the state it reports from."""
    state = NvmlState(gpus, energy_counter, library)
    module = types.ModuleType("pynvml", "Stand-in for nvidia-ml-py (tests/support/gpu_standins.py)")
    mib = 1024 * 1024

    def check(handle: int) -> None:
        if state.lost:
            raise NVMLError_GpuIsLost()

    def reading(value: Any) -> Any:
        """A reading of any GPU: raises once the GPU is lost."""

        def read(handle: int, *_which: int) -> Any:
            check(handle)
            return value() if callable(value) else value

        return read

    def init() -> None:
        if not state.library:
            raise NVMLError_LibraryNotFound()

    def shutdown() -> None:
        state.shut_down = True

    def memory(handle: int) -> _Memory:
        check(handle)
        state.reads += 1
        used = (MEMORY_USED_MIB + MEMORY_STEP_MIB * state.reads) * mib
        return _Memory(total=MEMORY_TOTAL_MIB * mib, free=MEMORY_TOTAL_MIB * mib - used, used=used)

    def energy(handle: int) -> int:
        check(handle)
        if not state.energy_counter:
            raise NVMLError_NotSupported()
        # About POWER_W watts since the last read: the counter only ever grows.
        state.energy_mj += 20
        return state.energy_mj

    def processes(handle: int) -> list[_ProcessInfo]:
        check(handle)
        return [_ProcessInfo(pid, used) for pid, used in state.processes.get(handle, {}).items()]

    functions: dict[str, Any] = {
        "nvmlInit": init,
        "nvmlDeviceGetComputeRunningProcesses": processes,
        "nvmlShutdown": shutdown,
        "nvmlDeviceGetCount": lambda: state.gpus,
        "nvmlDeviceGetHandleByIndex": lambda index: index,
        "nvmlDeviceGetMemoryInfo": memory,
        "nvmlDeviceGetUtilizationRates": reading(_Utilization(UTILIZATION_PCT, 3)),
        "nvmlDeviceGetTemperature": reading(TEMPERATURE_C),
        "nvmlDeviceGetPowerUsage": reading(lambda: state.milliwatts),
        "nvmlDeviceGetClockInfo": reading(SM_CLOCK_MHZ),
        "nvmlDeviceGetCurrentClocksEventReasons": reading(lambda: state.clock_events),
        "nvmlDeviceGetTotalEnergyConsumption": energy,
        "NVMLError": NVMLError,
        "NVMLError_NotSupported": NVMLError_NotSupported,
        "NVMLError_GpuIsLost": NVMLError_GpuIsLost,
        "NVMLError_LibraryNotFound": NVMLError_LibraryNotFound,
        "NVML_TEMPERATURE_GPU": 0,
        "NVML_CLOCK_SM": 1,
    }
    for name, value in functions.items():
        setattr(module, name, value)
    return module, state
