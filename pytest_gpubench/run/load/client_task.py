"""A client task of `clients: {node, tasks}` (run/load/cluster_clients.py), started on the node
by srun (`python -m pytest_gpubench.run.load.client_task PLAN`, its share its SLURM_PROCID) or
by an SSH session (`... PLAN TASK TASKS`)."""

from __future__ import annotations

import sys

from pytest_gpubench.run.load.cluster_clients import task_main

if __name__ == "__main__":
    task_main(*sys.argv[1:4])
