"""The workload tests' shared set-up (test_workloads_real.py on llama.cpp, test_workloads_vllm.py
on vLLM): the shipped ShareGPT sample copied into the project, the dataset entry that samples it,
an edit of its questions, the benchmark run in a subprocess and the newest ledger it wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_gpubench.ledger.writer import read_ledger

SAMPLE = (
    Path(__file__).parent.parent.parent
    / "pytest_gpubench"
    / "config"
    / "samples"
    / "chat_sample.jsonl"
)
# The file name the dataset entry reads, in the project's folder.
SAMPLE_FILE = "chat.jsonl"
DATASET = f"{{path: {SAMPLE_FILE}, format: sharegpt, count: 3, seed: 7, max_output_words: 20}}"
# The prompts.yaml entry that measures the sample single-call.
SHAREGPT_PROMPTS = f"prompts:\n  chat: {{intent: support chat, dataset: {DATASET}}}\n"


def copy_sharegpt_sample(project: Path) -> Path:
    """The shipped sample copied into the project as the file DATASET names."""
    path = project / SAMPLE_FILE
    path.write_text(SAMPLE.read_text())
    return path


def edit_every_question(path: Path) -> None:
    """Reword every user turn of the file (what a careless edit of a shipped dataset does)."""
    lines = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        for turn in entry["conversations"]:
            if turn["from"] == "human":
                turn["value"] = "Please answer: " + turn["value"]
        lines.append(json.dumps(entry))
    path.write_text("\n".join(lines) + "\n")


def run_workload(
    pytester: pytest.Pytester, *args: str, in_process: bool = False
) -> pytest.RunResult:
    """The benchmark run (load tests forced, tree dirty): in a subprocess, as a user runs it, or
    in this process, which saves the 1-2 s a subprocess takes to import pytest, pandas and scipy
    (the plugin's lazy imports are kept alive by tests/conftest.py). The subject is the workload,
    not the shared machine's steadiness: it is not checked."""
    options = ("--force-load", "--allow-dirty", "-p", "no:cacheprovider",
               "--gpubench-steadiness", "off", *args)  # fmt: skip
    if in_process:
        return pytester.runpytest(*options)
    return pytester.runpytest_subprocess(*options)


def ledger_records(root: Path) -> list[dict[str, Any]]:
    """The records of the newest ledger under root/runs."""
    newest = max((root / "runs").glob("*.jsonl"), key=lambda path: path.stat().st_mtime_ns)
    return read_ledger(newest)
