"""The columnar cache written as the ledger is written (reports/frame_cache.py, the ledger's
observer): frames added while the run goes hold what a fresh read of the ledger gives; a run
killed before its end leaves frames that still serve the lines they hold; a frame the ledger no
longer matches is never used; `gpubench merge` leaves the merged ledger's cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import ledgers

from pytest_gpubench.cli.main import main
from pytest_gpubench.ledger.writer import Ledger, read_ledger
from pytest_gpubench.reports import frame_cache
from pytest_gpubench.reports.frame import (
    cache_path,
    load_cache,
    read_cached,
    read_ledger_frame,
)
from pytest_gpubench.reports.frame_cache import ColumnCacheWriter
from pytest_gpubench.results.stats import summarize


def records() -> list[dict[str, Any]]:
    """Two runs' records in one ledger, as a session of two cells writes them (about 140)."""
    first = ledgers.run_records("run-a", seed=1, warm=12)
    second = ledgers.run_records("run-b", seed=2, warm=12, cells=("late:llamacpp:x",))
    return [*first[:-1], *second[1:]]


def write_as_a_session(path: Path, written: list[dict[str, Any]], *, close: bool = True) -> None:
    """Through the session's own writer and observer, a frame every 16 lines."""
    ledger = Ledger(path, observer=ColumnCacheWriter(path, frame_lines=16, small_ledger_lines=8))
    for record in written:
        ledger.append(record)
    if close:
        ledger.close()


def fresh_read(path: Path) -> Any:
    """The ledger read with no cache (moved aside, then back)."""
    cache = cache_path(path)
    aside = cache.with_name(cache.name + ".aside")
    cache.rename(aside)
    try:
        return read_ledger_frame(path)
    finally:
        cache_path(path).unlink(missing_ok=True)
        aside.rename(cache)


def test_a_session_leaves_frames_that_hold_the_whole_ledger(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    written = records()
    write_as_a_session(path, written)
    cached = load_cache(path, path.stat().st_size)
    assert len(cached.frames) == -(-len(written) // 16)  # one every 16 lines, and the rest
    assert cached.covered == path.stat().st_size
    data = read_cached(path)
    assert data is not None
    fresh = fresh_read(path)
    assert data.summaries() == fresh.summaries() == summarize(read_ledger(path))
    assert data.others == fresh.others
    assert data.calls.equals(fresh.calls)


def test_a_killed_run_s_frames_serve_the_lines_they_hold(tmp_path: Path) -> None:
    """No end record and no close: the frames hold the lines written so far but the last few;
    a report reads those from the frames, parses the rest, and adds no frame (the ledger may
    still be written)."""
    path = tmp_path / "run.jsonl"
    written = records()[:-1]
    write_as_a_session(path, written, close=False)
    cache_size = cache_path(path).stat().st_size
    cached = load_cache(path, path.stat().st_size)
    assert 0 < cached.covered < path.stat().st_size
    assert read_cached(path) is None
    data = read_ledger_frame(path)
    assert data.summaries() == summarize(read_ledger(path))
    assert cache_path(path).stat().st_size == cache_size


def test_a_frame_the_ledger_no_longer_matches_is_not_used(tmp_path: Path) -> None:
    """The ledger rewritten with other records of the same run (the same size up to a frame's
    end would not do either: each frame checks the ledger's bytes where its range ends)."""
    path = tmp_path / "run.jsonl"
    write_as_a_session(path, records())
    other = ledgers.run_records("run-c", seed=7, warm=12)
    ledgers.write(path, other)
    assert load_cache(path, path.stat().st_size).frames == []
    assert read_ledger_frame(path).summaries() == summarize(other)
    # The report then cached the finished ledger anew.
    assert read_cached(path) is not None


def test_a_frame_of_other_columns_is_not_used_and_its_lines_are_parsed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache written before a measure was added to config/metrics.py holds frames without its
    column: such a frame is not used (a report built from it failed on the missing column),
    its lines are parsed, and the report caches them anew with today's columns."""
    from pytest_gpubench.reports import frame, frame_columns

    path = tmp_path / "run.jsonl"
    older = frame_columns.CACHED_NUMBERS[:-1]  # a release that read one column fewer
    with monkeypatch.context() as patched:
        # The columns read (frame_columns) and the ones a frame is written and checked with
        # (frame's cache) alike.
        patched.setattr(frame_columns, "CACHED_NUMBERS", older)
        patched.setattr(frame, "CACHED_NUMBERS", older)
        write_as_a_session(path, records())
        assert len(load_cache(path, path.stat().st_size).frames) > 1
    assert load_cache(path, path.stat().st_size).frames == []
    assert read_ledger_frame(path).summaries() == summarize(read_ledger(path))
    assert read_cached(path) is not None  # cached again, with today's columns


def test_a_small_ledger_gets_no_cache(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    ledger = Ledger(path, observer=ColumnCacheWriter(path))
    for record in records():
        ledger.append(record)
    ledger.close()
    assert not cache_path(path).exists()


def test_merge_writes_the_merged_ledger_s_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The merged ledger's first report is a cached read, the same as a fresh one."""
    from support.ledgers import CELLS, judged_against
    from test_merge import shard_ledger

    monkeypatch.setattr(frame_cache, "FRAME_LINES", 20)
    monkeypatch.setattr(frame_cache, "SMALL_LEDGER_LINES", 8)
    paths = [shard_ledger(tmp_path, cell) for cell in CELLS]
    merged = tmp_path / "merged.jsonl"
    assert main(["merge", *map(str, paths), "-o", str(merged), *judged_against(tmp_path)]) == 0
    data = read_cached(merged)
    assert data is not None
    assert data.summaries() == fresh_read(merged).summaries() == summarize(read_ledger(merged))
    capsys.readouterr()
    assert main(["report", str(merged)]) == 0
    document = capsys.readouterr().out
    assert all(cell in document for cell in CELLS)
