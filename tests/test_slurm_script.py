"""The batch scripts the Slurm node kind and `gpubench slurm submit` write.

Apptainer cannot be installed here, so the container path is checked through the script it
generates (`apptainer exec --nv IMAGE argv`), which the real sbatch accepts (`--test-only`), and
through one real job whose `apptainer` is a stand-in on PATH that does what Apptainer's
documented `exec [options] IMAGE COMMAND...` form does for a program: run COMMAND.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from pytest_gpubench.cli.main import main
from pytest_gpubench.config.nodes import SlurmNode
from pytest_gpubench.targets.protocol import Rental
from pytest_gpubench.targets.slurm import open_slurm_target
from pytest_gpubench.targets.slurm.script import job_name, job_script

if TYPE_CHECKING:
    from support.slurm_fixtures import SlurmCluster

pytest_plugins = ["support.slurm_fixtures"]

ARGV = ["/opt/llama/llama-server", "--model", "/scratch/m o.gguf", "--alias", "x;rm -rf /"]


def _node(**keys: Any) -> SlurmNode:
    return SlurmNode(kind="slurm", **keys)


def _script(node: SlurmNode, log_path: str = "/shared/logs/e.log") -> str:
    return job_script(node, ARGV, cell_label="c", name=job_name("c"), log_path=log_path)


def _exec_words(script: str) -> list[str]:
    (line,) = [line for line in script.splitlines() if line.startswith("exec ")]
    return shlex.split(line)[1:]


def test_the_script_asks_for_the_nodes_resources_and_execs_the_engine() -> None:
    node = _node(
        partition="gpu",
        gres="gpu:a100:2",
        time_limit="1:30:00",
        account="bench-team",
        constraint="a100&nvlink",
        qos="short",
        cpus_per_task=8,
        mem="64G",
        sbatch_args=["--exclusive"],
    )
    script = _script(node)
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert directives == [
        "#SBATCH --job-name=gpubench-c",
        "#SBATCH --output=/shared/logs/e.log",
        "#SBATCH --ntasks=1",
        "#SBATCH --nodes=1",
        "#SBATCH --partition=gpu",
        "#SBATCH --gres=gpu:a100:2",
        "#SBATCH --time=1:30:00",
        "#SBATCH --account=bench-team",
        "#SBATCH '--constraint=a100&nvlink'",
        "#SBATCH --qos=short",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --mem=64G",
        "#SBATCH --exclusive",
    ]
    # exec: scancel's SIGTERM reaches the engine itself; each argument one literal word.
    assert _exec_words(script) == ARGV


def test_a_container_runs_the_engine_through_apptainer_exec_nv() -> None:
    node = _node(container="/images/llama.sif", container_args=["--bind", "/scratch"])
    assert _exec_words(_script(node)) == [
        "apptainer", "exec", "--nv", "--bind", "/scratch", "/images/llama.sif", *ARGV
    ]  # fmt: skip
    singularity = _node(container="/images/llama.sif", container_runtime="singularity")
    assert _exec_words(_script(singularity))[:4] == [
        "singularity", "exec", "--nv", "/images/llama.sif"
    ]  # fmt: skip


def test_job_names_stay_plain() -> None:
    assert (
        job_name("gpu box:llamacpp:qwen3.5:0.8b@v2") == "gpubench-gpu_box_llamacpp_qwen3.5_0.8b_v2"
    )


@pytest.mark.slurm
def test_sbatch_accepts_the_container_script(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The real sbatch parses every directive (--test-only: checked, not queued)."""
    node = _node(
        partition=slurm_cluster.partition,
        time_limit="5:00",
        cpus_per_task=1,
        container="/images/llama.sif",
    )
    path = tmp_path / "job.sbatch"
    path.write_text(_script(node, str(tmp_path / "e.log")), encoding="utf-8")
    checked = slurm_cluster.client("sbatch", "--test-only", str(path))
    assert checked.returncode == 0, checked.stderr
    assert "to start at" in checked.stderr
    assert slurm_cluster.jobs() == []


