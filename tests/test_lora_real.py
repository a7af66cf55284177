"""LoRA adapters on the real llama-server: two adapters generated for the tiny model (as the
model itself is generated), each on a managed cell of its own (`lora: tiny-lora-<seed>`). They
answer the same prompt differently, and each adapter's cell gets its own baseline and verdicts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pytest_gpubench.cli.main import main
from pytest_gpubench.core.files import file_sha256
from pytest_gpubench.engines.tinymodel import ensure_tiny_lora, tiny_lora_seed
from pytest_gpubench.ledger.writer import read_ledger

pytestmark = pytest.mark.engine

PROMPTS = 'prompts:\n  P-EASY: {intent: short, prompt: "hello there", max_tokens: 8}\n'
TESTS = """
def test_generate(gpubench_case):
    gpubench_case.run()


def test_answer(gpubench_engine):
    call = gpubench_engine.chat("hello there", max_tokens=8, temperature=0)
    assert call.error is None, call.error
    print("ANSWER", gpubench_engine.cell.cell_id, repr(call.text))
"""
ADAPTED = ("local:llamacpp:tiny@lora-1", "local:llamacpp:tiny@lora-2")


def test_two_generated_adapters_answer_differently_and_are_judged_each_on_its_own(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    # Its subject is that each adapter is judged against its own baseline: thresholds of 1000 %
    # keep the tiny model's 2-3 ms TTFT, which moves by half between runs on a shared machine,
    # from a within-run regression on 4 calls a side.
    managed = (
        f"node: local, engine: llamacpp, model: tiny, runs: 4, phases: [warm], "
        f"server_binary: '{llama_server}', server_args: [--threads, '1'], "
        "thresholds: {ttft_p50: 10, total_p50: 10, tokens_per_sec: 10}"
    )
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{{managed}}}\n"
        f"  - {{{managed}, name: lora-1, lora: tiny-lora-1}}\n"
        f"  - {{{managed}, name: lora-2, lora: tiny-lora-2}}\n",
    )
    pytester.makepyfile(test_bench=TESTS)
    steady = ("--force-load", "--gpubench-steadiness", "off", "-s")
    ratified = pytester.runpytest(*steady, "--baseline-update")
    assert ratified.ret == 0, ratified.stdout.str()
    answers = dict(re.findall(r"ANSWER (\S+) '(.*)'", ratified.stdout.str()))
    assert set(answers) == {"local:llamacpp:tiny", *ADAPTED}
    # Three answers, all different: each adapter changes what the model says.
    assert len(set(answers.values())) == 3, answers
    baselines = sorted(path.name for path in (pytester.path / "baselines").glob("*.json"))
    assert baselines == [
        "local_llamacpp_tiny.json",
        "local_llamacpp_tiny_lora-1.json",
        "local_llamacpp_tiny_lora-2.json",
    ]
    # Each adapter is part of its cell's setup: its digest follows the model's.
    first = min((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    digests = {r["cell_id"]: r["model_digest"] for r in read_ledger(first) if r["type"] == "cell"}
    model = digests["local:llamacpp:tiny"]
    for cell, seed in zip(ADAPTED, (1, 2), strict=True):
        adapter = f"sha256:{file_sha256(ensure_tiny_lora(seed))}"
        assert digests[cell] == f"{model}+lora:{adapter}"
    # A second run is judged per adapter, against that adapter's baseline.
    judged = pytester.runpytest(*steady)
    assert judged.ret in (0, 10), judged.stdout.str()
    for cell in ADAPTED:
        verdict = rf"{re.escape(cell)}\s+P-EASY\s.*\s(ok|win|unsteady|blind|inconclusive)\s*$"
        judged.stdout.re_match_lines([verdict])
    newest = max((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    (end,) = [r for r in read_ledger(newest) if r["type"] == "end"]
    judged_cells = {v["cell_id"] for v in end["verdicts"] if v["metric"] == "warm_ttft_p50_ms"}
    assert judged_cells == {"local:llamacpp:tiny", *ADAPTED}


def test_a_generated_adapter_is_written_once_and_named_by_its_seed(tmp_path: Path) -> None:
    assert (tiny_lora_seed("tiny-lora-7"), tiny_lora_seed("tiny-lora-x")) == (7, None)
    first = ensure_tiny_lora(1, tmp_path)
    written = first.read_bytes()
    other = ensure_tiny_lora(2, tmp_path)
    assert ensure_tiny_lora(1, tmp_path) == first and other != first
    assert written != other.read_bytes()
    # The same seed writes the same bytes: a baseline's adapter is the one written again.
    first.unlink()
    assert ensure_tiny_lora(1, tmp_path).read_bytes() == written


MULTI = "local:llamacpp:tiny@multi"
ANSWERS = """
import pytest


