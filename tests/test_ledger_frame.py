"""The columnar ledger reader gives the summaries and the Markdown document that the reader of
dicts gives, tolerates what ledger.iter_records tolerates, and names a bad line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support import ledgers

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.reports.frame import frame_of_records, read_ledger_frame
from pytest_gpubench.reports.markdown import render_document, render_markdown
from pytest_gpubench.results.stats import summarize


def odd_records() -> list[dict[str, object]]:
    """A real-shaped run plus the oddities of older ledgers: no `coalesced` (an older decode
    definition), a missing prompt, a number written as text, a coalesced call."""
    records = ledgers.run_records("run-odd", seed=3)
    calls = [r for r in records if r["type"] == "call"]
    del calls[5]["coalesced"]
    del calls[6]["prompt_id"]
    calls[7]["first_delta_ms"] = "12.5"
    calls[8]["coalesced"] = True
    calls[8]["tokens_per_sec"] = None
    calls[9]["unknown_field"] = {"nested": [1, 2]}
    records.insert(3, {"type": "load_summary", "something": "new"})
    return records


def test_same_summaries_and_document_as_the_dict_reader(tmp_path: Path) -> None:
    path = ledgers.write(tmp_path / "run.jsonl", odd_records())
    records = read_ledger(path)
    data = read_ledger_frame(path)
    assert data.summaries() == summarize(records)
    assert render_document(data.others, data.summaries()) == render_markdown(records)
    assert frame_of_records(records).summaries() == summarize(records)
    assert data.meta["benchmark_run_id"] == "run-odd" and data.end["type"] == "end"
    assert len(data.of_type("sample")) == 16
    assert len(data.calls) == len([r for r in records if r["type"] == "call"])


def test_a_truncated_last_line_is_left_out(tmp_path: Path) -> None:
    path = ledgers.write(tmp_path / "run.jsonl", ledgers.run_records("r", samples=False)[:-1])
    with path.open("a") as ledger:
        ledger.write('{"type":"call","cell_id":"x","first_del')
    data = read_ledger_frame(path)
    assert data.summaries() == summarize(read_ledger(path))
    assert "x" not in set(data.calls["cell_id"])


def test_a_bad_line_in_the_middle_is_named(tmp_path: Path) -> None:
    records = ledgers.run_records("r", samples=False)
    path = ledgers.write(tmp_path / "run.jsonl", records[:3])
    with path.open("a") as ledger:
        ledger.write("not json\n" + json.dumps(records[3]) + "\n")
    with pytest.raises(GpubenchError, match=r"run.jsonl: line 4 is not valid JSON"):
        read_ledger_frame(path)


def test_an_unreadable_ledger_is_named(tmp_path: Path) -> None:
    with pytest.raises(GpubenchError, match=r"nope\.jsonl: cannot read ledger"):
        read_ledger_frame(tmp_path / "nope.jsonl")


def test_chunks_join_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are turned into columns a chunk at a time: the categories of later chunks (a cell
    first seen late) keep their codes."""
    import pytest_gpubench.reports.frame as ledger_frame

    monkeypatch.setattr(ledger_frame, "CHUNK_ROWS", 7)
    records = odd_records() + ledgers.run_records("r2", seed=4, cells=("late:llamacpp:x",))
    path = ledgers.write(tmp_path / "run.jsonl", records)
    assert read_ledger_frame(path).summaries() == summarize(read_ledger(path))


def test_the_columns_are_cached_beside_the_ledger_while_it_is_unchanged(tmp_path: Path) -> None:
    from pytest_gpubench.reports.frame import cache_path

    records = odd_records()
    path = ledgers.write(tmp_path / "run.jsonl", records)
    first = read_ledger_frame(path)
    cache = cache_path(path)
    assert cache.name == "run.jsonl.columns" and cache.exists()
    second = read_ledger_frame(path)  # from the cache
    assert second.summaries() == first.summaries() == summarize(records)
    assert second.others == first.others
    # Appended to (a run goes on): the ledger is read again, the cache rewritten.
    more = ledgers.run_records("run-more", seed=9, cells=("new:llamacpp:x",), samples=False)
    with path.open("a") as ledger:
        ledger.writelines(json.dumps(record) + "\n" for record in more)
    third = read_ledger_frame(path)
    assert third.summaries() == summarize(records + more)
    assert read_ledger_frame(path).summaries() == third.summaries()
    # A cache that cannot be read is ignored.
    cache.write_bytes(b"not an npz")
    assert read_ledger_frame(path).summaries() == third.summaries()


