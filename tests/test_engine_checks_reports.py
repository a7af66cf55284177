"""The checks against the engine and the request kinds' figures (issue 35) in every report a
user reads beyond the terminal: the Markdown document, the HTML report, the pull request summary,
and the CSV and JSON exports. Each shows the terminal's own rows (reports/engine_checks_table.py,
reports/terminal.kind_rows), from the ledger's records or the session's judgement.

The ledger of the first tests is written here: it holds at once what no engine here gives in one
run (a draft model's acceptance, a prefix cache that ignored the request, a vLLM-like counter
set, an embedding and a json_schema prompt). The end-to-end test runs a session against the
stand-in whose `usage` disagrees with what it streamed (tests/support/standins.py,
FaultyOpenAIServer's MISCOUNT, OpenAI's streaming protocol field by field): no real engine
miscounts on purpose.
"""

from __future__ import annotations

import csv
import json
import random
import re
from pathlib import Path
from typing import Any, cast

import pytest
from support import ledgers
from support.standins import FaultyOpenAIServer, serving
from test_html_report import CHROMIUM, chromium, console_problems, needs_chromium

from pytest_gpubench.cli.main import main
from pytest_gpubench.ledger.schema import EndRecord
from pytest_gpubench.reports.engine_checks_table import render_engine_checks
from pytest_gpubench.reports.frame import read_ledger_frame
from pytest_gpubench.reports.markdown import render_markdown
from pytest_gpubench.reports.pr_summary import render_pr_summary
from pytest_gpubench.reports.terminal import render_summary
from pytest_gpubench.results.engine_checks import engine_checks
from pytest_gpubench.results.stats import summarize

RUN = "run-checks"
DRAFT = "local:llamacpp:tiny@draft"
VLLM = "local:openai:qwen"
OFF = "local:openai:off"


def warm(cell_id: str, prompt_id: str, run_idx: int, **fields: Any) -> dict[str, Any]:
    return {
        "type": "call",
        "benchmark_run_id": RUN,
        "cell_id": cell_id,
        "prompt_id": prompt_id,
        "prompt_sha256": f"sha-{prompt_id}",
        "phase": "warm",
        "run_idx": run_idx,
        "cold_kind": None,
        "first_delta_ms": 4.0 + run_idx,
        "total_duration_ms": 20.0 + run_idx,
        "tokens_per_sec": 300.0,
        "finish_reason": "length",
        "error": None,
        "coalesced": False,
        "prompt_tokens": 38,
        "client_chunks": 8,
        "completion_tokens": 8,
        **fields,
    }


def check_records() -> list[dict[str, Any]]:
    """Three warm calls per (cell, prompt): a draft cell whose prefix cache served every call,
    a vLLM cell whose usage disagrees and whose cache served calls that asked for none, a cell
    of token_check: off with the same disagreement, an embedding and a json_schema prompt (one
    answer of three off its schema)."""
    calls = []
    for run_idx in range(3):
        calls += [
            warm(
                DRAFT,
                "P-EASY",
                run_idx,
                token_mismatch=False,
                prefix_cache_hit=True,
                draft_tokens=18,
                draft_accepted_tokens=15,
                engine_counters={
                    "prefix_cache_hits": 37.0,
                    "prefix_cache_queries": 38.0,
                    "requests_waiting_peak": float(run_idx),
                },
            ),
            warm(
                VLLM,
                "P-EASY",
                run_idx,
                token_mismatch=True,
                client_chunks=4,
                completion_tokens=7,
                prefix_cache_hit=True,
                prefix_cache_off=True,
                engine_counters={"preemptions": 1.0, "kv_cache_usage_peak": 0.25 + run_idx / 10},
            ),
            warm(OFF, "P-EASY", run_idx, token_mismatch=True, client_chunks=4, completion_tokens=7),
            warm(
                DRAFT,
                "E-PAIR",
                run_idx,
                kind="embedding",
                first_delta_ms=None,
                tokens_per_sec=None,
                inputs=2,
                inputs_per_sec=100.0 + 10 * run_idx,
                client_chunks=None,
                completion_tokens=None,
            ),
            warm(DRAFT, "J-PERSON", run_idx, kind="json_schema", schema_valid=int(run_idx < 2)),
        ]
    meta = {
        "type": "meta",
        "benchmark_run_id": RUN,
        "judging": {"version": 1, "cells": {OFF: {"token_check": "off"}}},
    }
    end = {"type": "end", "benchmark_run_id": RUN, "exit_status": 0, "verdicts": [], "cells": []}
    return [meta, *calls, end]