@pytest.mark.slurm
def test_a_container_job_runs_its_engine_in_the_image(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = tmp_path / "bin" / "apptainer"
    stand_in.parent.mkdir()
    # Apptainer's `exec [--nv] [options] IMAGE COMMAND...`: record the call, run COMMAND.
    stand_in.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {tmp_path}/apptainer-args\n'
        '[ "$1" = exec ] || exit 64\n'
        "shift\n"
        'while [ "$1" != "$IMAGE_EXPECTED" ]; do shift; done\n'
        "shift\n"
        'exec "$@"\n',
        encoding="utf-8",
    )
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stand_in.parent}:{Path(sys.executable).parent}:/usr/bin:/bin")
    monkeypatch.setenv("IMAGE_EXPECTED", "/images/llama.sif")
    node = _node(
        partition=slurm_cluster.partition,
        slurm_conf=str(slurm_cluster.conf),
        work_dir=str(tmp_path),
        bind_host="127.0.0.1",
        container="/images/llama.sif",
        queue_timeout_s=30,
    )
    ended: list[Rental] = []
    target = open_slurm_target("cluster", node, on_job_ended=ended.append)
    try:
        port = target.free_port()
        argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
        job = target.start(argv, log_path=str(tmp_path / "engine.log"))
        host, port = target.reach("127.0.0.1", port)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert httpx.get(f"http://{host}:{port}/", trust_env=False).status_code == 200
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        target.close()
    recorded = (tmp_path / "apptainer-args").read_text().split()
    assert recorded[:3] == ["exec", "--nv", "/images/llama.sif"]
    assert recorded[3:] == argv
    assert [e["state"] for e in ended] == ["CANCELLED"]
    assert slurm_cluster.job_field(job.job_id, "JobState") == "CANCELLED"


def _four_nodes(root: Path) -> None:
    (root / "prompts.yaml").write_text(
        'prompts:\n  P: {intent: x, prompt: "hi", max_tokens: 4}\n', encoding="utf-8"
    )
    nodes = ["a", "b", "c", "d"]
    (root / "cells.yaml").write_text(
        "nodes:\n"
        + "".join(f"  {node}: {{kind: local}}\n" for node in nodes)
        + "cells:\n"
        + "".join(
            f"  - {{node: {node}, engine: llamacpp, model: m, endpoint: 'http://127.0.0.1:1'}}\n"
            for node in nodes
        ),
        encoding="utf-8",
    )


def test_slurm_submit_writes_a_job_array_of_shards(tmp_path: Path) -> None:
    _four_nodes(tmp_path)
    script = tmp_path / "array.sbatch"
    status = main(
        [
            "slurm", "submit", "--no-submit", "--shards", "3", "--root", str(tmp_path),
            "--ledger-dir", str(tmp_path / "shared"), "--script", str(script),
            "--sbatch-option=--partition=cpu", "--", "benchmarks/", "-m", "warm",
        ]
    )  # fmt: skip
    assert status == 0
    text = script.read_text()
    assert "#SBATCH --array=0-2" in text
    assert "#SBATCH --partition=cpu" in text
    (line,) = [line for line in text.splitlines() if line.startswith("exec ")]
    plain = line.replace('"$SLURM_ARRAY_TASK_ID/3"', "TASK/3")
    words = shlex.split(plain.replace('"$SLURM_ARRAY_JOB_ID"', "JOB"))
    assert words[:2] == ["exec", sys.executable]
    assert words[2:6] == ["-m", "pytest", "benchmarks/", "-m"]
    assert "--gpubench-shard" in words and "TASK/3" in words
    assert f"--gpubench-ledger-dir={tmp_path / 'shared'}/array-JOB" in words
    assert (tmp_path / "shared" / "logs").is_dir()
    ran = subprocess.run(["sh", "-n", str(script)], capture_output=True, check=False)
    assert ran.returncode == 0


def test_slurm_submit_splits_by_node_at_most(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _four_nodes(tmp_path)
    common = ["slurm", "submit", "--no-submit", "--root", str(tmp_path)]
    assert main([*common, "--ledger-dir", str(tmp_path / "s")]) == 0
    assert "#SBATCH --array=0-3" in (tmp_path / "s" / "gpubench-array.sbatch").read_text()
    assert main([*common, "--ledger-dir", str(tmp_path / "s"), "--shards", "5"]) == 2
    assert "has 4 node(s)" in capsys.readouterr().err
