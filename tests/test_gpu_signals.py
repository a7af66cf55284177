"""The GPU's own signals beside each call (issue 43): another compute process on the GPU, and
clocks held down (thermal, power cap, a hardware slowdown), read through NVML (here its
stand-in, tests/support/gpu_standins.py), make a verdict `unsteady` naming them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from support.bench_files import CHECKED_TEST_FILE, ONE_PROMPT
from support.gpu_standins import nvml_module
from support.tiny_server import users_llama_server


@pytest.mark.engine
def test_another_process_on_the_gpu_and_new_throttling_make_a_verdict_unsteady_naming_them(
    pytester: pytest.Pytester,
    llama_server: Path,
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real llama-server started by hand (found from its endpoint: its process is the
    engine's), its GPU the NVML stand-in's. Baseline: the engine alone on the GPU, at its power
    cap. Then another process on the GPU and its clocks held down by heat too: every timed
    figure is unsteady, naming the other process and the new reason, not the power cap both
    runs shared; the call records list the other process and the reasons."""
    from pytest_gpubench.ledger.writer import read_ledger

    module, state = nvml_module()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    args = ("--force-load", "-p", "no:cacheprovider")
    with users_llama_server(llama_server, tiny_model) as (url, pid):
        pytester.makefile(
            ".yaml",
            prompts=ONE_PROMPT,
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{url}', "
            "phases: [warm], runs: 6, telemetry: {interval_ms: 20}}\n",
        )
        pytester.makepyfile(test_bench=CHECKED_TEST_FILE)
        state.processes, state.clock_events = {0: {pid: 1 << 30}}, 0x4
        ratified = pytester.runpytest(*args, "--baseline-update")
        assert ratified.ret == 0, ratified.stdout.str()[-2000:]
        state.processes = {0: {pid: 1 << 30, 4242: 1 << 20}}
        state.clock_events = 0x4 | 0x40
        shared = pytester.runpytest(*args)
    assert shared.ret == 10, shared.stdout.str()[-3000:]
    newest = max((pytester.path / "runs").glob("*.jsonl"), key=lambda path: path.stat().st_mtime)
    records: list[dict[str, Any]] = list(read_ledger(newest))
    calls = [r for r in records if r["type"] == "call" and r["phase"] == "warm"]
    assert calls and all(call["gpu_other_processes"] == [4242] for call in calls), calls[0]
    assert all(call["gpu_clock_events"] == ["power cap", "thermal (hardware)"] for call in calls)
    (end,) = [r for r in records if r["type"] == "end"]
    # The timed figures the baseline holds (the success rate is not a timing: no machine moves
    # it; 8 tokens may leave no decode rate to compare).
    timed = [
        v for v in end["verdicts"] if v["metric"] != "warm_success_rate" and v["verdict"] != "new"
    ]
    assert len(timed) >= 2, end["verdicts"]
    for verdict in timed:
        assert verdict["verdict"] == "unsteady", verdict
        message = verdict["message"]
        assert "another process ran on the GPU during 6 of 6 calls" in message, message
        assert "the GPU's clocks were held down (thermal (hardware) in 6 of 6 calls)" in message
        assert "power cap" not in message
