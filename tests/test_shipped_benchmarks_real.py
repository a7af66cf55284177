"""What users run is what is tested (issue 44): the shipped benchmarks/ files, copied from the
repository as they are, and the project `gpubench init` writes, run against the real llama.cpp
server serving the tiny model on every request kind it can serve: a chat and a completion on one
cell, embeddings and reranks on cells of their own (docs/request-kinds.md). The managed cells run
the server the embedded default runs (the prebuilt one where the machine takes it: what a new user
gets). Every case passes on the figure its kind has; none is judged on chat's completion
tokens."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.workload_runs import ledger_records, run_workload

from pytest_gpubench.core.status import EXIT_REGRESSION, EXIT_UNSTEADY

REPOSITORY = Path(__file__).resolve().parent.parent
# Each kind's prompt, one prompt a kind (docs/request-kinds.md's worked examples, made short).
KIND_PROMPTS = (
    '  C-STORY: {intent: raw continuation, kind: completion, prompt: "Once upon a time", '
    "max_tokens: 8}\n"
    '  E-PAIR: {intent: two short texts embedded, kind: embedding, prompt: "hello world", '
    'inputs: ["good morning"]}\n'
    '  R-WEATHER: {intent: three documents ranked, kind: rerank, prompt: "weather today", '
    'documents: ["sunny and warm", "a recipe for fish", "rain by noon"], top_n: 2}\n'
)


def kind_cells(generating: list[str]) -> str:
    """A generating cell for `generating`, an embedding cell and a rerank cell (each kind gets
    the server flags it needs from its prompts: docs/request-kinds.md)."""
    common = "server_args: [--threads, '1'], phases: [warm]"
    return (
        f"  - {{node: local, engine: llamacpp, model: tiny, {common}, "
        f"prompts: [{', '.join(generating)}]}}\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, name: embed, {common}, "
        "prompts: [E-PAIR]}\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, name: rank, {common}, "
        "prompts: [R-WEATHER]}\n"
    )


def calls_by_prompt(root: Path) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for record in ledger_records(root):
        if record["type"] == "call":
            found.setdefault(record["prompt_id"], []).append(record)
    return found


def failures(result: pytest.RunResult) -> str:
    """The run's output, for an assertion's message."""
    return result.stdout.str()[-6000:]


@pytest.mark.engine
def test_the_shipped_inference_benchmark_passes_every_request_kind_on_the_real_llama_server(
    pytester: pytest.Pytester,
) -> None:
    """benchmarks/test_inference.py as shipped: a chat, a completion, an embedding and a rerank
    case each pass, checked on its kind's own figure (the embedding and rerank cases had failed
    on `the engine reported no completion tokens`)."""
    shutil.copy(REPOSITORY / "benchmarks" / "test_inference.py", pytester.path)
    pytester.makefile(
        ".yaml",
        prompts="prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 8}\n" + KIND_PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n" + kind_cells(["P-EASY", "C-STORY"]),
    )
    result = run_workload(pytester, "--gpubench-runs", "2", "-rf", in_process=True)
    assert result.ret == pytest.ExitCode.OK, failures(result)
    result.assert_outcomes(passed=4 * 2)
    calls = calls_by_prompt(pytester.path)
    assert [call["inputs"] for call in calls["E-PAIR"]] == [2, 2]
    assert [call["inputs"] for call in calls["R-WEATHER"]] == [3, 3]
    assert all(call["completion_tokens"] for call in calls["P-EASY"] + calls["C-STORY"])


@pytest.mark.engine
def test_the_project_gpubench_init_writes_passes_every_request_kind_on_the_real_llama_server(
    pytester: pytest.Pytester,
) -> None:
    """`gpubench init`, then the user adds an embedding and a rerank prompt, each on a cell of
    its own as docs/request-kinds.md says, to the files it wrote: `pytest benchmarks/` passes.
    (The starter cell measures the canonical prompts; two warm runs of the short one here.)"""
    root = pytester.path
    init = subprocess.run(
        [sys.executable, "-m", "pytest_gpubench.cli.main", "init"],
        cwd=root, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert init.returncode == 0, init.stderr
    with (root / "prompts.yaml").open("a", encoding="utf-8") as prompts:
        prompts.write(KIND_PROMPTS)
    cells = (root / "cells.yaml").read_text(encoding="utf-8")
    starter = '  - {node: local, engine: llamacpp, model: tiny, server_args: [--threads, "1"]}\n'
    assert cells.endswith(starter), cells
    (root / "cells.yaml").write_text(
        cells[: -len(starter)] + kind_cells(["P-EASY", "C-STORY"]), encoding="utf-8"
    )
    result = run_workload(pytester, "benchmarks/", "--gpubench-runs", "2", "-rf", in_process=True)
    assert result.ret == pytest.ExitCode.OK, failures(result)
    result.assert_outcomes(passed=4 * 2)
    calls = calls_by_prompt(root)
    assert [call["kind"] for call in calls["E-PAIR"] + calls["R-WEATHER"]] == (
        ["embedding"] * 2 + ["rerank"] * 2
    )


def verdicts(root: Path) -> dict[tuple[str, str], str]:
    (end,) = [r for r in ledger_records(root) if r["type"] == "end"]
    return {(v["prompt_id"], v["metric"]): v["verdict"] for v in end["verdicts"]}


@pytest.mark.engine
def test_the_json_example_on_a_model_that_answers_in_prose_is_ratified_and_gated(
    pytester: pytest.Pytester, tiny_model: Path
) -> None:
    """benchmarks/test_json_answer.py as shipped, on a managed cell that serves the tiny model's
    file under another name, `prose` (the tiny model answers noise, never JSON: what a model that
    answers in prose does to the example; the example had expected failure of `tiny` alone). `--baseline-update` passes and ratifies the
    numbers, its schema valid rate 0/5 among them (the example had failed every case: "the
    answer is not JSON"); the next run judges that rate against the baseline's."""
    shutil.copy(REPOSITORY / "benchmarks" / "test_json_answer.py", pytester.path)
    pytester.makefile(
        ".yaml",
        prompts="prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 8}\n",
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: prose, model_path: '{tiny_model}', "
        "server_args: [--threads, '1']}\n",
    )
    ratified = run_workload(pytester, "--baseline-update", "-rf", in_process=True)
    assert ratified.ret == pytest.ExitCode.OK, failures(ratified)
    ratified.assert_outcomes(passed=5)
    ratified.stdout.fnmatch_lines(
        ["*local:llamacpp:prose *test_json_answer *json_schema *0/5 schema valid*"]
    )
    calls = calls_by_prompt(pytester.path)["test_json_answer"]
    assert [(call["kind"], call["schema_valid"]) for call in calls] == [("json_schema", 0)] * 5
    baseline = (pytester.path / "baselines" / "local_llamacpp_prose.json").read_text()
    assert '"test_json_answer"' in baseline and '"schema_valid"' in baseline

    again = run_workload(pytester, "-rf", in_process=True)
    assert again.ret in (0, EXIT_REGRESSION, EXIT_UNSTEADY), failures(again)
    again.assert_outcomes(passed=5)
    assert verdicts(pytester.path)[("test_json_answer", "warm_schema_valid_rate")] == "ok"