def test_generate(gpubench_case):
    gpubench_case.run()


def answer(engine, **options):
    call = engine.chat("hello there", max_tokens=8, temperature=0, **options)
    assert call.error is None, call.error
    print("ANSWER", engine.cell.cell_id, options.get("lora"), repr(call.text))


@pytest.mark.gpubench(runs=1)
def test_base(gpubench_engine):
    answer(gpubench_engine)


@pytest.mark.gpubench(cells=["local:llamacpp:tiny@multi"], runs=1)
def test_one(gpubench_engine):
    answer(gpubench_engine, **gpubench_engine.cell.adapter_body("one"))


@pytest.mark.gpubench(cells=["local:llamacpp:tiny@multi"], runs=1)
def test_two(gpubench_engine):
    answer(gpubench_engine, **gpubench_engine.cell.adapter_body("two"))
"""


def test_one_server_serves_two_adapters_chosen_per_request_each_judged_on_its_own(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    """One managed llama-server loads both generated adapters (`--lora` each, not applied until
    a request names one): each request's `lora` field applies its adapter alone, which answers
    as a server with only that adapter does; the base model answers a request that names none.
    Each prompt is measured and judged once per adapter (`P-EASY@one`, `P-EASY@two`), cold
    (after a restart) and warm."""
    # Thresholds of 1000 % as above: the subject is per-adapter judging, not the tiny model's
    # few-ms timings on a shared machine.
    managed = (
        f"node: local, engine: llamacpp, model: tiny, runs: 4, phases: [cold, warm], "
        f"server_binary: '{llama_server}', server_args: [--threads, '1'], "
        "thresholds: {ttft_p50: 10, total_p50: 10, tokens_per_sec: 10}"
    )
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{{managed}, name: multi, lora: {{one: tiny-lora-1, two: tiny-lora-2}}}}\n"
        f"  - {{{managed}, name: lora-1, lora: tiny-lora-1}}\n",
    )
    pytester.makepyfile(test_bench=ANSWERS)
    steady = ("--force-load", "--gpubench-steadiness", "off", "-s")
    ratified = pytester.runpytest(*steady, "--baseline-update")
    assert ratified.ret == 0, ratified.stdout.str()
    found = re.findall(r"ANSWER (\S+) (None|\[.*?\]) '(.*)'", ratified.stdout.str())
    by = {(cell, lora): text for cell, lora, text in found}
    one = by[(MULTI, str([{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]))]
    two = by[(MULTI, str([{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]))]
    base = by[(MULTI, "None")]
    # Each adapter answers differently, and neither as the base model does ...
    assert len({one, two, base}) == 3, (one, two, base)
    # ... and adapter `one` chosen per request answers as a server with only tiny-lora-1.
    assert one == by[("local:llamacpp:tiny@lora-1", "None")]
    # The warm cases: the prompt once per adapter, each with its own summary in the baseline.
    baseline = json.loads(
        (pytester.path / "baselines" / "local_llamacpp_tiny_multi.json").read_text()
    )
    assert {"P-EASY@one", "P-EASY@two"} <= set(baseline["prompts"])
    first = min((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    calls = [
        r
        for r in read_ledger(first)
        if r["type"] == "call" and r["cell_id"] == MULTI and r.get("test_id") is None
    ]
    assert sorted((c["phase"], c["prompt_id"], c["lora_adapter"]) for c in calls) == sorted(
        [("cold", "P-EASY@one", "one"), ("cold", "P-EASY@two", "two")]
        + [("warm", "P-EASY@one", "one")] * 4
        + [("warm", "P-EASY@two", "two")] * 4
    )
    assert all(c["error"] is None for c in calls)
    assert {c["cold_kind"] for c in calls if c["phase"] == "cold"} == {"restart"}
    # Both adapters are the cell's setup: their digests follow the model's, in order.
    (digest,) = {
        r["model_digest"]
        for r in read_ledger(first)
        if r.get("cell_id") == MULTI and r["type"] == "cell"
    }
    adapters = [f"+lora:sha256:{file_sha256(ensure_tiny_lora(seed))}" for seed in (1, 2)]
    assert digest.endswith("".join(adapters))
    # A second run judges each adapter against its own baseline.
    judged = pytester.runpytest(*steady)
    assert judged.ret in (0, 10), judged.stdout.str()
    for prompt in ("P-EASY@one", "P-EASY@two"):
        verdict = rf"{re.escape(MULTI)}\s+{prompt}\s.*\s(ok|win|unsteady|blind|inconclusive)\s*$"
        judged.stdout.re_match_lines([verdict])
    newest = max((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    (end,) = [r for r in read_ledger(newest) if r["type"] == "end"]
    judged_prompts = {
        v["prompt_id"]
        for v in end["verdicts"]
        if v["metric"] == "warm_ttft_p50_ms" and v["cell_id"] == MULTI
    }
    assert {"P-EASY@one", "P-EASY@two"} <= judged_prompts


def test_under_load_each_request_names_its_adapter_in_turn_and_the_split_is_recorded(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    """A load point on a cell with two adapters: requests name them in turn (round robin), each
    call record says which it named, and the load record and the terminal's load table give
    the split (requests per adapter, and their TTFT and E2E percentiles)."""
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, name: multi, phases: [warm], runs: 1,"
        f" server_binary: '{llama_server}', server_args: [--threads, '1'],"
        " lora: {one: tiny-lora-1, two: tiny-lora-2},"
        " load: {concurrency: [2], requests: 10, lora_choice: round_robin}}\n",
    )
    pytester.makepyfile(test_bench="def test_generate(gpubench_case):\n    gpubench_case.run()\n")
    result = pytester.runpytest("--force-load", "--gpubench-steadiness", "off")
    assert result.ret == 0, result.stdout.str()
    ledger = max((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    records = list(read_ledger(ledger))
    (load,) = [r for r in records if r["type"] == "load"]
    split = {row["adapter"]: row for row in load["lora_split"]}
    # 10 measured requests in turn: exactly 5 each, all answered.
    assert {name: (row["requests"], row["errors"]) for name, row in split.items()} == {
        "one": (5, 0),
        "two": (5, 0),
    }
    assert all(row["ttft_ms_p50"] is not None and row["e2e_ms_p99"] for row in split.values())
    calls = [r for r in records if r["type"] == "call" and r.get("load_point") == "c2"]
    assert {c["request_idx"] % 2: c["lora_adapter"] for c in calls} == {0: "one", 1: "two"}
    assert all(c["lora_adapter"] == ("one", "two")[c["request_idx"] % 2] for c in calls)
    result.stdout.re_match_lines([r"\s*c2\s+one\s+5\s+0\s.*", r"\s*c2\s+two\s+5\s+0\s.*"])
    # The Markdown document and the HTML report of the ledger have the split too.
    markdown = pytester.path / "report.md"
    assert main(["report", str(ledger), "-o", str(markdown)]) == 0
    assert re.search(r"^\| c2 +\| one +\| +5 \| +0 \|", markdown.read_text(), re.M)
    html = pytester.path / "report.html"
    assert main(["report", "--html", str(ledger), "-o", str(html)]) == 0
    assert "<tr><td>c2</td><td>two</td><td>5</td><td>0</td>" in html.read_text()
