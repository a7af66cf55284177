"""Slurm on the job's own node: the GPU inventory, gpu_check and vram_check run inside the
job's allocation (a step with `srun --overlap`, in the job's environment), and the telemetry
samplers stream from inside the job back through the login node.

The cluster is the real single-node Slurm of slurm_fixtures.py and the engine the real
llama-server with the tiny model. This machine has no GPU: the job's node "has" two H100s through
the nvidia-smi stand-in of gpu_standins.py (nvidia-smi's documented query and loop interface),
put on the job's PATH only (sbatch --export); the login node (this process) has none on its PATH.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.gpu_standins import GPU_NAME, write_nvidia_smi
from support.remote_cells import flow_mapping, ledger_of, managed_cell, write_project

from pytest_gpubench.core.status import EXIT_UNMEASURED

if TYPE_CHECKING:
    from support.slurm_fixtures import SlurmCluster

pytest_plugins = ["support.slurm_fixtures"]


def job_node(cluster: SlurmCluster, work_dir: Path, **extra: Any) -> str:
    job_bin = work_dir / "job-bin"
    write_nvidia_smi(job_bin, gpus=2)
    return flow_mapping(
        {
            "kind": "slurm",
            "partition": cluster.partition,
            "slurm_conf": str(cluster.conf),
            "work_dir": str(work_dir),
            "bind_host": "127.0.0.1",
            "queue_timeout_s": 60,
            "time_limit": "10:00",
            # The stand-in is on the job's PATH only: the login node's nvidia-smi differs.
            "sbatch_args": [f"--export=ALL,PATH={job_bin}:/usr/bin:/bin"],
            "gpu_type": "H100",
            **extra,
        }
    )


@pytest.fixture
def login_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """No nvidia-smi on the login node's PATH (the test process submits the jobs)."""
    assert shutil.which("nvidia-smi") is None, "this test needs a machine without nvidia-smi"


def test_gpu_check_vram_check_and_telemetry_judge_the_jobs_own_node(
    pytester: pytest.Pytester,
    slurm_cluster: SlurmCluster,
    llama_server: Path,
    tiny_model: Path,
    tmp_path: Path,
    login_without_gpu: None,
) -> None:
    write_project(
        pytester,
        {"cluster": job_node(slurm_cluster, tmp_path, gpu_count=2)},
        [
            managed_cell(
                "cluster",
                "tiny",
                (llama_server, tiny_model),
                phases=["warm"],
                runs=2,
                telemetry={"interval_ms": 100},
            )
        ],
    )
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    records = ledger_of(pytester)
    stages = {(r["stage"], r["outcome"]) for r in records if r["type"] == "stage"}
    assert ("gpu_check", "ok") in stages and ("vram_check", "ok") in stages
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert [gpu["name"] for gpu in cell["gpus"]] == [GPU_NAME, GPU_NAME]  # the job's GPUs
    samples = [r for r in records if r["type"] == "sample"]
    assert samples and all(s["gpu_source"] == "nvidia-smi" for s in samples)
    used = [value for s in samples for value in s["gpu"]["memory_used_mib"]]
    assert used and all(value >= 1234 for value in used)  # the stand-in's figures, from the job


def test_gpu_check_fails_on_what_the_jobs_node_reports(
    pytester: pytest.Pytester,
    slurm_cluster: SlurmCluster,
    llama_server: Path,
    tiny_model: Path,
    tmp_path: Path,
    login_without_gpu: None,
) -> None:
    """The node asks for one GPU; the job's node reports two: gpu_check fails naming both, the
    login node's answer (no nvidia-smi at all) is not what is judged."""
    write_project(
        pytester,
        {"cluster": job_node(slurm_cluster, tmp_path, gpu_count=1, gpu_check="required")},
        [managed_cell("cluster", "tiny", (llama_server, tiny_model), phases=["warm"], runs=1)],
    )
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    assert result.ret == EXIT_UNMEASURED
    result.stdout.fnmatch_lines(["*gpu_count is 1, but nvidia-smi reports 2 (NVIDIA H100*"])
    records = ledger_of(pytester)
    (outcome,) = records[-1]["cells"]
    assert outcome["status"] == "failed" and outcome["stage"] == "gpu_check"
    assert slurm_cluster.jobs() == []  # the job was cancelled when its check failed
