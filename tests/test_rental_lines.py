"""What each kind's rental says in the terminal (targets/rentals.py), without a node: the lines
the rented, Slurm and SSH flows assert end to end."""

from __future__ import annotations

from pytest_gpubench.reports.terminal import TerminalLine, rental_lines


def test_each_kind_of_rental_reads_in_its_own_words_and_alarms_when_left_running() -> None:
    rentals = [
        {
            "kind": "provider",
            "node": "rented",
            "gpu_name": "RTX 4090",
            "price_per_hour": 0.4,
            "elapsed_s": 12.0,
            "cost": 0.0013,
            "session_id": "sess-1",
            "session_done": True,
        },
        {
            "kind": "slurm",
            "node": "cluster",
            "slurm_job_id": "17",
            "job_name": "gpubench-llama-server-x",
            "compute_node": "gpubench1",
            "state": "RUNNING",
            "elapsed_s": 3.0,
            "leaked": True,
        },
        {
            "kind": "ssh_server",
            "node": "gpubox",
            "program": "llama-server",
            "pid": 4242,
            "session_done": True,
            "state": "stopped",
        },
    ]
    assert rental_lines(rentals) == [
        TerminalLine(
            "rented node rented: RTX 4090 at 0.4/h for 12.0 s, cost 0.0013; session sess-1 "
            "marked done",
            red=False,
        ),
        TerminalLine(
            "slurm node cluster: left by a killed run, cancelled now: job 17 "
            "(gpubench-llama-server-x) on gpubench1: RUNNING after 3.0 s; cancel it by hand: "
            "scancel 17",
            red=True,
        ),
        TerminalLine(
            "ssh node gpubox: left by a killed run: llama-server (pid 4242): stopped", red=False
        ),
    ]