def test_no_cache_for_a_ledger_still_being_written(tmp_path: Path) -> None:
    from pytest_gpubench.reports.frame import cache_path

    path = ledgers.write(tmp_path / "run.jsonl", ledgers.run_records("r", samples=False))
    with path.open("a") as ledger:
        ledger.write('{"type":"call","cell_id":"x"')
    read_ledger_frame(path)
    assert not cache_path(path).exists()


@pytest.fixture
def in_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ledger read in byte ranges by forked processes, as a large one is."""
    import pytest_gpubench.reports.frame as ledger_frame

    monkeypatch.setattr(ledger_frame, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(ledger_frame, "MAX_WORKERS", 3)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)


@pytest.mark.usefixtures("in_ranges")
def test_read_in_ranges_gives_the_same(tmp_path: Path) -> None:
    records = odd_records() + ledgers.run_records("r2", seed=4, cells=("late:llamacpp:x",))
    path = ledgers.write(tmp_path / "run.jsonl", records)
    data = read_ledger_frame(path)
    assert data.summaries() == summarize(records)
    assert data.others == [r for r in records if r["type"] != "call"]
    assert render_document(data.others, data.summaries()) == render_markdown(records)


@pytest.mark.usefixtures("in_ranges")
def test_read_in_ranges_keeps_the_rules_for_bad_lines(tmp_path: Path) -> None:
    records = ledgers.run_records("r", samples=False)
    path = ledgers.write(tmp_path / "run.jsonl", records)
    with path.open("a") as ledger:
        ledger.write('{"type":"call","cell_id":"x","first_del')
    assert read_ledger_frame(path).summaries() == summarize(records)

    # A bad line early on, with whole records after it (in later ranges): named by its number.
    path = ledgers.write(tmp_path / "bad.jsonl", records[:2])
    with path.open("a") as ledger:
        ledger.write("\nnot json\n" + "".join(json.dumps(r) + "\n" for r in records[2:]))
    with pytest.raises(GpubenchError, match=r"bad\.jsonl: line 4 is not valid JSON"):
        read_ledger_frame(path)


def telemetry_records(seed: int = 5) -> list[dict[str, object]]:
    """A run whose warm calls carry the per-call resource figures, some missing, two energy
    sources in one group, and a failed call that must not count."""
    import random

    rng = random.Random(seed)
    records = ledgers.run_records("run-telemetry", seed=seed, warm=9)
    calls = [r for r in records if r["type"] == "call"]
    for number, call in enumerate(calls):
        for name in (
            "gpu_peak_memory_used_mib", "engine_gpu_memory_peak_mib", "engine_peak_rss_mib",
            "gpu_utilization_mean_pct", "gpu_power_mean_w", "gpu_energy_j_per_token",
            "gpu_tokens_per_j", "engine_cpu_s", "engine_cpu_s_per_token",
        ):  # fmt: skip
            call[name] = None if rng.random() < 0.2 else round(rng.uniform(1, 900), 3)
        call["gpu_energy_source"] = ("nvml_counter", "power_integral", None)[number % 3]
    calls[4]["error"] = "boom"
    calls[4]["engine_peak_rss_mib"] = 1e9
    return records


def test_telemetry_from_columns_is_the_records_telemetry(tmp_path: Path) -> None:
    """The columns' telemetry summaries (grouped on the frame) equal those of the call records
    (telemetry.aggregate.telemetry_summaries), read from the ledger and from its cache."""
    from pytest_gpubench.telemetry.aggregate import telemetry_summaries

    records = telemetry_records()
    expected = telemetry_summaries(records)
    assert expected and any(s.gpu_energy_source == "nvml_counter+power_integral" for s in expected)
    assert frame_of_records(records).telemetry() == expected
    path = ledgers.write(tmp_path / "run.jsonl", records)
    assert read_ledger_frame(path).telemetry() == expected  # parsed, then cached
    assert read_ledger_frame(path).telemetry() == expected  # from the cache
