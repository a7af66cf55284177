"""Merging the ledgers of one sharded run (the tasks of a Slurm job array) into one ledger.

Each shard's ledger has its own meta, records and end. The merged ledger has one meta (the
lowest shard's facts, the run's start, every shard's run id, host and Slurm task under
`merged_from`), every shard's other records in shard order, and one end record: the judgement of
the merged records (the caller's: results/judging.py), with every cell of the matrix; a shard whose
ledger is missing, or that ended without its end record, leaves its cells `missing` (`cells_lost`),
so the gate never passes them. Pure: records in, records out.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pytest_gpubench.config.cell import node_of
from pytest_gpubench.config.shards import ShardFacts, assign_nodes
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.status import most_severe
from pytest_gpubench.ledger.outcomes import CellOutcome, CellOutcomeRecord
from pytest_gpubench.ledger.records import end_record
from pytest_gpubench.ledger.schema import (
    EndRecord,
    JudgedEnd,
    MetaRecord,
    as_json,
)
from pytest_gpubench.ledger.writer import iter_records
from pytest_gpubench.targets.protocol import Rental


@dataclass(frozen=True)
class ShardLedger:
    """One shard's ledger as a merge needs it: where it came from, its first and last records,
    its calls per cell (calls, successful calls), its records by type, and its records again,
    read when the merged ledger is written (a large ledger is never held whole)."""

    source: str
    first: Mapping[str, Any]
    last: Mapping[str, Any]
    cell_calls: Mapping[str, tuple[int, int]]
    type_counts: Mapping[str, int]
    again: Callable[[], Iterator[dict[str, Any]]]

    @classmethod
    def read(cls, path: Path) -> ShardLedger:
        """A shard from its ledger file, read once now (its facts) and once more when the
        merged ledger is written (its records)."""
        return cls.scanned(str(path), lambda: iter_records(path))

    @classmethod
    def scanned(cls, source: str, again: Callable[[], Iterator[dict[str, Any]]]) -> ShardLedger:
        """A shard from one pass over its records (`again` gives them, now and at the write)."""
        scan = _Scan()
        for record in again():
            scan.see(record)
        return scan.shard(source, again)

    @property
    def meta(self) -> MetaRecord:
        if self.first.get("type") != "meta":
            raise GpubenchError(f"{self.source}: not a ledger (its first line is no meta record)")
        return cast(MetaRecord, self.first)

    @property
    def shard(self) -> ShardFacts:
        shard = self.meta.get("shard")
        if not isinstance(shard, dict):
            raise GpubenchError(
                f"{self.source}: not the ledger of a shard (its meta has no shard: run pytest "
                "with --gpubench-shard i/N)"
            )
        return shard

    @property
    def end(self) -> EndRecord | None:
        return cast(EndRecord, self.last) if self.last.get("type") == "end" else None


@dataclass
class _Scan:
    """What one pass over a shard's records keeps: first and last, counts."""

    first: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
    cell_calls: dict[str, tuple[int, int]] = field(default_factory=dict)
    type_counts: dict[str, int] = field(default_factory=dict)

    def see(self, record: dict[str, Any]) -> None:
        if self.first is None:
            self.first = record
        self.last = record
        kind = str(record.get("type"))
        self.type_counts[kind] = self.type_counts.get(kind, 0) + 1
        if kind == "call":
            cell_id = str(record.get("cell_id"))
            calls, ok = self.cell_calls.get(cell_id, (0, 0))
            self.cell_calls[cell_id] = (calls + 1, ok + (record.get("error") is None))

    def shard(self, source: str, again: Callable[[], Iterator[dict[str, Any]]]) -> ShardLedger:
        return ShardLedger(
            source, self.first or {}, self.last or {}, self.cell_calls, self.type_counts, again
        )


def _check_one_run(ledgers: Sequence[ShardLedger]) -> tuple[int, list[str]]:
    """The shard count and the matrix's cells, the same in every ledger; no shard twice."""
    first = ledgers[0]
    count, cells = int(first.shard["count"]), list(first.shard["matrix_cells"])
    seen: dict[int, str] = {}
    for ledger in ledgers:
        shard = ledger.shard
        if int(shard["count"]) != count or list(shard["matrix_cells"]) != cells:
            raise GpubenchError(
                f"{ledger.source}: shard of another matrix or split than {first.source} "
                f"({shard['index']}/{shard['count']} vs {first.shard['index']}/{count}): "
                "merge the ledgers of one run only"
            )
        if ledger.meta.get("git_sha") != first.meta.get("git_sha"):
            raise GpubenchError(
                f"{ledger.source}: measured at commit {ledger.meta.get('git_sha')}, "
                f"{first.source} at {first.meta.get('git_sha')}: merge the ledgers of one run only"
            )
        index = int(shard["index"])
        if index in seen:
            raise GpubenchError(
                f"{ledger.source}: shard {index}/{count} is also in {seen[index]}: merge each "
                "shard once"
            )
        seen[index] = ledger.source
    return count, cells