# The rows the terminal shows for these records (reports/engine_checks_table.py), cell by cell.
DRAFT_ROW = ("3/3 agree", "3/3 hit (111/114 tokens)", "requests queued (peak) 2", "45/54 (83%)")
VLLM_ROW = ("3 of 3 differ", "3/3 hit ASKED OFF", "preemptions 3, KV-cache usage (peak) 0.45")
TOKEN_LINE = (
    f"TOKEN COUNTS: {VLLM} P-EASY: 3 of 3 warm calls streamed another count of tokens than the "
    "engine's usage (4 streamed, usage 7)"
)
CACHE_LINE = (
    f"PREFIX CACHE: {VLLM} P-EASY: 3 of 3 warm calls were served from the engine's prefix cache "
    "although the request asked for none"
)


def calls_of(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [record for record in records if record["type"] == "call"]


def markdown_row(text: str, *cells: str) -> bool:
    """Whether some row of a Markdown table holds these cells in this order."""
    pattern = r"\|\s*" + r"\s*\|\s*".join(re.escape(cell) for cell in cells) + r"\s*\|"
    return any(re.search(pattern, line) for line in text.splitlines() if line.startswith("|"))


def test_the_terminal_shows_the_rows_the_other_reports_must_show() -> None:
    """The reference: the terminal summary of these records (the judgement's checks)."""
    records = check_records()
    checks = engine_checks(calls_of(records), [OFF])
    text = render_summary(summarize(calls_of(records)), [], checks=checks)
    assert re.search(
        rf"{re.escape(DRAFT)}\s+P-EASY\s+" + r"\s+".join(map(re.escape, DRAFT_ROW)), text
    )
    assert TOKEN_LINE in text and CACHE_LINE in text
    assert "2/3 schema valid" in text


def test_the_markdown_report_shows_the_checks_and_the_kinds(tmp_path: Path) -> None:
    records = check_records()
    ledger = ledgers.write(tmp_path / "runs" / f"{RUN}.jsonl", records)
    output = tmp_path / "report.md"
    assert main(["report", str(ledger), "-o", str(output)]) == 0
    text = output.read_text(encoding="utf-8")

    checks = text[text.index("## Checks against the engine") :]
    assert markdown_row(checks, DRAFT, "P-EASY", *DRAFT_ROW)
    assert markdown_row(checks, VLLM, "P-EASY", *VLLM_ROW, "-")
    # token_check: off, as the run recorded it: the counts are not checked (the engine told
    # nothing else to check: no row), nor warned of.
    assert OFF not in checks
    assert f"- {TOKEN_LINE}" in checks
    assert CACHE_LINE in checks
    assert f"TOKEN COUNTS: {OFF}" not in text
    kinds = text[text.index("## Request kinds") : text.index("## Checks against the engine")]
    assert markdown_row(kinds, DRAFT, "E-PAIR", "embedding", "110.0", "-")
    assert markdown_row(kinds, DRAFT, "J-PERSON", "json_schema", "-", "2/3 schema valid")
    assert "P-EASY" not in kinds  # a chat prompt has no row of its own

    # The ledger read as columns (the CLI) and as records give the same document, and so does
    # the columns' cache the first report wrote beside the ledger.
    assert text == render_markdown(records)
    assert ledger.with_name(ledger.name + ".columns").exists()
    again = tmp_path / "again.md"
    assert main(["report", str(ledger), "-o", str(again)]) == 0
    assert again.read_text(encoding="utf-8") == text


def test_a_report_of_chat_only_without_engine_checks_has_neither_section(tmp_path: Path) -> None:
    ledger = ledgers.write(tmp_path / "run.jsonl", ledgers.run_records("run-plain", warm=3))
    output = tmp_path / "report.md"
    assert main(["report", str(ledger), "-o", str(output)]) == 0
    text = output.read_text(encoding="utf-8")
    assert "## Request kinds" not in text and "## Checks against the engine" not in text


@pytest.fixture(scope="module")
def html_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("checks-html")
    ledger = ledgers.write(tmp_path / "runs" / f"{RUN}.jsonl", check_records())
    output = tmp_path / "report.html"
    assert main(["report", str(ledger), "--html", "-o", str(output)]) == 0
    return output


def html_rows(text: str) -> list[list[str]]:
    """The cells of each table row of the body (not the heads), as text."""
    rows = [
        [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", text, flags=re.S)
    ]
    return [row for row in rows if row]


def test_the_html_report_shows_the_checks_and_the_kinds(html_report: Path) -> None:
    text = html_report.read_text(encoding="utf-8")
    checks = text[text.index('id="engine-checks"') :]
    rows = html_rows(checks)
    assert [DRAFT, "P-EASY", *DRAFT_ROW] in rows
    assert [VLLM, "P-EASY", *VLLM_ROW, "-"] in rows
    assert OFF not in checks
    assert TOKEN_LINE.replace("'", "&#x27;") in checks
    kinds = text[text.index('id="request-kinds"') : text.index('id="engine-checks"')]
    assert html_rows(kinds) == [
        [DRAFT, "E-PAIR", "embedding", "110.0", "-"],
        [DRAFT, "J-PERSON", "json_schema", "-", "2/3 schema valid"],
    ]


@pytest.mark.browser
@needs_chromium
def test_chromium_shows_the_checks_table(html_report: Path, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    dom = chromium(html_report, tmp_path / "profile", "--dump-dom")
    assert console_problems(dom.stderr) == []
    rendered = dom.stdout[dom.stdout.index("Checks against the engine") :]
    assert [VLLM, "P-EASY", *VLLM_ROW, "-"] in html_rows(rendered)
    assert "Request kinds" in dom.stdout


def test_the_pull_request_summary_shows_the_judgements_checks_and_kinds() -> None:
    records = check_records()
    calls = calls_of(records)
    text = render_pr_summary(
        cast(EndRecord, {"exit_status": 0, "verdicts": []}),
        [],
        ledger="runs/run.jsonl",
        report="`gpubench report`",
        summaries=summarize(calls),
        checks=engine_checks(calls, [OFF]),
    )
    checks = text[text.index("### Checks against the engine") :]
    assert markdown_row(checks, DRAFT, "P-EASY", *DRAFT_ROW)
    assert markdown_row(checks, VLLM, "P-EASY", *VLLM_ROW, "-")
    assert f"- ⚠ {TOKEN_LINE}" in checks
    kinds = text[text.index("### Request kinds") : text.index("### Checks against the engine")]
    assert markdown_row(kinds, DRAFT, "J-PERSON", "json_schema", "-", "2/3 schema valid")
    # The Markdown table is the terminal's, written as Markdown: the same rows.
    assert render_engine_checks(engine_checks(calls, [OFF]), markdown=True) in text


def test_a_session_writes_its_checks_into_the_pull_request_summary_and_the_exports(
    pytester: pytest.Pytester,
) -> None:
    """End to end: a run against the stand-in that miscounts; its summary file, its Markdown
    report and its CSV and JSON exports each show the mismatch."""
    with serving(FaultyOpenAIServer()) as url:
        pytester.makefile(
            ".yaml",
            prompts='prompts:\n  P-EASY: {intent: short, prompt: "MISCOUNT please", max_tokens: 4}\n',
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', runs: 3, "
            "phases: [warm]}\n",
        )
        pytester.makepyfile(
            test_bench="def test_generate(gpubench_case):\n    gpubench_case.run()\n"
        )
        result = pytester.runpytest("--force-load", "--gpubench-steadiness", "off")
    assert result.ret == 0
    line = (
        "TOKEN COUNTS: local:openai:m P-EASY: 3 of 3 warm calls streamed another count of "
        "tokens than the engine's usage (4 streamed, usage 7)"
    )
    (summary,) = (pytester.path / "runs").glob("*.summary.md")
    assert markdown_row(
        summary.read_text(encoding="utf-8"), "local:openai:m", "P-EASY", "3 of 3 differ"
    )
    assert f"- ⚠ {line}" in summary.read_text(encoding="utf-8")

    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    report = pytester.path / "report.md"
    assert main(["report", str(ledger), "-o", str(report)]) == 0
    assert f"- {line}" in report.read_text(encoding="utf-8")

    exported_csv, exported_json = pytester.path / "calls.csv", pytester.path / "run.json"
    assert (
        main(["export", str(ledger), "--csv", str(exported_csv), "--json", str(exported_json)]) == 0
    )
    with exported_csv.open(encoding="utf-8", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["phase"] == "warm"]
    assert [row["token_mismatch"] for row in rows] == ["True"] * 3
    assert [(row["client_chunks"], row["completion_tokens"]) for row in rows] == [("4", "7")] * 3
    (found,) = json.loads(exported_json.read_text(encoding="utf-8"))["engine_checks"]
    assert (found["cell_id"], found["token_checked"], found["token_mismatches"]) == (
        "local:openai:m",
        3,
        3,
    )


def test_the_exports_carry_the_kinds_and_checks_of_each_call(tmp_path: Path) -> None:
    ledger = ledgers.write(tmp_path / f"{RUN}.jsonl", check_records())
    exported_csv, exported_json = tmp_path / "calls.csv", tmp_path / "run.json"
    assert (
        main(["export", str(ledger), "--csv", str(exported_csv), "--json", str(exported_json)]) == 0
    )
    with exported_csv.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    draft = [row for row in rows if row["cell_id"] == DRAFT and row["prompt_id"] == "P-EASY"]
    assert [
        (r["token_mismatch"], r["prefix_cache_hit"], r["draft_tokens"], r["draft_accepted_tokens"])
        for r in draft
    ] == [("False", "True", "18", "15")] * 3
    vllm = [row for row in rows if row["cell_id"] == VLLM]
    assert {(r["token_mismatch"], r["prefix_cache_off"]) for r in vllm} == {("True", "True")}
    embedding = [row for row in rows if row["prompt_id"] == "E-PAIR"]
    assert [(r["kind"], r["inputs_per_sec"]) for r in embedding] == [
        ("embedding", "100.0"),
        ("embedding", "110.0"),
        ("embedding", "120.0"),
    ]
    schema = [row for row in rows if row["prompt_id"] == "J-PERSON"]
    assert [(r["kind"], r["schema_valid"], r["tool_call_valid"]) for r in schema] == [
        ("json_schema", "1", ""),
        ("json_schema", "1", ""),
        ("json_schema", "0", ""),
    ]
    # A chat call's record has no kind, and no figure of another kind: blank, never 0.
    assert {(r["kind"], r["inputs_per_sec"], r["schema_valid"]) for r in draft} == {("", "", "")}

    data = json.loads(exported_json.read_text(encoding="utf-8"))
    by_key = {(s["cell_id"], s["prompt_id"]): s for s in data["summaries"]}
    assert by_key[(DRAFT, "J-PERSON")]["warm_schema_valid_rate"] == pytest.approx(2 / 3)
    assert by_key[(DRAFT, "J-PERSON")]["kind"] == "json_schema"
    assert "warm_schema_valid_rate" not in by_key[(DRAFT, "P-EASY")]
    checks = {(c["cell_id"], c["prompt_id"]): c for c in data["engine_checks"]}
    assert checks[(DRAFT, "P-EASY")]["draft_acceptance"] == {
        "accepted": 45.0,
        "proposed": 54.0,
        "rate": pytest.approx(45 / 54),
    }
    assert checks[(VLLM, "P-EASY")]["unwanted_cache_hits"] == 3
    assert checks[(VLLM, "P-EASY")]["counters"] == {
        "preemptions": 3.0,
        "kv_cache_usage_peak": pytest.approx(0.45),
    }
    assert (OFF, "P-EASY") not in checks  # token_check: off: nothing checked


def test_the_prometheus_textfile_has_the_checks_and_the_valid_rates(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    ledger = ledgers.write(tmp_path / f"{RUN}.jsonl", check_records())
    textfile = tmp_path / "gpubench.prom"
    assert main(["export", str(ledger), "--prometheus", str(textfile)]) == 0
    families = {
        family.name: family
        for family in text_string_to_metric_families(textfile.read_text(encoding="utf-8"))
    }
    checks = {
        (s.labels["cell"], s.labels["prompt"], s.labels["check"]): s.value
        for s in families["gpubench_engine_check"].samples
    }
    assert checks[(VLLM, "P-EASY", "token_mismatches")] == 3
    assert checks[(VLLM, "P-EASY", "unwanted_cache_hits")] == 3
    assert checks[(VLLM, "P-EASY", "counter:preemptions")] == 3
    assert checks[(DRAFT, "P-EASY", "draft_acceptance_rate")] == pytest.approx(45 / 54)
    assert checks[(DRAFT, "P-EASY", "counter:prefix_cache_hits")] == 111
    assert not any(cell == OFF for cell, _, _ in checks)
    valid = {
        (s.labels["cell"], s.labels["prompt"], s.labels["metric"]): s.value
        for s in families["gpubench_warm_valid_rate"].samples
    }
    assert valid == {(DRAFT, "J-PERSON", "warm_schema_valid_rate"): pytest.approx(2 / 3)}
    warm = {
        (s.labels["prompt"], s.labels["metric"], s.labels["percentile"]): s.value
        for s in families["gpubench_warm"].samples
    }
    assert warm[("E-PAIR", "inputs_per_sec", "p50")] == 110


def test_the_ledgers_columns_count_what_the_judgement_counts(tmp_path: Path) -> None:
    """Random calls (failed, cold, without fields, counters in any order): the checks read
    from the ledger's columns, and from its cache, are the session's (records in memory)."""
    rng = random.Random(35)
    calls = []
    for index in range(600):
        fields: dict[str, Any] = {}
        if rng.random() < 0.8:
            fields["token_mismatch"] = rng.random() < 0.2
        if rng.random() < 0.7:
            fields["prefix_cache_hit"] = rng.random() < 0.5
        if rng.random() < 0.3:
            fields["prefix_cache_off"] = True
        if rng.random() < 0.4:
            proposed = rng.randrange(0, 20)
            fields.update(draft_tokens=proposed, draft_accepted_tokens=rng.randrange(0, 21))
        if rng.random() < 0.6:
            names = ["preemptions", "kv_cache_usage_peak", "prefix_cache_hits", "spec_drafts"]
            rng.shuffle(names)
            fields["engine_counters"] = {name: float(rng.randrange(5)) for name in names[:3]}
        if rng.random() < 0.5:
            fields.update(engine_wait_per_cpu=rng.random(), engine_cpus_filled=rng.random())
        record = warm(
            f"c{rng.randrange(4)}",
            f"P{rng.randrange(3)}",
            index,
            client_chunks=rng.randrange(1, 9),
            completion_tokens=rng.randrange(1, 9),
            **fields,
        )
        if rng.random() < 0.1:
            record.update(error="HTTP 500", finish_reason="error")
        if rng.random() < 0.1:
            record.update(phase="cold", cold_kind="restart")
        calls.append(record)
    end = {"type": "end", "verdicts": [], "cells": []}
    ledger = ledgers.write(tmp_path / "run.jsonl", [{"type": "meta"}, *calls, end])
    expected = engine_checks(calls, ["c3"])
    assert len(expected) == 12 and any(found.token_mismatches for found in expected)
    assert any(found.engine_wait is not None and found.cpus_filled for found in expected)
    assert read_ledger_frame(ledger).engine_checks(["c3"]) == expected
    assert ledger.with_name(ledger.name + ".columns").exists()
    assert read_ledger_frame(ledger).engine_checks(["c3"]) == expected  # from the cache
