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


def test_a_managed_cell_without_paths_runs_from_the_submit_hosts_shared_files(
    pytester: pytest.Pytester,
    slurm_cluster: SlurmCluster,
    llama_server: Path,
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No server_binary, no model_path: the job's node sees this host's llama-server and tiny
    model at the same paths (one machine: a shared filesystem), checked by sha256, and runs
    them; the cell record says which paths it took."""
    monkeypatch.setenv("GPUBENCH_LLAMA_SERVER", str(llama_server))
    node = flow_mapping(
        {
            "kind": "slurm",
            "partition": slurm_cluster.partition,
            "slurm_conf": str(slurm_cluster.conf),
            "work_dir": str(tmp_path),
            "bind_host": "127.0.0.1",
            "queue_timeout_s": 60,
            "time_limit": "10:00",
        }
    )
    cell = flow_mapping(
        {
            "node": "cluster",
            "engine": "llamacpp",
            "model": "tiny",
            "server_args": ["--threads", "1"],
            "phases": ["warm"],
            "runs": 1,
        }
    )
    write_project(pytester, {"cluster": node}, [cell])
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    (described,) = [r for r in ledger_of(pytester) if r["type"] == "cell"]
    assert described["shared_paths"] == {
        "model_path": str(tiny_model.resolve()),
        "server_binary": str(llama_server.resolve()),
    }
    assert described["node_info"]["slurm_job_id"]


def test_a_path_the_node_does_not_share_is_one_clear_line(tmp_path: Path) -> None:
    """A node that does not see this host's file (or holds another one there)."""
    from pytest_gpubench.config.matrix import load_matrix
    from pytest_gpubench.core.errors import GpubenchError
    from pytest_gpubench.engines.managed_llamacpp import _shared_path
    from pytest_gpubench.targets import CommandResult

    (tmp_path / "prompts.yaml").write_text("prompts: {P: {intent: x, prompt: hi, max_tokens: 4}}\n")
    (tmp_path / "cells.yaml").write_text(
        "nodes: {box: {kind: ssh, host: 127.0.0.1, user: bench}}\n"
        "cells: [{node: box, engine: llamacpp, model: tiny}]\n"
    )
    (cell,) = load_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml").cells
    local = tmp_path / "llama-server"
    local.write_bytes(b"the submit host's build")

    class Node:
        """A node that answers sha256sum with another file's digest, or not at all."""

        def __init__(self, answer: str | None) -> None:
            self.answer = answer

        def run(self, argv: Any, *, timeout_s: float) -> CommandResult:
            if self.answer is None:
                return CommandResult(tuple(argv), 1, "", "")
            return CommandResult(tuple(argv), 0, f"{self.answer}  {argv[-1]}\n", "")

    for answer, why in ((None, "the node does not see it"), ("0" * 64, "holds another file")):
        with pytest.raises(GpubenchError) as excinfo:
            _shared_path(cell, Node(answer), "server_binary", local)  # type: ignore[arg-type]
        message = str(excinfo.value)
        assert (
            message.startswith("cell box:llamacpp:tiny: server_binary: not set") and why in message
        )
        assert "\n" not in message
