"""Stages of a node (docs/remote-nodes.md "Stages"): each timed against its own timeout and the node's budget,
each outcome reported; gpu_check and vram_check against nvidia-smi.

This machine has no GPU: nvidia-smi is the stand-in of gpu_standins.py, which prints
nvidia-smi's documented CSV (`--query-gpu=... --format=csv,noheader,nounits`) for one or more
NVIDIA H100 80GB HBM3 with 81559 MiB in total and 80325 MiB free.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.gpu_standins import write_nvidia_smi

from pytest_gpubench.targets.bringup import (
    NodeGpus,
    check_gpus,
    check_vram,
    gpu_matches,
    gpu_mismatch,
    read_gpus,
)
from pytest_gpubench.targets.local import LocalTarget
from pytest_gpubench.targets.stages import StageClock, StageError, StageOutcome


def recording_clock(**options: object) -> tuple[StageClock, list[StageOutcome]]:
    outcomes: list[StageOutcome] = []
    clock = StageClock("gpubox", report=outcomes.append, **options)  # type: ignore[arg-type]
    return clock, outcomes


@pytest.fixture
def standin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two stand-in GPUs first on PATH (LocalTarget runs nvidia-smi from PATH)."""
    directory = tmp_path / "bin"
    write_nvidia_smi(directory, gpus=2)
    monkeypatch.setenv("PATH", f"{directory}:/usr/bin:/bin")
    return directory


def test_each_stage_reports_its_outcome_and_its_own_timeout() -> None:
    clock, outcomes = recording_clock(timeouts={"model_pull": 7.0})
    with clock.stage("engine_install", 30.0) as limit:
        assert limit == 30.0
    with pytest.raises(StageError), clock.stage("model_pull", 900.0) as limit:
        assert limit == 7.0  # the node's stage_timeouts entry wins over the default
        raise StageError("model_pull", "pull failed", timed_out=True)
    with pytest.raises(StageError), clock.stage("engine_start", 5.0, cell_id="gpubox:x:y"):
        raise StageError("engine_start", "exited while starting")
    assert [(o.stage, o.outcome, o.timeout_s, o.error) for o in outcomes] == [
        ("engine_install", "ok", 30.0, None),
        ("model_pull", "timeout", 7.0, "pull failed"),
        ("engine_start", "failed", 5.0, "exited while starting"),
    ]
    assert outcomes[2].cell_id == "gpubox:x:y" and outcomes[2].to_facts()["node"] == "gpubox"


def test_the_budget_cuts_every_stage_and_a_spent_budget_fails_the_next() -> None:
    clock, outcomes = recording_clock(budget_s=0.5)
    with clock.stage("engine_install", 600.0) as limit:
        assert limit is not None and limit <= 0.5
        time.sleep(0.6)
    spent = r"\[model_pull\] node gpubox: budget of 0.5 s spent"
    with pytest.raises(StageError, match=spent), clock.stage("model_pull", 600.0):
        pytest.fail("a stage after the budget is spent must not run")
    assert [(o.stage, o.outcome) for o in outcomes] == [
        ("engine_install", "ok"),
        ("model_pull", "timeout"),
    ]


def test_gpu_names_match_the_way_marketplaces_write_them() -> None:
    assert gpu_matches("RTX 4090", "NVIDIA GeForce RTX 4090")
    assert gpu_matches("H100", "NVIDIA H100 80GB HBM3")
    assert gpu_matches("h100-80gb", "NVIDIA H100 80GB HBM3")
    assert not gpu_matches("A100", "NVIDIA H100 80GB HBM3")
    assert not gpu_matches("RTX 4090", "NVIDIA GeForce RTX 4080")
    two = NodeGpus(("NVIDIA H100 80GB HBM3",) * 2, (80325.0, 80325.0))
    assert gpu_mismatch("gpubox", two, "H100", 2) is None
    assert gpu_mismatch("gpubox", NodeGpus((), ()), "H100", None) == (
        "node gpubox: gpu_type is 'H100', but nvidia-smi reports no GPU"
    )


