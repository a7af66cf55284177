"""`gpubench compare`, `gate` and `merge`: a finished ledger (or the shards' ledgers merged into
one) judged against baselines as the session judged it (results/ledger_judgement.py), and what
they print of the judgement."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_gpubench.core.errors import GpubenchError

if TYPE_CHECKING:
    from pytest_gpubench.results.ledger_judgement import LedgerJudgement


def compare_command(old: Path, new: Path) -> int:
    """`gpubench compare OLD NEW`: NEW judged as `gpubench gate` judges it (results/judging.py,
    with the settings NEW recorded) against OLD as its reference: a baselines directory, or a
    ledger whose numbers are taken as a baseline of one run. Exits with the gate's statuses, so
    what could not be told (unsteady, blind, inconclusive, incomparable) never exits 0."""
    import tempfile

    from pytest_gpubench.ledger.writer import read_ledger
    from pytest_gpubench.results.ledger_judgement import judge_ledger

    if not new.is_file():
        raise GpubenchError(
            f"{new}: not a ledger: compare judges a ledger (NEW) against a ledger or a "
            "baselines directory (OLD)"
        )
    records = read_ledger(new)
    if old.is_dir():
        judged = judge_ledger(records, old, source=str(new))
        notes = [f"reference: the baselines in {old}"]
    elif old.is_file():
        with tempfile.TemporaryDirectory(prefix="gpubench-compare-") as scratch:
            notes = _reference_of_ledger(old, Path(scratch))
            judged = judge_ledger(records, Path(scratch), source=str(new))
    else:
        raise GpubenchError(f"{old}: no such ledger or baselines directory")
    _print_judgement(judged, "gpubench compare", notes)
    return judged.exit_status


def _reference_of_ledger(ledger: Path, baselines_dir: Path) -> list[str]:
    """A ledger's first-pass numbers written into `baselines_dir` as the baselines (warm and
    load) of one run, whole: the reference the user named is not refused for its success rate
    or sample count (the gate then says what such a reference cannot tell). Returns the notes."""
    from pytest_gpubench.ledger.writer import read_ledger
    from pytest_gpubench.results.baseline_update import update_baselines
    from pytest_gpubench.results.judging import RunRecords
    from pytest_gpubench.results.load_baseline import write_load_baselines

    run = RunRecords.from_records(read_ledger(ledger))
    meta = [run.meta] if run.meta is not None else []
    update = update_baselines(
        baselines_dir, [*meta, *run.cells.values(), *run.calls, *run.skips], min_success_rate=0.0
    )
    if update.failed:
        raise GpubenchError("; ".join(update.failed[cell] for cell in sorted(update.failed)))
    notes = [f"reference: {ledger}, its numbers as a baseline of one run"]
    notes += [
        f"{ledger}: no reference for {cell_id}: {reason}"
        for cell_id, reason in sorted(update.refused.items())
    ]
    if run.loads:
        write_load_baselines(baselines_dir, run.loads)
    return notes


def _print_judgement(judged: LedgerJudgement, command: str, notes: Sequence[str] = ()) -> None:
    """What `gpubench gate` (and `compare`) print of a ledger's judgement, its status last."""
    from pytest_gpubench.core.status import describe
    from pytest_gpubench.reports.comparison import render_comparison

    judgement = judged.judgement
    if judgement.gate_error is not None:
        print(f"ERROR: {judgement.gate_error}")
    print(render_comparison(judgement.verdicts))
    if judgement.load_verdicts:
        print("load points:")
        print(render_comparison(judgement.load_verdicts))
    for note in [*notes, *judgement.notes]:
        print(f"note: {note}")
    for cell in judgement.unmeasured:
        print(f"unmeasured: {cell.cell_id}: {cell.status}: {cell.reason}")
    print(f"{command}: {describe(judged.exit_status)}")


def compare(args: argparse.Namespace) -> int:
    return compare_command(Path(args.old), Path(args.new))


def merge(args: argparse.Namespace) -> int:
    """The shards' ledgers into one, streamed: written as a session writes its ledger (call
    records without their cell's keys), with its columnar cache beside it; its end record is the
    judgement of the merged records against --baselines, the one `gpubench gate` gives."""
    from pytest_gpubench.core.files import atomic_file
    from pytest_gpubench.core.status import describe
    from pytest_gpubench.ledger.merge import ShardLedger, merged_run
    from pytest_gpubench.ledger.writer import Ledger, LedgerWriteError, read_record_line
    from pytest_gpubench.reports.frame_cache import ColumnCacheWriter
    from pytest_gpubench.results.judging import RunRecords, judged_end
    from pytest_gpubench.results.ledger_judgement import judge_finished

    baselines = Path(args.baselines)
    if not baselines.is_dir():
        raise GpubenchError(
            f"{baselines}: --baselines is not a directory (the merged ledger is judged against "
            "the baselines, as gpubench gate judges it)"
        )
    ledgers = [ShardLedger.read(Path(path)) for path in args.ledgers]
    merged = merged_run(ledgers)
    output = Path(args.output)
    run = RunRecords()
    run.add(merged.meta)
    try:
        with atomic_file(output, durable=False) as partial:
            ledger = Ledger(partial, observer=ColumnCacheWriter(output), dumps=read_record_line)
            ledger.append(merged.meta)
            for record in merged.body:
                run.add(record)
                ledger.append(record)
            judged = judge_finished(
                run, baselines, source=str(output), pytest_status=merged.pytest_status
            )
            ledger.append(merged.end(judged_end(judged.judgement, judged.exit_status)))
            ledger.close()
    except (OSError, LedgerWriteError) as exc:
        raise GpubenchError(
            f"{output}: cannot write: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    shard = merged.meta["shard"]
    missing = f"; shards missing: {shard['missing']}" if shard["missing"] else ""
    print(f"{args.output}: {len(ledgers)} of {shard['count']} shards merged{missing}")
    print(
        f"judged against {baselines}: {describe(judged.exit_status)} (as gpubench gate judges it)"
    )
    return 0


def gate(args: argparse.Namespace) -> int:
    from pytest_gpubench.ledger.writer import read_ledger
    from pytest_gpubench.results.ledger_judgement import judge_ledger

    records = read_ledger(Path(args.ledger))
    baselines = Path(args.baselines)
    if not baselines.is_dir():
        raise GpubenchError(f"{baselines}: --baselines is not a directory")
    cells = Path(args.cells) if args.cells else None
    judged = judge_ledger(records, baselines, source=str(args.ledger), cells_path=cells)
    _print_judgement(judged, "gpubench gate")
    return judged.exit_status
