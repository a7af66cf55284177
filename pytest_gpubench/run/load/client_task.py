"""A client task of a load point (run/load/clients.py), started on a node by srun (`python -m
pytest_gpubench.run.load.client_task PLAN`, its share its SLURM_PROCID), by an SSH session
(`... PLAN TASK TASKS`), or spawned on this machine (`processes: N`)."""

from __future__ import annotations

import sys

from pytest_gpubench.run.load.clients import task_main

if __name__ == "__main__":
    task_main(*sys.argv[1:4])
