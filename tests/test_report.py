"""Reports: the terminal summary table, the deterministic Markdown document, run comparisons."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path
from typing import Any, cast

import pytest

from pytest_gpubench.cli.judge_commands import compare_command
from pytest_gpubench.cli.main import main
from pytest_gpubench.ledger.schema import LoadRecord
from pytest_gpubench.reports.comparison import render_comparison
from pytest_gpubench.reports.frame import frame_of_records
from pytest_gpubench.reports.html import render_html
from pytest_gpubench.reports.load_tables import render_load_table
from pytest_gpubench.reports.markdown import render_markdown
from pytest_gpubench.reports.terminal import render_summary, summary_rows
from pytest_gpubench.results.baseline_update import update_baselines
from pytest_gpubench.results.gate import Verdict, compare, judge
from pytest_gpubench.results.stats import summarize

RUN_ID = "9f0e3c1a-2b4d-4c6e-8f00-112233445566"
TINY = "local:llamacpp:tiny"
OLLAMA = "pavilion:ollama:qwen3.5:0.8b"


def call(
    cell_id: str, prompt_id: str, phase: str, run_idx: int, ttft: float, error: str | None = None
) -> dict[str, Any]:
    return {
        "type": "call",
        "benchmark_run_id": RUN_ID,
        "cell_id": cell_id,
        "prompt_id": prompt_id,
        "prompt_sha256": f"sha-{prompt_id}",
        "phase": phase,
        "run_idx": run_idx,
        "cold_kind": "restart" if phase == "cold" else None,
        "first_delta_ms": None if error else ttft,
        "total_duration_ms": None if error else ttft * 5,
        "tokens_per_sec": None if error else 2000 / ttft,
        "finish_reason": "error" if error else "length",
        "error": error,
        "inter_chunk_ms": [0.5, 0.7],
        "engine_timings": {"prompt_ms": 0.4},
        "coalesced": False,
        "engine_tokens_per_sec": None if error else 2100 / ttft,
    }


def ledger(slowdown: float = 1.0, failures: int = 1) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [
        {
            "type": "meta",
            "benchmark_run_id": RUN_ID,
            "git_sha": "c0ffee0",
            "git_dirty": False,
            "git_dirty_files": [],
            "harness_version": "1",
            "started_at_utc": "2025-06-01T10:00:00.000Z",
            "host": "bench-1",
            "platform": "Linux-6.8",
            "load_avg_start": 0.31,
            "env": {"CUDA_VISIBLE_DEVICES": "0"},
            "python_version": "3.11.9",
            "pytest_version": "8.3.3",
            "plugin_version": "0.1.0",
            "command_line": ["pytest", "benchmarks/"],
        }
    ]
    for cell_id, engine, version, gpus in (
        (TINY, "llamacpp", "b6000", []),
        (OLLAMA, "ollama", "0.12.3", [{"name": "NVIDIA RTX 4090", "memory.total": "24564"}]),
    ):
        records.append(
            {
                "type": "cell",
                "cell_id": cell_id,
                "engine": engine,
                "model": cell_id.split(":", 2)[2],
                "engine_version": version,
                "model_digest": "2ae6f6dd7a3d",
                "gpus": gpus,
            }
        )
        for prompt_id in ("P-MEDIUM", "P-EASY", "P-HARD"):
            records.append(call(cell_id, prompt_id, "cold", 0, 300.0))
            records += [
                call(cell_id, prompt_id, "warm", i, (10 + i * 0.1) * slowdown) for i in range(10)
            ]
    records += [call(TINY, "P-EASY", "warm", 10 + i, 0, error="HTTP 500") for i in range(failures)]
    records.append({"type": "skipped", "cell_id": "rented:openai:x", "reason": "no offers"})
    records.append(
        {
            "type": "end",
            "benchmark_run_id": RUN_ID,
            "finished_at_utc": "2025-06-01T10:05:00.000Z",
            "load_avg_end": 0.52,
            "verdicts": [],
        }
    )
    return records


def write_ledger(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_markdown_is_byte_identical_for_the_same_ledger() -> None:
    records = ledger()
    first = render_markdown(records)
    assert render_markdown(records) == first
    calls = [r for r in records if r["type"] == "call"]
    random.Random(7).shuffle(calls)
    shuffled = [records[0], *[r for r in records if r["type"] == "cell"][::-1], *calls]
    shuffled += [r for r in records if r["type"] in ("skipped", "end")]
    assert render_markdown(shuffled) == first
    assert first.endswith("\n") and not first.endswith("\n\n")


def test_markdown_layout_summary_then_cold_and_warm_per_cell() -> None:
    text = render_markdown(ledger())
    lines = text.splitlines()
    assert lines[0] == f"# Benchmark run {RUN_ID}"
    assert "- git: `c0ffee0`" in lines
    assert "- finished (UTC): 2025-06-01T10:05:00.000Z" in lines
    assert "- environment: `CUDA_VISIBLE_DEVICES=0`" in lines
    headings = [line for line in lines if line.startswith("#")]
    assert headings == [
        f"# Benchmark run {RUN_ID}",
        "## Warm TTFT p50 (ms)",
        f"## {TINY}",
        "### Cold",
        "### Warm",
        f"## {OLLAMA}",
        "### Cold",
        "### Warm",
        "## rented:openai:x",
        "### Skipped",
    ]
    summary = text.split("## Warm TTFT p50 (ms)\n\n")[1].split("\n\n")[0].splitlines()
    assert [cell.strip() for cell in summary[0].strip("|").split("|")] == [
        "cell",
        "P-EASY",
        "P-HARD",
        "P-MEDIUM",
    ]
    assert summary[2].startswith(f"| {TINY}") and "10.45" in summary[2]
    assert "- engine: ollama `0.12.3`" in lines
    assert "- GPUs: 1 × NVIDIA RTX 4090 (24564 MiB)" in lines
    assert "- GPUs: no GPU" in lines  # the tiny cell's node answered with an empty inventory
    assert "- no offers (1×)" in lines
    tiny_warm = text.split(f"## {TINY}")[1].split("### Warm")[1]
    easy = next(line for line in tiny_warm.splitlines() if line.startswith("| P-EASY"))
    assert [cell.strip() for cell in easy.strip("|").split("|")][:3] == ["P-EASY", "11", "10"]


def test_markdown_of_a_ledger_with_verdicts_has_a_gate_section() -> None:
    records = ledger(slowdown=2.0)
    verdicts = compare(summarize(ledger()), summarize(records))
    records[-1]["verdicts"] = [verdict.to_record() for verdict in verdicts]
    text = render_markdown(records)
    gate = text.split("## Regression gate\n\n")[1]
    assert "| regression |" in gate
    assert f"- REGRESSION: {TINY} P-EASY: warm TTFT p50 +100.0%" in gate


def test_markdown_of_an_empty_or_truncated_run() -> None:
    text = render_markdown([{"type": "meta", "benchmark_run_id": RUN_ID}])
    assert "No calls were measured." in text
    assert "- finished (UTC): -" in text


def test_terminal_summary_has_one_row_per_cell_and_prompt() -> None:
    old = summarize(ledger())
    new = summarize(ledger(slowdown=2.0))
    verdicts = compare(old, new)
    rows = summary_rows(new, verdicts)
    assert [(row[0], row[1]) for row in rows] == [
        (TINY, "P-EASY"),
        (TINY, "P-HARD"),
        (TINY, "P-MEDIUM"),
        (OLLAMA, "P-EASY"),
        (OLLAMA, "P-HARD"),
        (OLLAMA, "P-MEDIUM"),
    ]
    assert rows[0][2:] == [
        "20.90",
        "104.50",
        "95.7",  # the median decode rate, not the mean of the per-call rates
        "300.00",  # the first cold call: TTFT and total
        "1500.00",
        "0",
        "10/11",
        "+100.0% / +100.0% / -50.0%",
        "≥ +4.1%",  # the smallest TTFT change these samples could show
        "regression",
    ]
    text = render_summary(new, verdicts)
    header = text.splitlines()[0].split()
    assert header[:3] == ["cell", "prompt", "TTFT"] and header[-1] == "verdict"
    assert f"REGRESSION: {TINY} P-EASY: warm success rate 0.91 (10/11) is below 0.95" in text


def test_baseline_update_table_says_accepted_where_it_ratifies_a_regression() -> None:
    """--baseline-update ratifies: its table called what it accepted `regression` (issue 37),
    beside notes that say `ACCEPTED (regression)`. An A/B regression, which no update
    ratifies, stands; a win stays a win."""
    old = summarize(ledger())
    new = summarize(ledger(slowdown=2.0))
    verdicts = compare(old, new)
    assert summary_rows(new, verdicts)[0][-1] == "regression"
    rows = summary_rows(new, verdicts, accepted=True)
    assert [row[-1] for row in rows] == ["accepted"] * 6
    text = render_summary(new, verdicts, accepted=True)
    assert not [line for line in text.splitlines() if line.rstrip().endswith("regression")]
    assert f"ACCEPTED (regression): {TINY} P-EASY: warm TTFT p50 +100.0%" in text
    ab = dataclasses.replace(verdicts[0], reference="local:llamacpp:reference")
    assert summary_rows(new, [ab], accepted=True)[0][-1] == "regression"
    faster = compare(summarize(ledger(slowdown=2.0)), old)
    assert "win" in [row[-1] for row in summary_rows(old, faster, accepted=True)]


def test_terminal_summary_without_baselines_or_warm_calls() -> None:
    cold_only = [r for r in ledger() if r.get("phase") != "warm"]
    summaries = summarize(cold_only)
    rows = summary_rows(summaries, [v for s in summaries for v in judge(s, None)])
    assert rows[0][2:] == ["-", "-", "-", "300.00", "1500.00", "0", "-", "-", "-", "-"]
    fresh = summarize(ledger())
    rows = summary_rows(fresh, [v for s in fresh for v in judge(s, None)])
    assert {row[-1] for row in rows} == {"new"}
    assert render_summary([], []) == "no calls measured"


def test_comparison_table_and_verdict_records_round_trip() -> None:
    verdicts = compare(summarize(ledger()), summarize(ledger(slowdown=0.5)))
    text = render_comparison(verdicts)
    assert "TTFT p50 ms" in text and "win" in text
    assert "WIN: pavilion:ollama:qwen3.5:0.8b P-HARD: warm TTFT p50 -50.0%" in text
    assert [Verdict.from_record(v.to_record()) for v in verdicts] == verdicts
    assert Verdict.from_record({"verdict": "maybe"}) is None
    assert render_comparison([]).startswith("nothing to compare")


def test_compare_command_exits_6_on_regression(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = write_ledger(tmp_path / "old.jsonl", ledger(failures=0))
    new = write_ledger(tmp_path / "new.jsonl", ledger(slowdown=2.0, failures=0))
    assert compare_command(old, new) == 6
    assert "regression" in capsys.readouterr().out
    update_baselines(tmp_path / "baselines", ledger(failures=0))
    assert compare_command(tmp_path / "baselines", old) == 0
    assert main(["compare", str(tmp_path / "baselines"), str(new)]) == 6


def test_report_command_writes_the_markdown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_ledger(tmp_path / "run.jsonl", ledger())
    with path.open("a", encoding="utf-8") as truncated:
        truncated.write('{"type": "call", "cell_id": "local:ll')
    output = tmp_path / "BASELINE.md"
    assert main(["report", str(path), "-o", str(output)]) == 0
    assert output.read_text(encoding="utf-8") == render_markdown(ledger())
    assert main(["report", str(path)]) == 0
    assert capsys.readouterr().out.endswith(render_markdown(ledger()))


def test_odd_gpu_entries_in_an_old_or_edited_ledger_do_not_break_the_report() -> None:
    from pytest_gpubench.targets.gpu import gpu_summary

    assert gpu_summary([{"name": "A"}, {"name": None}, {}]) == "1 × A, 2 × GPU"
    records = ledger()
    cell = next(r for r in records if r.get("type") == "cell")
    cell["gpus"] = [{"name": "A100", "memory.total": 81920}, "H100", {"name": None}]
    text = render_markdown(records)
    assert "- GPUs: 1 × A100 (81920 MiB), 1 × GPU, 1 × H100" in text.splitlines()


def test_the_mean_of_per_call_rates_is_gone_from_every_report() -> None:
    old, new = summarize(ledger()), summarize(ledger(slowdown=2.0))
    verdicts = compare(old, new)
    for text in (
        render_summary(new, verdicts),
        render_comparison(verdicts),
        render_comparison(verdicts, markdown=True),
        render_markdown(ledger()),
    ):
        assert "mean" not in text
        assert "decode tok/s p50" in text
    warm_header = next(line for line in render_markdown(ledger()).splitlines() if "TPOT" in line)
    assert "engine tok/s p50" in warm_header and "coalesced" in warm_header


def test_an_incomparable_baseline_is_shown_and_marked_red_unless_ratified() -> None:
    from pytest_gpubench.reports.terminal import gate_lines

    records = ledger()
    summaries = summarize(records)
    changes = {s.cell_id: "engine version b4100 → b4200" for s in summaries}
    verdicts = compare(summaries, summaries, changed_setups=changes)
    assert {v.verdict for v in verdicts} == {"incomparable"}
    lines = gate_lines(
        summaries,
        verdicts,
        baseline_notes=[],
        gate_error=None,
        baseline_update=False,
        baselines_dir=Path("baselines"),
    )
    text = "\n".join(line.text for line in lines)
    assert "INCOMPARABLE: " in text and "(engine version b4100 → b4200)" in text
    assert lines[-1].red and lines[-1].text.startswith("gpubench: the baselines of ")
    ratifying = gate_lines(
        summaries,
        verdicts,
        baseline_notes=[],
        gate_error=None,
        baseline_update=True,
        baselines_dir=Path("baselines"),
    )
    assert not any(line.red for line in ratifying)
    assert "ACCEPTED (incomparable): " in ratifying[0].text


def test_markdown_says_what_identifies_a_model_without_a_digest() -> None:
    cell: dict[str, Any] = {
        "type": "cell",
        "cell_id": "local:openai:qwen",
        "engine": "openai",
        "model": "qwen",
        "model_digest": None,
        "model_identity": "name and root",
        "model_root": "Qwen/Qwen3-0.6B",
        "max_model_len": 4096,
        "gpus": [],
    }
    text = render_markdown([cell])
    assert (
        "- model: qwen (digest -, identity: name and root, root `Qwen/Qwen3-0.6B`, "
        "max model length 4096)"
    ) in text


def test_a_cold_case_that_ran_warm_is_labelled_in_the_cold_columns() -> None:
    """An `openai` endpoint cannot unload its model: its cold cases run warm (`cold_kind:
    process_warm`), and their TTFT must not read as a cold start."""
    records = [
        {**call(OLLAMA, "P-EASY", "cold", 0, 40.0), "cold_kind": "process_warm"},
        call(OLLAMA, "P-EASY", "warm", 0, 40.0),
        call(TINY, "P-EASY", "cold", 0, 900.0),
        call(TINY, "P-EASY", "warm", 0, 40.0),
    ]
    summaries = summarize(records)
    rows = {row[0]: row for row in summary_rows(summaries, [])}
    assert rows[OLLAMA][5:7] == ["40.00 (ran warm)", "200.00 (ran warm)"]
    assert rows[TINY][5:7] == ["900.00", "4500.00"]
    assert "ran warm" in render_summary(summaries, [])


def test_process_warm_is_said_in_words_in_the_terminal_markdown_and_html() -> None:
    """`process_warm` is the ledger's value, jargon in a report (issue 37): the terminal says
    what `(ran warm)` means, the Markdown and HTML cold tables say it in words; the ledger's
    field keeps its value."""
    records: list[dict[str, Any]] = [
        {"type": "meta", "benchmark_run_id": RUN_ID, "git_sha": "c0ffee0"},
        {**call(OLLAMA, "P-EASY", "cold", 0, 40.0), "cold_kind": "process_warm"},
        call(OLLAMA, "P-EASY", "warm", 0, 40.0),
        call(TINY, "P-EASY", "cold", 0, 900.0),
        {"type": "end", "verdicts": []},
    ]
    words = "no true cold start: the engine could not unload its model, so the call ran warm"
    terminal = render_summary(summarize(records), [])
    assert f"(ran warm): {words}" in terminal.splitlines()
    markdown = render_markdown(records)
    assert re.search(rf"^\| P-EASY +\| {words} +\|", markdown, flags=re.M), markdown
    assert re.search(r"^\| P-EASY +\| restart +\|", markdown, flags=re.M), markdown
    assert "process_warm" not in terminal + markdown
    page = render_html(frame_of_records(records))
    assert f"<td>{words}</td>" in page and "process_warm" not in page
    assert records[1]["cold_kind"] == "process_warm"


def test_the_load_table_shows_prefix_cache_and_first_answer_only_where_measured() -> None:
    """A `prefix:` point's cache hit rate and a reasoning point's first answer sit beside the
    TTFT; a plain point's table has neither column."""
    plain = cast(
        LoadRecord, {"prompt_id": "P", "load_point": "c1", "valid": True, "ttft_ms_p50": 10.0}
    )
    assert "prefix cache" not in render_load_table([plain])
    assert "first answer" not in render_load_table([plain])
    shared = cast(LoadRecord, {**plain, "load_point": "c4", "prefix_cache_hit_rate": 0.8125})
    unique = cast(LoadRecord, {**plain, "load_point": "c4-unique", "prefix_cache_hit_rate": 0.0})
    thinking = cast(
        LoadRecord,
        {
            **plain,
            "load_point": "c2",
            "first_answer_ms_p50": 250.0,
            "first_answer_ms_p99": 300.0,
            "reasoning_tokens_p50": 40.0,
        },
    )
    lines = render_load_table([shared, unique, thinking]).splitlines()
    header = [name.strip() for name in lines[0].split("  ") if name.strip()]
    assert header[5:9] == [
        "TTFT p50 / p99 ms",
        "prefix cache hit",
        "first answer p50 / p99 ms",
        "reasoning tok p50",
    ]
    rows = {line.split()[1]: line for line in lines[2:]}
    assert "81.2%" in rows["c4"] and "0.0%" in rows["c4-unique"]
    assert "250.00 / 300.00" in rows["c2"] and rows["c2"].split()[-1] == "ok"
