"""A client task of `clients: {node, tasks}` (run/load/cluster_clients.py), started by srun on
the node: `python -m pytest_gpubench.run.load.client_task PLAN`."""

from __future__ import annotations

import sys

from pytest_gpubench.run.load.cluster_clients import task_main

if __name__ == "__main__":
    task_main(sys.argv[1])
