"""Baseline files: round trip, stable bytes, clear errors for corrupt files, the update rules."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hypothesis_examples import examples

from pytest_gpubench.config.metrics import MEASURES, PERCENTILE_NAMES, sampled
from pytest_gpubench.core.errors import GpubenchError, key_path
from pytest_gpubench.results.baseline import (
    CellBaseline,
    Provenance,
    baseline_file_name,
    baseline_path,
    baseline_summaries,
    baselines_from_records,
    dumps_baseline,
    find_baseline,
    loads_baseline,
    read_baseline,
    read_baselines,
    read_summaries,
    write_baseline,
)
from pytest_gpubench.results.baseline_format import CorruptBaseline
from pytest_gpubench.results.baseline_update import update_baselines
from pytest_gpubench.results.metric import ALL_METRIC_NAMES
from pytest_gpubench.results.run_history import RunFigures
from pytest_gpubench.results.stats import PromptSummary, WarmSamples

RUN_ID = "5b1c1f43-58a3-4d5e-9d0e-2f3c8a0e4b11"
CELL = "pavilion:ollama:qwen3.5:0.8b"
OTHER = "local:llamacpp:tiny"


def call(
    cell_id: str,
    prompt_id: str,
    run_idx: int,
    ttft: float,
    *,
    phase: str = "warm",
    error: str | None = None,
) -> dict[str, Any]:
    return {
        "type": "call",
        "benchmark_run_id": RUN_ID,
        "cell_id": cell_id,
        "prompt_id": prompt_id,
        "prompt_sha256": f"sha-of-{prompt_id}",
        "phase": phase,
        "run_idx": run_idx,
        "cold_kind": "unload" if phase == "cold" else None,
        "first_delta_ms": None if error else ttft,
        "total_duration_ms": None if error else ttft * 8,
        "tokens_per_sec": None if error else 900 / ttft,
        "finish_reason": "error" if error else "stop",
        "error": error,
        "coalesced": False,
        "engine_tokens_per_sec": None if error else 1000 / ttft,
        "engine_prompt_ms": None if error else ttft / 3,
        "engine_total_ms": None if error else ttft * 7,
    }


def ledger(failures: int = 0) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [
        {
            "type": "meta",
            "benchmark_run_id": RUN_ID,
            "git_sha": "0123abc",
            "started_at_utc": "2025-06-01T10:00:00.000Z",
        },
        {
            "type": "cell",
            "cell_id": CELL,
            "engine_version": "0.12.3",
            "model_digest": "2ae6f6dd7a3d",
            "gpus": [{"name": "RTX 4090", "memory_total_mib": "24564"}],
        },
        {"type": "cell", "cell_id": OTHER, "engine_version": "b6000", "gpus": []},
    ]
    for prompt_id in ("P-MEDIUM", "P-EASY"):
        records.append(call(CELL, prompt_id, 0, 400.0, phase="cold"))
        records += [call(CELL, prompt_id, i, 20.0 + i * 0.37) for i in range(5)]
        records += [call(OTHER, prompt_id, i, 3.0 + i * 0.011) for i in range(20 - failures)]
        records += [call(OTHER, prompt_id, 20 + i, 0, error="HTTP 500") for i in range(failures)]
    records.append({"type": "skipped", "cell_id": "rented:openai:x", "reason": "no offers"})
    records.append({"type": "end", "verdicts": []})
    return records


def test_file_name_replaces_unsafe_characters_and_keeps_the_id_inside(tmp_path: Path) -> None:
    assert baseline_file_name(CELL) == "pavilion_ollama_qwen3.5_0.8b.json"
    assert baseline_file_name("local:openai:Qwen/Qwen3-0.6B") == "local_openai_Qwen_Qwen3-0.6B.json"
    (baseline,) = [b for b in baselines_from_records(ledger()) if b.cell_id == CELL]
    path = write_baseline(tmp_path, baseline)
    assert path == tmp_path / "pavilion_ollama_qwen3.5_0.8b.json"
    assert json.loads(path.read_text())["cell_id"] == CELL


def test_round_trip(tmp_path: Path) -> None:
    for baseline in baselines_from_records(ledger()):
        path = write_baseline(tmp_path, baseline)
        assert read_baseline(path) == baseline
    loaded = find_baseline(tmp_path, CELL)
    assert loaded is not None
    assert loaded.provenance == Provenance(
        benchmark_run_id=RUN_ID,
        git_sha="0123abc",
        engine_version="0.12.3",
        model_digest="2ae6f6dd7a3d",
        gpus=({"name": "RTX 4090", "memory_total_mib": "24564"},),
        date="2025-06-01T10:00:00.000Z",
    )
    easy = loaded.prompt("P-EASY")
    assert easy is not None
    assert easy.samples["first_delta_ms"] == (20.0, 20.37, 20.74, 21.11, 21.48)
    assert easy.prompt_sha256 == "sha-of-P-EASY" and easy.cold_first_delta_ms == 400.0
    assert [cell.cell_id for cell in read_baselines(tmp_path)] == [OTHER, CELL]


def test_stable_bytes_sorted_indented_with_final_newline(tmp_path: Path) -> None:
    records = ledger()
    (first, _) = baselines_from_records(records)
    (again, _) = baselines_from_records(list(reversed(records[:3])) + records[3:])
    text = dumps_baseline(first)
    assert text == dumps_baseline(again)
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"
    path = write_baseline(tmp_path, first)
    before = path.read_bytes()
    write_baseline(tmp_path, read_baseline(path))
    assert path.read_bytes() == before


summaries = st.builds(
    PromptSummary,
    cell_id=st.just(CELL),
    prompt_id=st.sampled_from(["P-EASY", "P-HARD"]),
    prompt_sha256=st.none() | st.text(min_size=1, max_size=8),
    n_cold=st.integers(0, 5),
    # Any percentile of any measure but a reasoning model's (written only where it reasoned).
    warm=st.fixed_dictionaries(
        {
            measure.name: st.fixed_dictionaries(
                {p: st.none() | st.floats(0, 1e9) for p in PERCENTILE_NAMES}
            )
            for measure in MEASURES
            if not measure.reasoning
        }
    ),
    warm_coalesced=st.integers(0, 100),
    samples=st.builds(
        WarmSamples,
        first_delta_ms=st.lists(st.floats(0, 1e9), max_size=5).map(tuple),
        decode_tokens_per_sec=st.lists(st.floats(0, 1e9), max_size=5).map(tuple),
        engine_tokens_per_sec=st.lists(st.floats(0, 1e9), max_size=5).map(tuple),
    ),
)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(summaries, max_size=2, unique_by=lambda s: s.prompt_id), st.text(max_size=10))
def test_any_summary_round_trips_exactly(prompts: list[PromptSummary], engine: str) -> None:
    baseline = CellBaseline(
        CELL,
        Provenance(engine_version=engine),
        tuple(sorted(prompts, key=lambda s: s.prompt_id)),
    )
    assert loads_baseline(dumps_baseline(baseline), "mem.json") == baseline


def test_corrupt_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "local_llamacpp_tiny.json"
    path.write_text('{"cell_id": "local:llamacpp:tiny", "prompts": {', encoding="utf-8")
    with pytest.raises(GpubenchError) as raised:
        read_baseline(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: corrupt baseline: not valid JSON (line 1")
    assert "--baseline-update" in message


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.pop("prompts"), "prompts: required key is missing"),
        (lambda d: d["prompts"]["P-EASY"]["warm"].pop("n"), "prompts.P-EASY.warm.n: required key"),
        (
            lambda d: d["prompts"]["P-EASY"]["samples"].update(first_delta_ms="fast"),
            "prompts.P-EASY.samples.first_delta_ms: expected a list of numbers",
        ),
        (
            lambda d: d["prompts"]["P-EASY"]["warm"]["first_delta_ms"].update(p50="12"),
            "prompts.P-EASY.warm.first_delta_ms.p50: expected a number, got str",
        ),
        (
            lambda d: d["prompts"]["P-EASY"]["warm"]["decode_tokens_per_sec"].pop("p90"),
            "prompts.P-EASY.warm.decode_tokens_per_sec.p90: required key is missing",
        ),
        (
            lambda d: d["prompts"]["P-EASY"]["samples"].pop("engine_prompt_ms"),
            "prompts.P-EASY.samples.engine_prompt_ms: required key is missing",
        ),
        (lambda d: d.update(cell_id=""), "cell_id: must be a non-empty string"),
        (lambda d: d["provenance"].update(gpus={}), "provenance.gpus: expected a list"),
    ],
)
def test_missing_or_wrong_keys_name_file_and_key(tmp_path: Path, edit: Any, expected: str) -> None:
    (baseline, _) = baselines_from_records(ledger())
    data = json.loads(dumps_baseline(baseline))
    edit(data)
    path = tmp_path / "cell.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(GpubenchError, match="corrupt baseline") as raised:
        read_baseline(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert expected in str(raised.value)


def _every_number_filled() -> dict[str, Any]:
    """A file of the current format as --baseline-update writes it, with every figure, sample
    and history entry the model holds given a number (the measures read from the table of
    config/metrics.py, not listed here)."""
    figures = {measure.name: dict.fromkeys(PERCENTILE_NAMES, 0.5) for measure in MEASURES}
    samples = WarmSamples(**{name: (0.5, 0.6) for name in sampled()})
    summary = PromptSummary(
        OTHER, "P-EASY", "ab", 1, 1, "restart", 0.5, 0.5, n_warm=2, n_warm_ok=2,
        warm=figures, samples=samples,
    )  # fmt: skip
    history = RunFigures("r0", "2026-11-24", 2, dict.fromkeys(ALL_METRIC_NAMES, 0.5), 0.5, 0.5)
    baseline = CellBaseline(
        OTHER, Provenance(max_model_len=4096), (summary,), {"P-EASY": (history, history)}
    )
    data: dict[str, Any] = json.loads(dumps_baseline(baseline))
    return data


EVERY_NUMBER = _every_number_filled()


def _number_paths(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    if isinstance(value, dict):
        return [p for key, inner in value.items() for p in _number_paths(inner, (*path, key))]
    if isinstance(value, list):
        return [
            p for index, inner in enumerate(value) for p in _number_paths(inner, (*path, index))
        ]
    return [path] if isinstance(value, int | float) and not isinstance(value, bool) else []


NUMBER_PATHS = _number_paths(EVERY_NUMBER)


def test_the_filled_file_holds_a_number_in_every_field_of_the_model() -> None:
    """The parametrization below covers every kind of number the format holds."""
    entry = EVERY_NUMBER["prompts"]["P-EASY"]
    assert all(value["p50"] == 0.5 for value in entry["warm"].values() if isinstance(value, dict))
    assert all(len(values) == 2 for values in entry["samples"].values())
    assert entry["history"][0]["figures"] and entry["history"][0]["cpu_pressure"] == 0.5
    assert len(NUMBER_PATHS) > 80


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["NaN", "Infinity"])
@pytest.mark.parametrize("where", NUMBER_PATHS, ids=key_path)
def test_nan_or_infinity_in_any_number_of_a_baseline_is_one_line_naming_the_key(
    tmp_path: Path, where: tuple[str | int, ...], value: float
) -> None:
    """Python's json reads NaN and Infinity; a baseline holding one in a history figure crashed
    the session (AttributeError in between_run_spread), and NaN in samples was read silently."""
    data = json.loads(json.dumps(EVERY_NUMBER))
    parent = data
    for step in where[:-1]:
        parent = parent[step]
    parent[where[-1]] = value
    path = tmp_path / "local_llamacpp_tiny.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(CorruptBaseline) as raised:
        read_baseline(path)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: corrupt baseline: {key_path(where)}: expected a "), message
    assert message.endswith("restore it with `git checkout -- <file>` or write it again with "
                            "--baseline-update")  # fmt: skip


def test_not_an_object_and_newer_format(tmp_path: Path) -> None:
    path = tmp_path / "cell.json"
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(GpubenchError, match="top level: expected an object"):
        read_baseline(path)
    path.write_text('{"format": 99}', encoding="utf-8")
    with pytest.raises(GpubenchError, match="format 99 is newer"):
        read_baseline(path)


def test_missing_baseline_is_none_and_colliding_names_are_refused(tmp_path: Path) -> None:
    assert find_baseline(tmp_path, CELL) is None
    assert baseline_summaries(tmp_path, [CELL]) == []
    baseline = CellBaseline("a:b", Provenance(), ())
    write_baseline(tmp_path, baseline)
    with pytest.raises(GpubenchError, match="holds the baseline of cell 'a:b', not 'a_b'"):
        write_baseline(tmp_path, CellBaseline("a_b", Provenance(), ()))


def test_a_cell_id_edited_in_its_file_is_a_corrupt_baseline_not_a_name_collision(
    tmp_path: Path,
) -> None:
    """A cell id that would be written to another file cannot have come from a cell sharing this
    file's name (make test-fast's fuzzing found '0local:llamacpp:tiny' in local_llamacpp_tiny.json
    named as a collision, telling the user to rename a cell that no other shared a name with):
    the file was edited. It is corrupt, and --baseline-update may write it again."""
    path = write_baseline(tmp_path, CellBaseline("a:b", Provenance(), ()))
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace('"a:b"', '"0a:b"'), encoding="utf-8")
    with pytest.raises(CorruptBaseline, match="corrupt baseline: cell_id: '0a:b' is not the cell"):
        find_baseline(tmp_path, "a:b")
    with pytest.raises(CorruptBaseline):
        write_baseline(tmp_path, CellBaseline("a:b", Provenance(), ()))
    write_baseline(tmp_path, CellBaseline("a:b", Provenance(), ()), replace_corrupt=True)
    found = find_baseline(tmp_path, "a:b")
    assert found is not None and found.cell_id == "a:b"


def test_update_writes_only_cells_that_pass_the_success_bar(tmp_path: Path) -> None:
    update = update_baselines(tmp_path, ledger(failures=2))
    assert update.written == {CELL: baseline_path(tmp_path, CELL)}
    assert update.refused == {
        OTHER: "warm success rate below 0.95: P-EASY 0.90 (18/20), P-MEDIUM 0.90 (18/20)",
        "rented:openai:x": "skipped: no offers",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pavilion_ollama_qwen3.5_0.8b.json"]
    lenient = update_baselines(tmp_path, ledger(failures=2), min_success_rate=0.9)
    assert set(lenient.written) == {CELL, OTHER}
    per_cell = update_baselines(tmp_path, ledger(failures=2), min_success_rate={OTHER: 0.5})
    assert set(per_cell.written) == {CELL, OTHER}


def test_update_refuses_a_cell_without_warm_calls(tmp_path: Path) -> None:
    cold_only = [r for r in ledger() if r.get("phase") != "warm" or r["cell_id"] != CELL]
    update = update_baselines(tmp_path, cold_only)
    assert update.refused[CELL] == (
        "no warm calls measured for P-EASY, P-MEDIUM (run the warm cases too)"
    )
    assert set(update.written) == {OTHER}


def test_load_summaries_from_a_baselines_dir_or_a_ledger(tmp_path: Path) -> None:
    records = ledger()
    update_baselines(tmp_path / "baselines", records)
    run = tmp_path / "run.jsonl"
    lines = [json.dumps(record) for record in records]
    run.write_text("\n".join(lines) + '\n{"type": "call", "cell', encoding="utf-8")
    from_dir = read_summaries(tmp_path / "baselines")
    from_ledger = read_summaries(run)
    assert from_dir == from_ledger
    assert len(from_ledger) == 4
    with pytest.raises(GpubenchError, match="no such ledger or baselines directory"):
        read_summaries(tmp_path / "nowhere.jsonl")


# A baseline as format 1 wrote it (before decode tokens/s, p90s and engine-side figures): its
# tokens/s is the old mean of per-call rates, under another definition.
FORMAT_1 = {
    "cell_id": OTHER,
    "format": 1,
    "prompts": {
        "P-EASY": {
            "cold": {"first_delta_ms": 410.0, "kind": "restart", "n": 1, "n_ok": 1,
                     "total_duration_ms": 480.0},
            "prompt_sha256": "sha-of-P-EASY",
            "samples": {"first_delta_ms": [3.0, 3.1, 3.2, 3.3, 3.4],
                        "tokens_per_sec": [31861.0, 7292.0, 7300.0, 7301.0, 7299.0],
                        "total_duration_ms": [24.0, 24.8, 25.6, 26.4, 27.2]},
            "warm": {"first_delta_ms": {"p50": 3.2, "p95": 3.38, "p99": 3.396},
                     "n": 5, "n_ok": 5, "success_rate": 1.0,
                     "tokens_per_sec_mean": 12210.6,
                     "total_duration_ms": {"p50": 25.6, "p95": 27.04, "p99": 27.168}},
        }
    },
    "provenance": {"benchmark_run_id": RUN_ID, "date": "2025-06-01T10:00:00.000Z",
                   "engine_version": "b6000", "git_sha": "0123abc", "gpus": [],
                   "model_digest": None},
}  # fmt: skip


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_a_baseline_of_a_pre_release_format_is_refused_and_replaced_by_baseline_update(
    tmp_path: Path, version: int
) -> None:
    """The first release reads one format (5). A file of a pre-release's (1 to 4, written
    between 2026-11-22 and 11-25) is one line naming the file and what to do, never figures read
    as unknown; --baseline-update replaces it with a file of the current format."""
    path = tmp_path / "local_llamacpp_tiny.json"
    path.write_text(json.dumps({**FORMAT_1, "format": version}, indent=2), encoding="utf-8")
    with pytest.raises(CorruptBaseline) as refused:
        read_baseline(path)
    assert str(refused.value) == (
        f"{path}: baseline format {version} was written by a pre-release of pytest-gpubench and "
        "is no longer read (the release reads format 5): write it again with `pytest "
        "--baseline-update`"
    )
    update = update_baselines(tmp_path, ledger())
    assert OTHER in update.replaced and str(path) in update.replaced[OTHER]
    rewritten = json.loads(path.read_text())
    assert rewritten["format"] == 5
    assert "tokens_per_sec_mean" not in rewritten["prompts"]["P-EASY"]["warm"]
    assert rewritten["prompts"]["P-EASY"]["warm"]["decode_tokens_per_sec"]["p50"] is not None


def test_the_engine_side_samples_are_kept_beside_the_clients(tmp_path: Path) -> None:
    (other, _) = baselines_from_records(ledger())  # sorted by cell id: local first
    path = write_baseline(tmp_path, other)
    stored = json.loads(path.read_text())["prompts"]["P-EASY"]
    assert set(stored["samples"]) == {
        "first_delta_ms", "total_duration_ms", "decode_tokens_per_sec",
        "engine_prompt_ms", "engine_tokens_per_sec", "engine_total_ms", "control_ms", "cpu_pressure",
    }  # fmt: skip
    assert len(stored["samples"]["engine_prompt_ms"]) == 20
    assert set(stored["warm"]["engine_tokens_per_sec"]) == {"p50", "p90", "p95", "p99"}
    assert stored["warm"]["coalesced"] == 0


# -- --baseline-update merges, refuses what can never be significant, replaces corrupt files ----


def only(records: list[dict[str, Any]], **wanted: str) -> list[dict[str, Any]]:
    """The ledger with the call records of other prompts or phases left out (-k, -m)."""
    return [
        r
        for r in records
        if r["type"] != "call" or all(r.get(key) == value for key, value in wanted.items())
    ]


def entry_bytes(path: Path, prompt_id: str) -> str:
    return json.dumps(json.loads(path.read_text())["prompts"][prompt_id], sort_keys=True)


def test_an_update_of_one_prompt_keeps_the_others_byte_identical(tmp_path: Path) -> None:
    update_baselines(tmp_path, ledger())
    path = baseline_path(tmp_path, CELL)
    medium_before, easy_before = entry_bytes(path, "P-MEDIUM"), entry_bytes(path, "P-EASY")
    faster = [
        {**r, "first_delta_ms": r["first_delta_ms"] / 2} if r["type"] == "call" else r
        for r in ledger()
    ]
    update = update_baselines(tmp_path, only(faster, prompt_id="P-EASY"))
    assert update.written == {CELL: path, OTHER: baseline_path(tmp_path, OTHER)}
    assert entry_bytes(path, "P-MEDIUM") == medium_before  # untouched, to the byte
    assert entry_bytes(path, "P-EASY") != easy_before
    stored = json.loads(path.read_text())["prompts"]
    assert stored["P-EASY"]["cold"]["first_delta_ms"] == 200.0  # this run's
    assert stored["P-MEDIUM"]["cold"]["first_delta_ms"] == 400.0  # kept


def test_a_warm_only_update_keeps_the_cold_figures_and_a_cold_only_one_the_warm(
    tmp_path: Path,
) -> None:
    update_baselines(tmp_path, ledger())
    path = baseline_path(tmp_path, CELL)
    changed = [
        {**r, "first_delta_ms": r["first_delta_ms"] * 3} if r["type"] == "call" else r
        for r in ledger()
    ]
    update_baselines(tmp_path, only(changed, phase="warm"))
    easy = json.loads(path.read_text())["prompts"]["P-EASY"]
    assert easy["cold"]["first_delta_ms"] == 400.0  # kept
    assert easy["warm"]["first_delta_ms"]["p50"] == pytest.approx(3 * 20.74)
    update = update_baselines(tmp_path, only(changed, phase="cold"))
    assert CELL in update.written and CELL not in update.refused
    easy = json.loads(path.read_text())["prompts"]["P-EASY"]
    assert easy["cold"]["first_delta_ms"] == 1200.0
    assert easy["warm"]["first_delta_ms"]["p50"] == pytest.approx(3 * 20.74)  # kept


def test_too_few_warm_samples_for_the_cells_runs_are_refused_per_prompt(tmp_path: Path) -> None:
    from pytest_gpubench.results.gate import too_few_samples

    assert too_few_samples(2, 5) is None  # smallest p = 1/C(7, 2) = 0.048 < 0.05
    assert too_few_samples(1, 5) == "1 against 5 (smallest possible p = 0.167 ≥ 0.05)"
    assert too_few_samples(3, 3) == "3 against 3 (smallest possible p = 0.05 ≥ 0.05)"
    # P-EASY measured once (as --smoke would), P-MEDIUM five times; the cell runs 5 later.
    records = [
        r
        for r in ledger()
        if r["type"] != "call"
        or r["prompt_id"] == "P-MEDIUM"
        or r["phase"] == "cold"
        or r["run_idx"] == 0
    ]
    update = update_baselines(
        tmp_path, records, future_runs={CELL: 5, OTHER: 20}, sample_check=too_few_samples
    )
    assert update.refused[CELL] == (
        "too few warm samples ever to be significant against the cell's runs: P-EASY 1 against "
        "5 (smallest possible p = 0.167 ≥ 0.05) (measure more warm runs: --gpubench-runs N)"
    )
    stored = read_baseline(update.written[CELL])
    assert [p.prompt_id for p in stored.prompts] == ["P-MEDIUM"]
    # One sample against 20 later ones can be significant: smallest p = 1/C(21, 1) = 0.048.
    assert OTHER in update.written and OTHER not in update.refused
    # A cell whose every prompt is refused writes nothing at all.
    smoke = [r for r in ledger() if r["type"] != "call" or r["run_idx"] == 0]
    nothing = update_baselines(tmp_path / "new", smoke, future_runs=5, sample_check=too_few_samples)
    assert nothing.written == {} and not (tmp_path / "new").exists()
    assert "P-EASY 1 against 5" in nothing.refused[CELL]
    assert "P-MEDIUM 1 against 5" in nothing.refused[CELL]


def test_setup_changes_are_named_and_unknown_facts_are_no_change() -> None:
    from pytest_gpubench.results.baseline import provenance_changes

    old = Provenance(
        engine_version="b4100", gpus=({"name": "RTX 4090"},), model_digest="sha256:" + "a" * 64
    )
    new = Provenance(
        engine_version="b4200", gpus=({"name": "A100"},), model_digest="sha256:" + "a" * 64
    )
    assert provenance_changes(old, new) == [
        "engine version b4100 → b4200",
        "GPU 1 × RTX 4090 → 1 × A100",
    ]
    assert provenance_changes(old, Provenance(gpus=old.gpus)) == []  # nothing known: no change
    vllm = Provenance(model_root="Qwen/Qwen3-0.6B", max_model_len=4096, system_fingerprint="fp1")
    assert provenance_changes(
        vllm, Provenance(model_root="Qwen/Qwen3-1.7B", max_model_len=8192)
    ) == [
        "model root Qwen/Qwen3-0.6B → Qwen/Qwen3-1.7B",
        "max model length 4096 → 8192",
    ]
    build = Provenance(engine_version="b1-0c1e570", system_fingerprint="b1-0c1e570")
    newer = Provenance(engine_version="b2-1d2f681", system_fingerprint="b2-1d2f681")
    assert provenance_changes(build, newer) == ["engine version b1-0c1e570 → b2-1d2f681"]
    digest = provenance_changes(
        Provenance(model_digest="sha256:" + "a" * 64), Provenance(model_digest="sha256:" + "b" * 64)
    )
    assert digest == ["model digest sha256:aaaaaaaaaaaa… → sha256:bbbbbbbbbbbb…"]


def with_engine(records: list[dict[str, Any]], version: str) -> list[dict[str, Any]]:
    return [
        {**r, "engine_version": version} if r["type"] == "cell" and r["cell_id"] == CELL else r
        for r in records
    ]


def test_another_setup_replaces_the_file_whole_or_not_at_all(tmp_path: Path) -> None:
    update_baselines(tmp_path, ledger())
    path = baseline_path(tmp_path, CELL)
    before = path.read_bytes()
    partial = update_baselines(tmp_path, only(with_engine(ledger(), "0.13.0"), prompt_id="P-EASY"))
    assert CELL not in partial.written and path.read_bytes() == before
    assert partial.refused[CELL] == (
        "this run's setup differs from the baseline's (engine version 0.12.3 → 0.13.0) and it "
        "did not measure P-MEDIUM cold, P-MEDIUM warm: a baseline never mixes two setups; ratify "
        "with a run of every prompt and phase"
    )
    whole = update_baselines(tmp_path, with_engine(ledger(), "0.13.0"))
    assert CELL in whole.written
    assert read_baseline(path).provenance.engine_version == "0.13.0"


def test_a_merge_keeps_facts_this_run_did_not_learn(tmp_path: Path) -> None:
    update_baselines(tmp_path, ledger())
    unknown = [
        {**r, "model_digest": None} if r["type"] == "cell" and r["cell_id"] == CELL else r
        for r in ledger()
    ]
    update_baselines(tmp_path, only(unknown, prompt_id="P-EASY"))
    assert read_baseline(baseline_path(tmp_path, CELL)).provenance.model_digest == "2ae6f6dd7a3d"


def test_a_stable_system_fingerprint_is_recorded_a_varying_one_is_not(tmp_path: Path) -> None:
    records = ledger()
    calls = [r for r in records if r["type"] == "call"]
    for call_record in calls:
        call_record["system_fingerprint"] = (
            "fp_44709d6fcb" if call_record["cell_id"] == CELL else (f"fp_{call_record['run_idx']}")
        )
    by_cell = {b.cell_id: b for b in baselines_from_records(records)}
    assert by_cell[CELL].provenance.system_fingerprint == "fp_44709d6fcb"
    assert by_cell[OTHER].provenance.system_fingerprint is None


def test_a_corrupt_file_is_replaced_and_said_so(tmp_path: Path) -> None:
    path = baseline_path(tmp_path, CELL)
    path.write_text('{"format": 3, "cell_id": "', encoding="utf-8")
    with pytest.raises(GpubenchError, match="corrupt baseline"):
        find_baseline(tmp_path, CELL)
    update = update_baselines(tmp_path, ledger())
    assert update.written[CELL] == path
    assert update.replaced[CELL].startswith(f"{path}: corrupt baseline: not valid JSON")
    assert find_baseline(tmp_path, CELL) is not None
    # A file of a newer format is not corrupt: it is never replaced.
    path.write_text('{"format": 99}', encoding="utf-8")
    with pytest.raises(GpubenchError, match="newer than this pytest-gpubench understands"):
        update_baselines(tmp_path, ledger())


def test_a_file_that_cannot_be_written_is_reported_and_the_others_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk for one file (tests run as root here, so a read-only folder blocks nothing):
    the rename that would put it in place fails with ENOSPC."""
    update_baselines(tmp_path, ledger())
    blocked = baseline_path(tmp_path, CELL)
    blocked.unlink()
    replace = os.replace

    def full_disk_for_blocked(source: Any, target: Any) -> None:
        if Path(target) == blocked:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        replace(source, target)

    monkeypatch.setattr(os, "replace", full_disk_for_blocked)
    update = update_baselines(tmp_path, ledger())
    assert set(update.written) == {OTHER}
    assert update.failed[CELL].startswith(f"{blocked}: cannot write baseline: ")
    assert not blocked.exists() and not list(tmp_path.glob(".*.tmp"))  # nothing half-written


def test_every_figure_and_sample_of_a_summary_round_trips(tmp_path: Path) -> None:
    """Each warm percentile and sample list has its place in the file's model: a summary with
    every field set reads back equal (a metric missing from the model would read back None)."""
    numbered = {
        measure.name: {p: float(index) + 0.5 + n for n, p in enumerate(PERCENTILE_NAMES)}
        for index, measure in enumerate(MEASURES)
    }
    samples = WarmSamples(**{name: (float(i), float(i) + 1) for i, name in enumerate(sampled())})
    summary = PromptSummary(
        CELL, "P-EASY", "sha", 1, 1, "unload", 400.0, 900.0, 20, 19,
        warm=numbered, warm_coalesced=3, samples=samples,
    )  # fmt: skip
    baseline = CellBaseline(CELL, Provenance(max_model_len=4096, gpus=({"name": "A"},)), (summary,))
    path = write_baseline(tmp_path, baseline)
    assert read_baseline(path) == baseline
    stored = json.loads(path.read_text())["prompts"]["P-EASY"]
    assert stored["warm"]["success_rate"] == 0.95 and stored["history"] == []