def _missing_outcomes(
    cells: Sequence[str], count: int, ledgers: Sequence[ShardLedger]
) -> list[CellOutcomeRecord]:
    """A `missing` outcome for each cell of a shard that left no ledger or no end record."""
    groups: dict[str, list[str]] = {}
    for cell_id in cells:
        groups.setdefault(node_of(cell_id), []).append(cell_id)
    shard_of = assign_nodes(groups, count)
    by_index = {int(ledger.shard["index"]): ledger for ledger in ledgers}
    outcomes = []
    for cell_id in cells:
        index = shard_of[node_of(cell_id)]
        ledger = by_index.get(index)
        if ledger is not None and ledger.end is not None:
            continue
        if ledger is None:
            reason = f"shard {index}/{count}: no ledger merged"
        else:
            reason = f"shard {index}/{count}: {ledger.source} has no end record (the task died)"
        calls, ok_calls = ledger.cell_calls.get(cell_id, (0, 0)) if ledger else (0, 0)
        outcomes.append(
            CellOutcome(
                cell_id=cell_id,
                node=node_of(cell_id),
                status="missing",
                optional=False,
                reason=reason,
                calls=calls,
                ok_calls=ok_calls,
            ).to_record()
        )
    return outcomes


def _merged_judging(ledgers: Sequence[ShardLedger]) -> dict[str, Any] | None:
    """The shards' judging settings as one: each shard recorded its own cells' (the run-wide
    settings are the same command line's); None where a shard recorded none (an older one)."""
    recorded = [ledger.meta.get("judging") for ledger in ledgers]
    if any(not isinstance(judging, dict) for judging in recorded):
        return None
    merged: dict[str, Any] = dict(cast(dict[str, Any], recorded[0]))
    merged["cells"] = {
        cell_id: cell
        for judging in recorded
        for cell_id, cell in cast(dict[str, Any], judging).get("cells", {}).items()
    }
    return merged


@dataclass(frozen=True)
class MergedRun:
    """The merged ledger but its judgement: one meta, the shards' records (read again as they
    are iterated: a merge of large ledgers is written without holding them) and the facts of
    its end record. The end's judgement is the caller's (results/judging.py, above this layer),
    from the merged records, as `gpubench gate` judges them: never the shards' own."""

    meta: dict[str, Any]
    body: Iterator[dict[str, Any]]
    # The most serious status the shards' pytest sessions ended with (a failed test stands).
    pytest_status: int
    run_id: str
    calls: int
    skipped: int
    nodes: list[Rental]
    finished_at_utc: str | None

    def end(self, judged: JudgedEnd) -> dict[str, Any]:
        """The end record: these facts, and `judged` (results/judging.judged_end): every
        verdict, the regressions, why judging failed, each planned cell's outcome, the status."""
        end = end_record(
            run_id=self.run_id,
            pytest_exitstatus=self.pytest_status,
            calls=self.calls,
            skipped=self.skipped,
            nodes=self.nodes,
            # The last shard's end; the shards ran on other machines, so no load of this one.
            ended=(self.finished_at_utc, None),
            **judged,
        )
        return as_json(end)


def merged_run(ledgers: Sequence[ShardLedger]) -> MergedRun:
    """The merged ledger's meta, its body and its end's facts."""
    if not ledgers:
        raise GpubenchError("merge: name at least one ledger")
    ordered = sorted(ledgers, key=lambda ledger: int(ledger.shard["index"]))
    count, cells = _check_one_run(ordered)
    run_ids = [str(ledger.meta.get("benchmark_run_id")) for ledger in ordered]
    merged_id = str(uuid.uuid5(uuid.NAMESPACE_URL, "gpubench-merge:" + "|".join(run_ids)))
    present = [int(ledger.shard["index"]) for ledger in ordered]
    metas = [ledger.meta for ledger in ordered]
    planned = {cell_id for meta in metas for cell_id in meta.get("cells_planned", [])}
    missing = _missing_outcomes(cells, count, ordered)
    meta: dict[str, Any] = {
        **metas[0],
        "benchmark_run_id": merged_id,
        "started_at_utc": min(str(meta.get("started_at_utc")) for meta in metas),
        "cells_planned": [
            c for c in cells if c in planned or any(m["cell_id"] == c for m in missing)
        ],
        "cases_planned": sum(int(meta.get("cases_planned") or 0) for meta in metas),
        "shard": {
            "count": count,
            "matrix_cells": cells,
            "merged": present,
            "missing": [index for index in range(count) if index not in present],
        },
        "merged_from": [
            {
                "source": ledger.source,
                "benchmark_run_id": meta.get("benchmark_run_id"),
                "shard": ledger.shard.get("index"),
                "host": meta.get("host"),
                "started_at_utc": meta.get("started_at_utc"),
                "slurm_job": meta.get("slurm_job"),
            }
            for ledger, meta in zip(ordered, metas, strict=True)
        ],
        # The cells a lost shard took with it: the gate finds them missing (results/judging.py).
        "cells_lost": {str(outcome["cell_id"]): str(outcome["reason"]) for outcome in missing},
    }
    judging = _merged_judging(ordered)
    if judging is not None:
        meta["judging"] = judging
    body = (
        {**record, "benchmark_run_id": merged_id, "shard_run_id": record.get("benchmark_run_id")}
        for ledger in ordered
        for record in itertools.islice(ledger.again(), 1, None)
        if record.get("type") not in ("meta", "end")
    )
    ends = [end for end in (ledger.end for ledger in ordered) if end is not None]
    counts = {
        kind: sum(ledger.type_counts.get(kind, 0) for ledger in ordered)
        for kind in ("call", "skipped")
    }
    return MergedRun(
        meta=meta,
        body=body,
        pytest_status=most_severe(_pytest_status(end) for end in ends),
        run_id=merged_id,
        calls=counts["call"],
        skipped=counts["skipped"],
        nodes=[node for end in ends for node in end.get("nodes", [])],
        finished_at_utc=max((str(end.get("finished_at_utc")) for end in ends), default=None),
    )


def _pytest_status(end: EndRecord) -> int:
    status = end.get("pytest_exitstatus")
    return status if isinstance(status, int) else 0
