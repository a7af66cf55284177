"""Resource telemetry: CPU against the real llama-server, GPU paths against stand-ins.

No GPU is lent to these tests: the GPU samplers run against the nvidia-smi stand-in and the NVML
stand-in of gpu_standins.py (which say what they follow), locally and on the real sshd of
ssh_fixtures.py. The CPU sampler reads the real /proc of a real llama-server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.gpu_standins import (
    MEMORY_TOTAL_MIB,
    MEMORY_USED_MIB,
    POWER_W,
    SM_CLOCK_MHZ,
    TEMPERATURE_C,
    UTILIZATION_PCT,
    nvml_module,
    write_nvidia_smi,
)

from pytest_gpubench.config.cell import TelemetrySettings
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.processes import process_tree
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.reports.telemetry_table import TELEMETRY_HEADERS, telemetry_rows
from pytest_gpubench.targets.local import LocalTarget
from pytest_gpubench.telemetry import (
    CaseSamples,
    GpuSample,
    NodeTelemetry,
    ProcSample,
    node_telemetry,
)
from pytest_gpubench.telemetry.aggregate import (
    case_aggregates,
    counter_delta,
    integral,
    limit_breaches,
    telemetry_summaries,
)
from pytest_gpubench.telemetry.nvidia_smi import BatchedLineParser, parse_sample_line
from pytest_gpubench.telemetry.nvml import compute_processes, engine_memory_mib
from pytest_gpubench.telemetry.proc import RemoteLineParser, cpu_seconds

if TYPE_CHECKING:
    from support.ssh_fixtures import SshServer

    from pytest_gpubench.targets.ssh import SshTarget

pytest_plugins = ["support.ssh_fixtures"]

REPO = Path(__file__).resolve().parent.parent
FAST = TelemetrySettings(interval_ms=50)


# -- pure parts ------------------------------------------------------------------------------


def test_nvidia_smi_line_is_read_in_its_units_and_other_lines_are_not_samples() -> None:
    (sample,) = parse_sample_line("0, 45, 1234, 81559, 38, 71.23, 1980", 5.0) or []
    assert sample == GpuSample(5.0, 0, 45.0, 1234.0, 81559.0, 38.0, 71.23, 1980.0, None)
    (missing,) = parse_sample_line("1, 0, 10, 24576, 30, [N/A], [Not Supported]", 5.0) or []
    assert isinstance(missing, GpuSample)
    assert missing.power_w is None and missing.sm_clock_mhz is None and missing.gpu == 1
    assert parse_sample_line("Unable to determine the device handle for GPU0: Unknown", 5) is None


def test_nvidia_smi_lines_of_one_loop_share_its_time() -> None:
    parse = BatchedLineParser()
    times = [
        sample.t
        for line, now in (("0, 1, 2, 3, 4, 5, 6", 1.0), ("1, 1, 2, 3, 4, 5, 6", 1.001),
                          ("0, 1, 2, 3, 4, 5, 6", 1.2), ("1, 1, 2, 3, 4, 5, 6", 1.202))
        for sample in parse(line, now) or []
    ]  # fmt: skip
    assert times == [1.0, 1.0, 1.2, 1.2]


def test_proc_stat_cpu_seconds_survive_a_command_name_with_spaces_and_parens() -> None:
    fields = ["S", *["0"] * 10, "250", "50", *["0"] * 30]  # utime field 14, stime field 15
    assert cpu_seconds("42 (llama server) x) " + " ".join(fields), 100) == 3.0
    parser = RemoteLineParser(42)
    assert parser("clk_tck 250", 0.0) == []
    stat = "42 (llama-server) " + " ".join(fields)
    (sample,) = parser(f"{stat}\t204800\t16384000 8192000\t1.25", 1.0) or []
    assert sample == ProcSample(1.0, 42, 1.2, 200.0, 8000.0, 16000.0, 1.25)
    (gone,) = parser("\t\t16384000 8192000\t0.50", 2.0) or []
    assert isinstance(gone, ProcSample)
    assert gone.engine_pid is None and gone.engine_cpu_s is None and gone.mem_used_mib == 8000.0


def test_counters_are_read_between_samples_and_power_is_integrated() -> None:
    counter = [(0.0, 100.0), (1.0, 200.0), (2.0, 400.0)]
    assert counter_delta(counter, 0.5, 1.5) == pytest.approx(300.0 - 150.0)
    assert counter_delta(counter[:1], 0.0, 1.0) is None
    assert integral([(0.0, 100.0), (2.0, 100.0)], 0.5, 1.5) == pytest.approx(100.0)
    assert integral([(0.0, 0.0), (2.0, 200.0)], 0.0, 2.0) == pytest.approx(200.0)


def gpu(t: float, *, power: float, energy: float | None, used: float = 1000.0) -> GpuSample:
    return GpuSample(t, 0, 50.0, used, 24576.0, 40.0, power, 1500.0, energy)


def test_case_energy_from_the_counter_else_integrated_power_flagged() -> None:

    case = CaseSamples(start=10.0, end=12.0, interval_ms=200)
    # A counter that moves with every 200 ms sample: 100 W, in mJ.
    case.gpu = [gpu(t / 10, power=100, energy=(t - 99) * 10_000, used=3000 if t == 111 else 1000)
                for t in range(99, 123, 2)]  # fmt: skip
    fields = case_aggregates(case, completion_tokens=100)
    assert fields["gpu_energy_source"] == "counter"
    assert fields["gpu_energy_j"] == pytest.approx(200.0)  # 100 J/s over the 2 s of the case
    assert fields["gpu_energy_j_per_token"] == pytest.approx(2.0)
    assert fields["gpu_tokens_per_j"] == pytest.approx(0.5)
    assert fields["gpu_peak_memory_used_mib"] == 3000.0
    assert fields["gpu_power_mean_w"] == 100.0
    case.gpu = [gpu(s.t, power=100, energy=None) for s in case.gpu]
    fields = case_aggregates(case, completion_tokens=100)
    assert fields["gpu_energy_source"] == "integrated_power"
    assert fields["gpu_energy_j"] == pytest.approx(200.0)


def test_a_counter_that_moves_in_coarse_steps_is_not_read_over_a_short_case() -> None:
    """What an H100 did (NVML, driver 580): its energy counter moved about every 100 ms by the
    energy of that period, so read over a 15 ms call it said 0 J. A case the counter moved fewer
    than MIN_COUNTER_STEPS times over is measured by its integrated power, flagged as such."""
    steps = [gpu(t / 10, power=130, energy=(t // 1) * 13_000) for t in range(0, 11)]
    short = CaseSamples(start=0.52, end=0.535, interval_ms=100)
    short.gpu = steps
    assert counter_delta(_energy(steps), short.start, short.end) == pytest.approx(0.0, abs=2_000)
    fields = case_aggregates(short, completion_tokens=16)
    assert fields["gpu_energy_source"] == "integrated_power"
    assert fields["gpu_energy_j"] == pytest.approx(130 * 0.015)
    long = CaseSamples(start=0.05, end=0.95, interval_ms=100)
    long.gpu = steps
    fields = case_aggregates(long, completion_tokens=16)
    assert fields["gpu_energy_source"] == "counter"
    assert fields["gpu_energy_j"] == pytest.approx(130 * 0.9)


def _energy(samples: list[GpuSample]) -> list[tuple[float, float]]:
    return [(s.t, float(s.energy_mj)) for s in samples if s.energy_mj is not None]


def test_summaries_per_cell_and_prompt_take_medians_and_peaks() -> None:
    def call(prompt: str, cpu: float, rss: float, phase: str = "warm") -> dict[str, object]:
        return {"type": "call", "cell_id": "c", "prompt_id": prompt, "phase": phase,
                "error": None, "engine_cpu_s": cpu, "engine_cpu_s_per_token": cpu / 10,
                "engine_peak_rss_mib": rss}  # fmt: skip

    records: list[dict[str, object]] = [call("P-EASY", 1.0, 100), call("P-EASY", 3.0, 120), call("P-EASY", 2.0, 110),
               call("P-EASY", 99.0, 999, phase="cold"), {"type": "sample"}]  # fmt: skip
    (summary,) = telemetry_summaries(records)
    assert (summary.calls, summary.engine_cpu_s, summary.engine_peak_rss_mib) == (3, 2.0, 120.0)
    assert summary.gpu_energy_j_per_token is None  # no GPU figures: None, not zero


def test_limit_breaches_name_the_figure_and_skip_what_was_not_measured() -> None:
    calls = [{"type": "call", "cell_id": "c", "prompt_id": "P-HARD", "phase": "warm",
              "error": None, "engine_cpu_s_per_token": 0.02, "gpu_peak_memory_used_mib": 900.0}]  # fmt: skip
    limits = {"c": {"max_engine_cpu_s_per_token": 0.01, "max_peak_vram_mib": 1000.0,
                    "max_energy_j_per_token": 0.001}}  # fmt: skip
    (breach,) = limit_breaches(telemetry_summaries(calls), limits)
    assert (breach.prompt_id, breach.limit_name, breach.value, breach.limit) == (
        "P-HARD", "max_engine_cpu_s_per_token", 0.02, 0.01)  # fmt: skip
    assert breach.figure == "engine_cpu_s_per_token"
    assert limit_breaches(telemetry_summaries(calls), {"other": {"max_peak_vram_mib": 1.0}}) == []


def test_importing_the_plugin_loads_no_nvml_bindings() -> None:
    probe = "import sys, pytest_gpubench.plugin; print('pynvml' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False
    )
    assert result.stdout.strip() == "False", result.stderr


# -- configuration --------------------------------------------------------------------------


def write_matrix(tmp_path: Path, cells: str) -> tuple[Path, Path]:
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text("prompts:\n  P-EASY: {intent: x, prompt: hi, max_tokens: 4}\n")
    path = tmp_path / "cells.yaml"
    path.write_text(cells)
    return path, prompts


def test_telemetry_settings_globally_and_per_cell(tmp_path: Path) -> None:
    cells, prompts = write_matrix(
        tmp_path,
        "settings: {telemetry: {interval_ms: 100, gpu: off}}\n"
        "nodes: {local: {kind: local}}\n"
        "cells:\n  - {node: local, engine: llamacpp, model: tiny}\n"
        "  - {node: local, engine: llamacpp, model: tiny, name: b, telemetry: {cpu: off}}\n",
    )
    first, second = read_matrix(cells, prompts).cells
    assert first.telemetry == TelemetrySettings(interval_ms=100, gpu="off", cpu="auto")
    assert second.telemetry == TelemetrySettings(interval_ms=100, gpu="off", cpu="off")
    default = TelemetrySettings()
    assert default.interval_ms < 1000 and default.gpu == default.cpu == "auto"


def test_unknown_or_bad_telemetry_keys_are_errors_naming_them(tmp_path: Path) -> None:
    cells, prompts = write_matrix(
        tmp_path,
        "nodes: {local: {kind: local}}\n"
        "cells:\n  - {node: local, engine: llamacpp, model: tiny, telemetry: {interval: 5}}\n",
    )
    with pytest.raises(GpubenchError, match=r"cells\[0\] \(local:llamacpp:tiny\)\.telemetry\."
                       r"interval: unknown key"):  # fmt: skip
        read_matrix(cells, prompts)
    cells.write_text(
        "settings: {telemetry: {gpu: maybe}}\nnodes: {local: {kind: local}}\n"
        "cells:\n  - {node: local, engine: llamacpp, model: tiny}\n"
    )
    with pytest.raises(GpubenchError, match=r"settings\.telemetry\.gpu: .*'auto' or 'off'"):
        read_matrix(cells, prompts)


def one_case(
    telemetry: NodeTelemetry,
    *,
    cpu: bool,
    gpu: bool = True,
    pid: int | None = None,
    seconds: float = 0.3,
) -> CaseSamples:
    """Start the node's samplers, take one case window of `seconds` (around the engine `pid`,
    none by default), stop them."""
    telemetry.start()
    try:
        start = telemetry.begin_case(pid)
        time.sleep(seconds)
        return telemetry.end_case(start, gpu=gpu, cpu=cpu)
    finally:
        telemetry.stop()


# -- GPU through the NVML stand-in -------------------------------------------------------------


def test_nvml_samples_in_mib_watts_celsius_and_millijoules(monkeypatch: pytest.MonkeyPatch) -> None:
    module, state = nvml_module(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    telemetry = node_telemetry("local", LocalTarget(), [FAST], gpus=[])
    assert telemetry is not None
    case = one_case(telemetry, cpu=True)
    assert case.gpu_source == "nvml" and case.cpu_source == "proc"
    assert {s.gpu for s in case.gpu} == {0, 1}
    sample = case.gpu[0]
    assert sample.memory_total_mib == MEMORY_TOTAL_MIB  # bytes → MiB
    assert sample.memory_used_mib is not None and sample.memory_used_mib > MEMORY_USED_MIB
    assert sample.power_w == pytest.approx(POWER_W)  # mW → W
    assert sample.temperature_c == TEMPERATURE_C and sample.sm_clock_mhz == SM_CLOCK_MHZ
    assert sample.utilization_pct == UTILIZATION_PCT
    assert sample.energy_mj is not None and sample.energy_mj > 5_000_000  # mJ, counting up
    fields: Mapping[str, Any] = case_aggregates(case, completion_tokens=10)
    assert fields["gpu_energy_source"] == "counter" and fields["gpu_energy_j"] > 0
    assert fields["gpu_memory_total_mib"] == 2 * MEMORY_TOTAL_MIB
    assert state.shut_down


def test_another_process_on_the_gpu_and_its_throttled_clocks_are_recorded_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 43: a GPU shared with another process's kernels, or held below its clocks (its power
    cap, heat, a hardware slowdown), slows an unchanged engine as a busy neighbour does a CPU.
    Over a case, the call record lists the compute processes NVML saw on the GPUs that are not
    the engine's (its process and its children), and names the clock events that slow it; the
    GPU's own settings (idle, application clocks: 0x1, 0x2) are not named. Unknown, never
    empty, where there is no engine process to tell the others from."""
    module, state = nvml_module(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    engine = subprocess.Popen(["sleep", "30"])
    try:

        def case_fields(pid: int | None) -> Mapping[str, Any]:
            telemetry = node_telemetry("local", LocalTarget(), [FAST], gpus=[])
            assert telemetry is not None
            case = one_case(telemetry, pid=pid, seconds=0.2, cpu=False)
            return case_aggregates(case, completion_tokens=10)

        state.processes = {0: {engine.pid: 1 << 30, 4242: 1 << 20}, 1: {engine.pid: 1 << 20}}
        state.clock_events = 0x1 | 0x4 | 0x20
        fields = case_fields(engine.pid)
        assert fields["gpu_other_processes"] == [4242]
        assert fields["gpu_clock_events"] == ["power cap", "thermal (software)"]
        state.processes, state.clock_events = {0: {engine.pid: 1 << 30}}, 0x1
        quiet = case_fields(engine.pid)
        assert quiet["gpu_other_processes"] == [] and quiet["gpu_clock_events"] == []
        assert case_fields(None)["gpu_other_processes"] is None  # no engine process: unknown
    finally:
        engine.kill()
        engine.wait()


def test_the_engines_own_vram_is_told_apart_from_the_whole_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What an H100 showed: a cell's peak VRAM is the whole GPU's, so it counts another cell's
    idle server. The engine's own figure sums what NVML lists for the engine's process and its
    descendants (vLLM's engine core holds the GPU, not its API server), here a real grandchild."""
    module, state = nvml_module(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    engine = subprocess.Popen(["sh", "-c", "sh -c 'sleep 30' & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(tree := process_tree(engine.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        worker = max(tree)
        assert len(tree) == 3 and engine.pid in tree
        mib = 1024 * 1024
        state.processes = {0: {worker: 600 * mib, 1: 1000 * mib}, 1: {worker: 100 * mib}}
        telemetry = node_telemetry("local", LocalTarget(), [FAST], gpus=[])
        assert telemetry is not None
        case = one_case(telemetry, pid=engine.pid, seconds=0.2, cpu=False)
        fields: Mapping[str, Any] = case_aggregates(case, completion_tokens=10)
        assert fields["engine_gpu_memory_peak_mib"] == pytest.approx(700.0)  # both GPUs
        assert fields["gpu_peak_memory_used_mib"] > 2 * MEMORY_USED_MIB  # the GPUs' own, all of it
        # A driver that cannot tell a process's memory: unknown, never 0.
        state.processes = {0: {worker: None}}
        assert engine_memory_mib(compute_processes(module, 0), tree) is None
        assert (
            engine_memory_mib(compute_processes(module, 1), tree) == 0.0
        )  # listed nowhere on GPU 1: none there
        assert (
            engine_memory_mib(compute_processes(module, 0), ()) is None
        )  # no engine process (an external engine)
    finally:
        engine.kill()
        engine.wait()
    summary = telemetry_summaries([{"type": "call", "phase": "warm", "error": None,
                                    "cell_id": "c", "prompt_id": "p", **fields}])  # fmt: skip
    (row,) = telemetry_rows(summary)
    assert row[TELEMETRY_HEADERS.index("engine VRAM MiB")] == "700"


def test_a_lost_gpu_ends_the_nvml_sampler_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    module, state = nvml_module(energy_counter=False)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    telemetry = node_telemetry("local", LocalTarget(), [FAST], gpus=[])
    assert telemetry is not None
    telemetry.start()
    try:
        start = telemetry.begin_case(os.getpid())
        time.sleep(0.2)
        state.lost = True
        time.sleep(0.2)
        case = telemetry.end_case(start, gpu=True, cpu=True)
        later = telemetry.end_case(telemetry.begin_case(os.getpid()), gpu=True, cpu=True)
    finally:
        telemetry.stop()
    assert any("nvml sampler stopped" in note and "GPU is lost" in note for note in case.notes)
    fields = case_aggregates(case, completion_tokens=10)
    assert fields["gpu_energy_source"] == "integrated_power"  # no counter on this one
    # The CPU sampler goes on: this process's own CPU time and RSS.
    assert later.cpu and later.cpu[-1].engine_rss_mib and later.cpu[-1].engine_cpu_s


def test_without_the_nvml_library_a_local_gpu_is_sampled_with_nvidia_smi(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    module, _ = nvml_module(library=False)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    write_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    target = LocalTarget()
    gpus = target.gpu_inventory()
    assert gpus[0]["name"] == "NVIDIA H100 80GB HBM3" and gpus[0]["memory.total"] == "81559"
    telemetry = node_telemetry("local", target, [FAST], gpus=gpus)
    assert telemetry is not None
    case = one_case(telemetry, cpu=False)
    assert case.gpu_source == "nvidia-smi" and len(case.gpu) >= 3
    assert any("NVML unavailable" in note and "Library Not Found" in note for note in case.notes)
    assert case.gpu[0].memory_total_mib == MEMORY_TOTAL_MIB and case.gpu[0].power_w == POWER_W
    assert case.gpu[0].energy_mj is None  # nvidia-smi has no energy field: integrated, flagged
    assert case_aggregates(case, 10)["gpu_energy_source"] == "integrated_power"


# -- the nvidia-smi stand-in over SSH, and /proc over SSH ---------------------------------------


@pytest.fixture
def gpu_node(sshd: SshServer, tmp_path: Path) -> Iterator[tuple[SshTarget, Path]]:
    """An SSH node whose PATH starts with a folder for a stand-in nvidia-smi (set for this key
    alone, by its authorized_keys line); yields the target and that folder."""
    from pytest_gpubench.targets.ssh import SshTarget

    standin_dir = sshd.remote_dir / f"gpu-{tmp_path.name}"
    standin_dir.mkdir()
    key = tmp_path / "gpu_node_ed25519"
    public = sshd.new_key(key, "gpubench-telemetry")
    sshd.authorize(f'environment="PATH={standin_dir}:/usr/bin:/bin" {public}')
    target = SshTarget(
        "pavilion", sshd.host, sshd.port, sshd.user, key_file=str(key),
        known_hosts=str(sshd.known_hosts), connect_timeout_s=5.0, command_timeout_s=10.0,
    )  # fmt: skip
    yield target, standin_dir
    target.close()


def wait_for_no_process(user: str, words: tuple[str, ...], timeout_s: float = 5.0) -> list[str]:
    """The user's live processes whose command line holds one of the words, once none is left
    or the timeout passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        listing = subprocess.run(
            ["ps", "-u", user, "-o", "stat=,args="], capture_output=True, text=True, check=False
        )
        left = [
            line
            for line in listing.stdout.splitlines()
            if not line.startswith("Z") and any(word in line for word in words)
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.sshd
def test_ssh_node_streams_nvidia_smi_and_proc_of_its_engine(
    gpu_node: tuple[SshTarget, Path],
) -> None:
    target, standin_dir = gpu_node
    write_nvidia_smi(standin_dir, gpus=1, vanish_after=25)
    gpus = target.gpu_inventory()
    assert [gpu["name"] for gpu in gpus] == ["NVIDIA H100 80GB HBM3"]
    busy = target.start(["sh", "-c", "while :; do :; done"], log_path=f"{target.work_dir}/busy.log")
    telemetry = node_telemetry("pavilion", target, [TelemetrySettings(interval_ms=100)], gpus)
    assert telemetry is not None
    telemetry.start()
    try:
        start = telemetry.begin_case(busy.pid)
        time.sleep(1.0)
        case = telemetry.end_case(start, gpu=True, cpu=True)
        time.sleep(2.5)  # the stand-in GPU falls off the bus after 25 loops (2.5 s)
        after = telemetry.end_case(telemetry.begin_case(busy.pid), gpu=True, cpu=True)
    finally:
        telemetry.stop()
        busy.stop()
    # Stopped samplers leave nothing running on the node (nor does the vanished stand-in).
    assert wait_for_no_process(target.user, ("nvidia-smi", "clk_tck")) == []
    assert case.gpu_source == "nvidia-smi" and case.cpu_source == "proc"
    assert len(case.gpu) >= 5 and case.gpu[0].memory_total_mib == MEMORY_TOTAL_MIB
    assert case.gpu[0].temperature_c == TEMPERATURE_C and case.gpu[0].power_w == POWER_W
    fields: Mapping[str, Any] = case_aggregates(case, completion_tokens=100)
    assert fields["gpu_peak_memory_used_mib"] > MEMORY_USED_MIB  # grows 10 MiB per loop
    assert fields["gpu_energy_source"] == "integrated_power"
    assert fields["gpu_energy_j"] == pytest.approx(POWER_W * (case.end - case.start), rel=0.05)
    # The busy loop on the node burns CPU: most of the second, on a shared 2-core machine.
    assert {s.engine_pid for s in case.cpu} == {busy.pid}
    assert fields["engine_cpu_s"] > 0.2 and fields["engine_peak_rss_mib"] > 0
    assert fields["system_mem_used_peak_mib"] > 0 and fields["system_load1_max"] is not None
    assert any(
        "nvidia-smi stream ended" in note and "Unable to determine the device handle" in note
        for note in after.notes
    )
    assert after.cpu, "the CPU sampler goes on after the GPU is gone"


# An engine whose work is done by a child process (vLLM's engine core, Ollama's runner): the
# process the harness started only waits.
BUSY_CHILD = ["sh", "-c", "sh -c 'while :; do :; done' & wait"]


def busy_child_case(target: LocalTarget | SshTarget, log_dir: str) -> Mapping[str, Any]:
    engine = target.start(BUSY_CHILD, log_path=f"{log_dir}/busy-child.log")
    telemetry = node_telemetry("n", target, [TelemetrySettings(interval_ms=100, gpu="off")], [])
    assert telemetry is not None
    try:
        case = one_case(telemetry, pid=engine.pid, seconds=1.0, gpu=False, cpu=True)
    finally:
        engine.stop()
    return case_aggregates(case, completion_tokens=10)


def test_the_engines_cpu_time_counts_its_child_processes(tmp_path: Path) -> None:
    """Locally: the idle parent's own stat line says ~0 s; its tree burns most of the second."""
    target = LocalTarget()
    try:
        fields = busy_child_case(target, str(tmp_path))
    finally:
        target.close()
    assert fields["engine_cpu_s"] > 0.2 and fields["engine_peak_rss_mib"] > 0


@pytest.mark.sshd
def test_the_engines_cpu_time_counts_its_child_processes_over_ssh(
    gpu_node: tuple[SshTarget, Path],
) -> None:
    target, _ = gpu_node
    fields = busy_child_case(target, target.work_dir)
    assert fields["engine_cpu_s"] > 0.2 and fields["engine_peak_rss_mib"] > 0
    assert wait_for_no_process(target.user, ("while :", "clk_tck")) == []


# -- the real llama-server, through the plugin ---------------------------------------------


def canonical_prompts() -> str:
    return (REPO / "prompts.yaml").read_text()


@pytest.mark.engine
def test_real_llama_server_cpu_time_and_rss_and_a_gpu_that_vanishes(
    pytester: pytest.Pytester,
    llama_server: Path,
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    standins = pytester.path / "standin-bin"
    write_nvidia_smi(standins, vanish_after=8)
    monkeypatch.setenv("PATH", f"{standins}:{os.environ['PATH']}")
    module, _ = nvml_module(library=False)  # as on a machine without the NVML library
    monkeypatch.setitem(sys.modules, "pynvml", module)
    pytester.makefile(".yaml", prompts=canonical_prompts())
    pytester.makefile(
        ".yaml",
        cells="settings: {telemetry: {interval_ms: 50}}\nnodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, server_binary: '{llama_server}', "
        "server_args: [--threads, '1'], runs: 3, phases: [warm], prompts: [P-EASY, P-HARD]}\n",
    )
    pytester.makepyfile(test_bench="def test_generate(gpubench_case):\n    gpubench_case.run()\n")
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)  # the GPU vanished mid-run; every case still passed
    records = read_ledger(next((pytester.path / "runs").glob("*.jsonl")))
    assert wait_for_no_process(os.environ.get("USER", "root"), ("standin-bin/nvidia-smi",)) == []
    calls = [r for r in records if r["type"] == "call"]
    samples = [r for r in records if r["type"] == "sample"]
    assert [s["case_id"] for s in samples] == [c["case_id"] for c in calls]
    for call in calls:
        assert call["telemetry_cpu_source"] == "proc" and call["telemetry_interval_ms"] == 50
        assert call["engine_peak_rss_mib"] > 1 and call["engine_cpu_s"] >= 0
    sample = samples[0]
    assert set(sample["cpu"]) >= {"t_ms", "engine_pid", "engine_cpu_s", "engine_rss_mib"}
    assert len(set(sample["cpu"]["engine_pid"])) == 1 and sample["cpu"]["engine_pid"][0] > 0
    json.dumps(sample)  # compact, plain JSON
    by_prompt = {s.prompt_id: s for s in telemetry_summaries(records)}
    easy, hard = by_prompt["P-EASY"], by_prompt["P-HARD"]
    assert easy.engine_cpu_s is not None and hard.engine_cpu_s is not None
    # 1024 tokens cost the engine more CPU time than 64.
    assert hard.engine_cpu_s > easy.engine_cpu_s, (easy, hard)
    gpu_calls = [c for c in calls if c["telemetry_gpu_source"] == "nvidia-smi"]
    assert gpu_calls and gpu_calls[0]["gpu_peak_memory_used_mib"] >= MEMORY_USED_MIB
    notes = [note for c in calls for note in (c["telemetry_notes"] or [])]
    assert any("nvidia-smi stream ended" in note for note in notes), notes


def test_cells_that_turn_telemetry_off_get_no_samples(pytester: pytest.Pytester) -> None:
    """Ollama cannot run here: the stand-in follows Ollama's docs/api.md field by field."""
    from support.standins import OllamaStandin, serving

    with serving(OllamaStandin("a:1")) as quiet, serving(OllamaStandin()) as sampled:
        pytester.makefile(
            ".yaml",
            prompts="prompts:\n  P-EASY: {intent: x, prompt: hi, max_tokens: 4}\n",
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: ollama, model: 'a:1', endpoint: '{quiet}', runs: 2,"
            " phases: [warm], telemetry: {gpu: off, cpu: off}}\n"
            f"  - {{node: local, engine: ollama, model: 'qwen3.5:0.8b', endpoint: '{sampled}', "
            "runs: 2, phases: [warm], telemetry: {interval_ms: 30}}\n",
        )
        pytester.makepyfile(
            test_bench="def test_generate(gpubench_case):\n    gpubench_case.run()\n"
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    records = read_ledger(next((pytester.path / "runs").glob("*.jsonl")))
    calls = {r["case_id"]: r for r in records if r["type"] == "call"}
    samples = [r for r in records if r["type"] == "sample"]
    assert sorted({s["cell_id"] for s in samples}) == ["local:ollama:qwen3.5:0.8b"]
    assert len(samples) == 2
    for call in calls.values():
        if call["cell_id"] == "local:ollama:a:1":
            assert "telemetry_interval_ms" not in call and "engine_cpu_s" not in call
            continue
        # An external engine: no process to follow, the node's memory and load still sampled.
        assert call["telemetry_interval_ms"] == 30 and call["engine_cpu_s"] is None
        assert call["system_mem_used_peak_mib"] > 0 and call["system_load1_max"] is not None


@pytest.mark.engine
def test_a_telemetry_limit_fails_the_gate_and_the_reports_show_the_figures(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path
) -> None:
    pytester.makefile(".yaml", prompts=canonical_prompts())
    pytester.makefile(
        ".yaml",
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, server_binary: '{llama_server}', "
        "server_args: [--threads, '1'], runs: 2, phases: [warm], prompts: [P-HARD], "
        "thresholds: {max_engine_cpu_s_per_token: 0.000001, max_peak_vram_mib: 1}}\n",
    )
    pytester.makepyfile(test_bench="def test_generate(gpubench_case):\n    gpubench_case.run()\n")
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    assert result.ret == 6  # the benchmarks ran and one (cell, prompt) broke its limit
    result.stdout.fnmatch_lines(
        [
            "*cell*prompt*peak VRAM MiB*engine CPU s*CPU s/token*peak RSS MiB*",
            "local:llamacpp:tiny*P-HARD*",
            "REGRESSION: local:llamacpp:tiny P-HARD: engine_cpu_s_per_token * over its limit "
            "(max_engine_cpu_s_per_token: 1e-06)",
        ]
    )
    # No GPU here: peak VRAM was not measured, so its limit breaks nothing.
    assert "max_peak_vram_mib" not in result.stdout.str()
    ledger = next((pytester.path / "runs").glob("*.jsonl"))
    (end,) = [r for r in read_ledger(ledger) if r["type"] == "end"]
    assert [v["metric"] for v in end["verdicts"] if v["verdict"] == "regression"] == [
        "engine_cpu_s_per_token"
    ]
    from pytest_gpubench.reports.markdown import render_markdown

    markdown = render_markdown(read_ledger(ledger))
    assert "## Resource telemetry (warm calls)" in markdown
    section = markdown.split("## Resource telemetry (warm calls)")[1].split("\n## ")[0]
    assert "local:llamacpp:tiny" in section and "P-HARD" in section and "peak RSS MiB" in section


def test_telemetry_limit_keys_are_checked(tmp_path: Path) -> None:
    cells, prompts = write_matrix(
        tmp_path,
        "settings: {thresholds: {max_energy_j_per_token: 0.5}}\n"
        "nodes: {local: {kind: local}}\n"
        "cells:\n  - {node: local, engine: llamacpp, model: tiny,"
        " thresholds: {max_peak_vram_mib: -3}}\n",
    )
    with pytest.raises(GpubenchError, match=r"thresholds\.max_peak_vram_mib: .*greater than 0"):
        read_matrix(cells, prompts)
    cells.write_text(cells.read_text().replace("-3", "8000"))
    (cell,) = read_matrix(cells, prompts).cells
    assert (
        cell.thresholds.limit("max_peak_vram_mib") == 8000
        and cell.thresholds.limit("max_energy_j_per_token") == 0.5
    )
