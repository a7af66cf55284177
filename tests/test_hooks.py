"""Engine and node kinds added by another package through the hooks of hookspecs.py.

The plugin here is a conftest.py, as a user's own would be: a `vllm` engine kind that talks to
the real llama-server through the OpenAI adapter (llama-server speaks that protocol too), and
a `lab` node kind whose target is this machine with facts of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.bench_files import CHECKED_TEST_FILE, ONE_PROMPT

from pytest_gpubench.ledger.writer import read_ledger

if TYPE_CHECKING:
    from pytest_gpubench.engines.managed import ManagedLlamaServer

PROMPTS = ONE_PROMPT
TEST_FILE = CHECKED_TEST_FILE
PLUGIN = """
from pathlib import Path

from pytest_gpubench.engines.openai import OpenAIEngine
from pytest_gpubench.targets.local import LocalTarget

EVENTS = Path(__file__).parent / "events.log"


class LabTarget(LocalTarget):
    def __init__(self, node_id, rack):
        super().__init__(node_id)
        self.rack = rack

    def describe(self):
        return {**super().describe(), "rack": self.rack}

    def close(self):
        with EVENTS.open("a") as events:
            events.write(f"closed {self.node_id}\\n")
        super().close()


def pytest_gpubench_engine_kinds():
    return ["vllm"]


def pytest_gpubench_make_engine(cell, base_url, api_key, model_digest):
    if cell.spec.engine == "vllm":
        return OpenAIEngine(base_url, cell.spec.model, api_key)
    return None


def pytest_gpubench_node_kinds():
    return ["lab", "tape", "flaky"]


def pytest_gpubench_open_target(node_id, node):
    if node.kind == "flaky":
        with EVENTS.open("a") as events:
            events.write(f"tried {node_id}\\n")
        raise RuntimeError("rack r9 is offline")
    if node.kind != "lab":
        return None  # "tape" is named, but nothing opens it
    with EVENTS.open("a") as events:
        events.write(f"opened {node_id}\\n")
    return LabTarget(node_id, node.options["rack"])
"""


@pytest.mark.engine
def test_plugin_engine_and_node_kinds_run_cells(
    pytester: pytest.Pytester, server: ManagedLlamaServer, llama_server: Path
) -> None:
    pytester.makeconftest(PLUGIN)
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes:\n"
        "  bench: {kind: lab, rack: r7}\n"
        "  vault: {kind: tape}\n"
        "  r9: {kind: flaky}\n"
        "cells:\n"
        f"  - {{node: bench, engine: vllm, model: tiny, endpoint: '{server.base_url}', runs: 2,"
        " phases: [warm]}\n"
        f"  - {{node: bench, engine: llamacpp, model: tiny, server_binary: '{llama_server}',"
        " server_args: [--threads, '1'], runs: 2, phases: [warm]}\n"
        f"  - {{node: vault, engine: vllm, model: tiny, endpoint: '{server.base_url}', runs: 1,"
        " phases: [warm]}\n"
        f"  - {{node: r9, engine: vllm, model: a, endpoint: '{server.base_url}', runs: 1,"
        " phases: [warm]}\n"
        f"  - {{node: r9, engine: vllm, model: b, endpoint: '{server.base_url}', runs: 1,"
        " phases: [warm]}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, skipped=3)

    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    calls = [r for r in records if r["type"] == "call"]
    by_cell = {c["cell_id"]: c for c in calls}
    assert by_cell["bench:vllm:tiny"]["backend"] == "openai"
    assert by_cell["bench:llamacpp:tiny"]["backend"] == "llamacpp"
    assert all(c["completion_tokens"] == 8 and c["error"] is None for c in calls)
    cells = {r["cell_id"]: r for r in records if r["type"] == "cell"}
    assert {cell["node_kind"] for cell in cells.values()} == {"lab"}
    assert all(cell["node_info"]["rack"] == "r7" for cell in cells.values())
    # One target for bench, shared by its two cells and closed after the last of them; a node
    # whose plugin failed is tried once for both of its cells.
    assert (pytester.path / "events.log").read_text().splitlines() == [
        "opened bench",
        "closed bench",
        "tried r9",
    ]
    skipped = {r["cell_id"]: r for r in records if r["type"] == "skipped"}
    assert skipped["vault:vllm:tiny"]["stage"] == "provision"
    assert "no plugin opened its kind tape" in skipped["vault:vllm:tiny"]["reason"]
    for cell_id in ("r9:vllm:a", "r9:vllm:b"):
        assert skipped[cell_id]["stage"] == "provision"
        assert skipped[cell_id]["reason"] == (
            "[provision] node r9: RuntimeError: rack r9 is offline"
        )
    assert "Traceback" not in result.stdout.str()


def test_without_the_plugin_the_kinds_are_usage_errors(pytester: pytest.Pytester) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\n"
        "cells:\n  - {node: local, engine: vllm, model: m, endpoint: 'http://127.0.0.1:9'}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*cells.yaml: cells[[]0[]] (local:vllm:m).engine: unknown engine kind 'vllm'*"]
    )
    assert "Traceback" not in result.stderr.str()