def test_gpu_check_reads_nvidia_smi_and_names_both_gpus_when_they_differ(
    standin_path: Path,
) -> None:
    target = LocalTarget("gpubox")
    gpus = read_gpus(target, 10)
    assert gpus == NodeGpus(("NVIDIA H100 80GB HBM3",) * 2, (80325.0, 80325.0))
    clock, outcomes = recording_clock()
    check_gpus(target, clock, gpu_type="H100", gpu_count=2, mode="auto")
    with pytest.raises(StageError) as wrong_type:
        check_gpus(target, clock, gpu_type="RTX 4090", gpu_count=None, mode="auto")
    assert wrong_type.value.stage == "gpu_check"
    assert wrong_type.value.message == (
        "node gpubox: gpu_type is 'RTX 4090', but nvidia-smi reports "
        "NVIDIA H100 80GB HBM3, NVIDIA H100 80GB HBM3"
    )
    with pytest.raises(StageError, match="gpu_count is 4, but nvidia-smi reports 2"):
        check_gpus(target, clock, gpu_type="H100", gpu_count=4, mode="auto")
    assert [o.outcome for o in outcomes] == ["ok", "failed", "failed"]


def test_a_node_without_nvidia_smi_is_skipped_unless_the_check_is_required(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    target = LocalTarget("gpubox")
    clock, outcomes = recording_clock()
    check_gpus(target, clock, gpu_type="H100", gpu_count=None, mode="auto")
    with pytest.raises(StageError, match="nvidia-smi did not answer"):
        check_gpus(target, clock, gpu_type="H100", gpu_count=None, mode="required")
    check_gpus(target, clock, gpu_type="H100", gpu_count=None, mode="off")
    assert [(o.outcome, o.error) for o in outcomes] == [
        ("skipped", "nvidia-smi did not answer: GPU not checked"),
        ("failed", "node gpubox: nvidia-smi did not answer on the node"),
    ]


def test_vram_check_fails_fast_when_the_model_does_not_fit(standin_path: Path) -> None:
    target = LocalTarget("gpubox")
    clock, outcomes = recording_clock()
    free_gib = 2 * 80325 / 1024
    check_vram(target, clock, cell_id="c", model_bytes=150 * 2**30, where="vram_gb")
    with pytest.raises(StageError) as too_big:
        check_vram(target, clock, cell_id="c", model_bytes=170 * 2**30, where="vram_gb")
    assert too_big.value.stage == "vram_check"
    assert too_big.value.message == (
        f"cell c: the model needs 170.00 GiB (vram_gb), but the node's GPUs have "
        f"{free_gib:.2f} GiB free (nvidia-smi)"
    )
    assert [(o.stage, o.outcome, o.cell_id) for o in outcomes] == [
        ("vram_check", "ok", "c"),
        ("vram_check", "failed", "c"),
    ]


def test_a_stage_timed_elsewhere_is_stopped_by_its_own_timeout_or_the_budget() -> None:
    """The benchmark stage runs from a cell's readiness to its close, outside `stage()`: it is
    told what is left of its own timeout, and when to stop."""
    clock, _ = recording_clock(timeouts={"benchmark": 5.0})
    begun = time.monotonic()
    assert clock.left("benchmark", begun) == pytest.approx(5.0, abs=0.5)
    assert clock.overrun("benchmark", begun) is None
    assert clock.overrun("benchmark", begun - 6) == (
        "node gpubox: benchmark ran past its timeout of 5 s"
    )
    budgeted, _ = recording_clock(budget_s=0.05)
    time.sleep(0.1)
    assert budgeted.overrun("benchmark", time.monotonic()) == (
        "node gpubox: budget of 0.05 s spent during benchmark"
    )
    unlimited, _ = recording_clock()
    assert unlimited.left("benchmark", begun - 10**6) is None


class HangingTarget(LocalTarget):
    """A node whose closing never returns (a dead SSH connection, a hung scancel)."""

    def __init__(self, node_id: str, hang_s: float) -> None:
        super().__init__(node_id)
        self.hang_s = hang_s

    def close(self) -> None:
        time.sleep(self.hang_s)


def test_cleanup_has_a_timeout_of_its_own_and_a_grace_past_the_budget() -> None:
    from pytest_gpubench.run.harness import CLEANUP_GRACE_S, cleanup_limit, close_within

    clock, _ = recording_clock(timeouts={"cleanup": 45.0}, budget_s=10**6)
    assert cleanup_limit(clock) == pytest.approx(45.0)
    spent, _ = recording_clock(budget_s=0.01)
    time.sleep(0.05)
    assert cleanup_limit(spent) == CLEANUP_GRACE_S  # the node is still given back
    begun = time.monotonic()
    problem = close_within(HangingTarget("gpubox", 5.0), 0.2)
    assert time.monotonic() - begun < 2
    assert problem is not None and "cleanup ran past its timeout of 0.2 s" in problem
    assert close_within(HangingTarget("gpubox", 0.0), 5.0) is None
