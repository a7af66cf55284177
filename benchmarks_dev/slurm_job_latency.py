"""What running a managed llama-server as a Slurm job costs against running it locally.

Starts the tests' single-node Slurm cluster on loopback (tests/support/slurm_fixtures.py), then,
--repeat times each: the managed llama-server (tiny model) started as a Slurm job (write the script,
sbatch, wait for RUNNING, wait for /health) and stopped (scancel, wait until the job has left the
queue, read its final state), and the same server started and stopped as a local process. Prints
the median and max of each step in milliseconds. Needs root, `bash scripts/setup-slurm.sh` and
`make engine`.

    python benchmarks_dev/slurm_job_latency.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_gpubench.config.nodes import SlurmNode
from pytest_gpubench.engines.llamacpp_build import ensure_llama_server
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.engines.tinymodel import ensure_tiny_model
from pytest_gpubench.targets import Target
from pytest_gpubench.targets.local import LocalTarget
from pytest_gpubench.targets.protocol import Rental
from pytest_gpubench.targets.slurm import SlurmTarget, open_slurm_target


def _timed(step: Callable[[], Any]) -> float:
    started = time.perf_counter()
    step()
    return (time.perf_counter() - started) * 1000


def measure(target: Target, log_dir: str, repeat: int) -> dict[str, list[float]]:
    server = ManagedLlamaServer(
        target,
        cell_id="bench:llamacpp:tiny",
        binary=str(ensure_llama_server(None)),
        model_path=str(ensure_tiny_model()),
        alias="tiny",
        log_dir=log_dir,
        extra_args=["--threads", "1"],
    )
    figures: dict[str, list[float]] = {"start to healthy": [], "stop": []}
    for _ in range(repeat):
        figures["start to healthy"].append(_timed(server.start))
        figures["stop"].append(_timed(server.stop))
    return figures


def _print(label: str, figures: dict[str, list[float]]) -> None:
    for step, values in figures.items():
        print(
            f"{label:<14} {step:<18} median {statistics.median(values):8.0f} ms   "
            f"max {max(values):8.0f} ms   (n={len(values)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    # The tests' cluster set-up, shared rather than copied.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.slurm_fixtures import running_cluster

    with tempfile.TemporaryDirectory() as work, running_cluster() as cluster:
        ended: list[Rental] = []
        node = SlurmNode(
            kind="slurm",
            partition=cluster.partition,
            slurm_conf=str(cluster.conf),
            work_dir=work,
            bind_host="127.0.0.1",
            queue_timeout_s=60,
        )
        slurm: SlurmTarget = open_slurm_target("cluster", node, on_job_ended=ended.append)
        try:
            _print("slurm job", measure(slurm, work, args.repeat))
        finally:
            slurm.close()
        print(f"jobs: {len(ended)}, final states: {sorted({str(e['state']) for e in ended})}")
        local = LocalTarget()
        try:
            _print("local process", measure(local, work, args.repeat))
        finally:
            local.close()


if __name__ == "__main__":
    main()
