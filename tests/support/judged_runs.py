"""Generated runs driven through the session's own end (the run controller of a pytest session,
in this process) and judged again from the ledger it wrote: what `gpubench gate` reads.

Nothing here measures: the calls a live engine would have answered are generated (their TTFT,
decode rate, the control call and the CPU pressure beside each), and so are the re-measure's
calls of the suspects (run/remeasure.remeasure, patched for the session: it would start engines).
Everything else is the product's own path: cells.yaml and prompts.yaml read by read_matrix, the
cases built by build_cases, begin() writing the meta record, collect() the records, finish()
judging and writing the end record.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from pytest_gpubench.config.cases import build_cases
from pytest_gpubench.config.matrix import Matrix, read_matrix
from pytest_gpubench.config.options import Options
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.results.baseline_update import update_baselines
from pytest_gpubench.results.load_baseline import write_load_baselines
from pytest_gpubench.run.controller import RunController

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 8}
  P-HARD: {intent: long, prompt: "Write a story.", max_tokens: 32}
"""
ENGINE_VERSION = "b6000 (abc123)"
# The engine of an `upgraded` cell in the judged run: another setup than its baseline's.
UPGRADED_VERSION = "b6100 (def456)"


@dataclass(frozen=True)
class CellPlan:
    """One cell of a generated matrix and how its engine behaves in the judged run."""

    name: str
    threshold: float = 0.2
    runs: int = 6
    min_runs: int | None = None
    reference: str | None = None
    # The judged run against the baseline's: TTFT × slowdown, decode rate ÷ slowdown.
    slowdown: float = 1.0
    # The control call's speed in the judged run against the baseline's (the machine's drift),
    # and the CPU pressure beside each call.
    drift: float = 1.0
    pressure: float = 0.0
    # The re-measure's slowdown of this cell's suspects; None: the cell could not be made live.
    again: float | None = 1.0
    # Load points judged against a load baseline: their slowdown (None: no load points).
    load_slowdown: float | None = None
    # Runs of history in the baseline (0: no baseline at all).
    history: int = 1
    # The judged run's engine is another version than its baseline's: `incomparable`, unless
    # accepted or ratified (--baseline-update).
    upgraded: bool = False

    # The spread of the judged run's calls (the sd of log TTFT and log decode rate per call),
    # and of the calls sampled on past the planned runs (run/sample_on.py; None: the same).
    spread: float = 0.06
    sampled_spread: float | None = None
    # A first --baseline-update's later runs (run/history_runs.py): the engine's slowdown in
    # each, run 1 on (the engine's speed moves between its runs).
    run_slowdowns: tuple[float, ...] = ()

    @property
    def cell_id(self) -> str:
        return f"local:llamacpp:tiny@{self.name}"


@dataclass
class GeneratedRun:
    """A matrix of cells, their baselines, and the records a session of them collects."""

    root: Path
    plans: Sequence[CellPlan]
    seed: int = 0
    runs_override: int | None = None
    accept_incomparable: bool = False
    matrix: Matrix = field(init=False)
    # The calls sampled on past the planned runs (run/sample_on.py), in the order measured.
    sampled: list[dict[str, Any]] = field(init=False, default_factory=list)
    _sampling_rng: random.Random | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "prompts.yaml").write_text(PROMPTS)
        self.write_cells(self.plans)
        self.matrix = read_matrix(self.root / "cells.yaml", self.root / "prompts.yaml")

    @property
    def baselines(self) -> Path:
        return self.root / "baselines"

    def write_cells(self, plans: Sequence[CellPlan]) -> None:
        lines = ["nodes: {local: {kind: local}}", "cells:"]
        for number, plan in enumerate(plans):
            extra = f", min_runs: {plan.min_runs}" if plan.min_runs else ""
            extra += f", reference: '{plan.reference}'" if plan.reference else ""
            if plan.load_slowdown is not None:
                extra += ", load: {concurrency: [1], duration_s: 1}"
            lines.append(
                f"  - {{node: local, engine: llamacpp, model: tiny, name: {plan.name}, "
                f"endpoint: 'http://127.0.0.1:{9000 + number}', runs: {plan.runs}, "
                f"phases: [warm], thresholds: {{ttft_p50: {plan.threshold}, "
                f"total_p50: {plan.threshold}, tokens_per_sec: {plan.threshold}}}{extra}}}"
            )
        (self.root / "cells.yaml").write_text("\n".join(lines) + "\n")

    def options(self, **changes: Any) -> Options:
        values: dict[str, Any] = {
            "cells_path": self.root / "cells.yaml",
            "prompts_path": self.root / "prompts.yaml",
            "cells_named": False,
            "baselines_dir": self.baselines,
            "ledger_dir": self.root / "runs",
            "runs": self.runs_override,
            "baseline_update": False,
            "allow_dirty": True,
            "force_load": True,
            "load_threshold": 4.0,
            "for_publication": False,
            "probe": False,
            "smoke": False,
            "env_names": (),
            "anchor": self.root,
            "accept_incomparable": self.accept_incomparable,
        }
        values.update(changes)
        return Options(**values)

    # -- records -------------------------------------------------------------------------------

    def sha(self, cell_id: str, prompt_id: str) -> str:
        cell = self.matrix.cell(cell_id)
        prompt = self.matrix.prompts[prompt_id]
        return prompt.sha256(cell.request_for(prompt))

    def calls(
        self,
        run_id: str,
        plan: CellPlan,
        *,
        rng: random.Random,
        slowdown: float,
        drift: float,
        pressure: float,
        runs: int,
        first_pass: bool = True,
        prompts: Sequence[str] = ("P-EASY", "P-HARD"),
        spread: float = 0.06,
        first_run: int = 0,
    ) -> list[dict[str, Any]]:
        records = []
        for number, prompt_id in enumerate(prompts):
            base = 20.0 + 30 * number
            for run_idx in range(first_run, first_run + runs):
                ttft = base * slowdown * rng.lognormvariate(0, spread)
                decode = 400.0 / slowdown * rng.lognormvariate(0, spread)
                total = ttft + 32 / decode * 1000
                record: dict[str, Any] = {
                    "type": "call",
                    "benchmark_run_id": run_id,
                    "cell_id": plan.cell_id,
                    "node": "local",
                    "engine": "llamacpp",
                    "model": "tiny",
                    "prompt_id": prompt_id,
                    "prompt_sha256": self.sha(plan.cell_id, prompt_id),
                    "phase": "warm",
                    "run_idx": run_idx,
                    "case_id": f"{plan.cell_id}-{prompt_id}-warm-{run_idx}",
                    "started_at_utc": f"2026-11-27T10:00:{run_idx:02d}.000Z",
                    "first_delta_ms": round(ttft, 3),
                    "total_duration_ms": round(total, 3),
                    "prompt_tokens": 12,
                    "completion_tokens": 32,
                    "client_chunks": 32,
                    "tokens_per_sec": round(decode, 3),
                    "tpot_ms": round(1000 / decode, 4),
                    "finish_reason": "length",
                    "backend": "llamacpp",
                    "error": None,
                    "engine_timings": {"prompt_ms": round(ttft * 0.9, 3)},
                    "e2e_tokens_per_sec": round(32 / total * 1000, 3),
                    "coalesced": False,
                    "engine_tokens_per_sec": round(decode * 1.01, 3),
                    "engine_prompt_ms": round(ttft * 0.9, 3),
                    "engine_total_ms": round(total * 0.97, 3),
                    "control_ms": round(2.0 * drift * rng.lognormvariate(0, 0.03), 4),
                    "cpu_pressure": pressure,
                }
                if not first_pass:
                    record["pass"] = 2
                records.append(record)
        return records

    def cell_record(self, run_id: str, plan: CellPlan, *, judged: bool = False) -> dict[str, Any]:
        """The cell's record: in the judged run (`judged`), an upgraded cell's engine version."""
        return {
            "type": "cell",
            "benchmark_run_id": run_id,
            "cell_id": plan.cell_id,
            "node": "local",
            "engine": "llamacpp",
            "model": "tiny",
            "engine_version": UPGRADED_VERSION if judged and plan.upgraded else ENGINE_VERSION,
            "model_digest": "sha256:77ea1bb2a447",
            "gpus": [],
            "gpu_summary": "no GPU",
        }

    def load(self, run_id: str, plan: CellPlan, slowdown: float, seed: int) -> dict[str, Any]:
        from support.ledgers import load_records

        (record,) = load_records(run_id, plan.cell_id, seed=seed, slowdown=slowdown, points=(1,))
        record["prompt_sha256"] = self.sha(plan.cell_id, "P-EASY")
        return record

    def write_baselines(self) -> None:
        """Each planned cell's baseline: `history` ratified runs of the engine unchanged (an
        A/B candidate is judged against its reference, and has none)."""
        for plan in self.plans:
            for number in range(plan.history):
                run_id = f"baseline-{plan.name}-{number}"
                rng = random.Random(f"{self.seed}-{plan.name}-{number}")
                records: list[dict[str, Any]] = [
                    {
                        "type": "meta",
                        "benchmark_run_id": run_id,
                        "started_at_utc": f"2026-11-2{number}T10:00:00.000Z",
                    },
                    self.cell_record(run_id, plan),
                    *self.calls(
                        run_id, plan, rng=rng, slowdown=1.0, drift=1.0, pressure=0.0, runs=8
                    ),
                ]
                update_baselines(self.baselines, records)
                if plan.load_slowdown is not None:
                    write_load_baselines(self.baselines, [self.load(run_id, plan, 1.0, number)])

    def session_records(self, run_id: str) -> list[dict[str, Any]]:
        """What the session collects of its cases: each cell's record and warm calls, and its
        load points. An A/B candidate's pairs and its reference's share their run_idx."""
        rng = random.Random(f"{self.seed}-run")
        records: list[dict[str, Any]] = []
        for plan in self.plans:
            runs = self.runs_override or plan.runs
            records.append(self.cell_record(run_id, plan, judged=True))
            records.extend(
                self.calls(
                    run_id,
                    plan,
                    rng=rng,
                    slowdown=plan.slowdown,
                    drift=plan.drift,
                    pressure=plan.pressure,
                    runs=runs,
                    spread=plan.spread,
                )
            )
            if plan.load_slowdown is not None:
                records.append(self.load(run_id, plan, plan.load_slowdown, self.seed + 7))
        return records

    def remeasured(self, run_id: str, suspects: Sequence[tuple[str, str, int]]) -> list[Any]:
        """The re-measure's pass-2 calls of each suspect, as its cell would answer now."""
        rng = random.Random(f"{self.seed}-again")
        by_id = {plan.cell_id: plan for plan in self.plans}
        records: list[dict[str, Any]] = []
        for cell_id, prompt_id, runs in suspects:
            plan = by_id[cell_id]
            if plan.again is None:
                continue  # its cell could not be made live again
            records.extend(
                self.calls(
                    run_id,
                    plan,
                    rng=rng,
                    slowdown=plan.again,
                    drift=plan.drift,
                    pressure=plan.pressure,
                    runs=runs,
                    first_pass=False,
                    prompts=(prompt_id,),
                )
            )
        return records

    def sampled_on(self, run_id: str, cell_id: str, prompt_id: str, run_idx: int) -> list[Any]:
        """One more warm call of a (cell, prompt) whose figure was undecided, as its cell would
        answer now (run/sample_on.measure_call), marked as such."""
        plan = {plan.cell_id: plan for plan in self.plans}[cell_id]
        spread = plan.spread if plan.sampled_spread is None else plan.sampled_spread
        (record,) = [
            call
            for call in self.calls(
                run_id,
                plan,
                rng=self._sampling,
                slowdown=plan.slowdown,
                drift=plan.drift,
                pressure=plan.pressure,
                runs=1,
                spread=spread,
                first_run=run_idx,
            )
            if call["prompt_id"] == prompt_id
        ]
        record["sampled_on"] = True
        self.sampled.append(record)
        return [record]

    def history_run(self, run_id: str, planned: dict[Any, int], number: int) -> list[Any]:
        """Run `number` of a first --baseline-update's (cell, prompt)s, as each cell's engine
        answers in that run (run/history_runs.measure_run), marked as such."""
        by_id = {plan.cell_id: plan for plan in self.plans}
        records: list[dict[str, Any]] = []
        for cell_id, prompt_id in sorted(planned):
            plan = by_id[cell_id]
            slowdowns = plan.run_slowdowns or (plan.slowdown,)
            for record in self.calls(
                run_id,
                plan,
                rng=random.Random(f"{self.seed}-history-{number}"),
                slowdown=slowdowns[min(number, len(slowdowns)) - 1],
                drift=plan.drift,
                pressure=plan.pressure,
                runs=planned[(cell_id, prompt_id)],
                first_run=number * planned[(cell_id, prompt_id)],
            ):
                if record["prompt_id"] == prompt_id:
                    record["history_run"] = number
                    records.append(record)
        return records

    @property
    def _sampling(self) -> random.Random:
        if self._sampling_rng is None:
            self._sampling_rng = random.Random(f"{self.seed}-sampled")
        return self._sampling_rng


@dataclass(frozen=True)
class SessionEnd:
    """What the session wrote and exited with."""

    ledger: Path
    records: list[dict[str, Any]]
    exit_status: int
    notes: tuple[str, ...] = ()

    @property
    def end(self) -> dict[str, Any]:
        return self.records[-1]


@contextmanager
def _remeasured_by(generated: GeneratedRun, run_id: str) -> Iterator[None]:
    def remeasure(
        harness: Any, suspects: Sequence[tuple[str, str, int]], **_: Any
    ) -> list[dict[str, Any]]:
        return generated.remeasured(run_id, suspects)

    def sampled_on(
        harness: Any, cell_id: str, prompt_id: str, run_idx: int, live: Any, **_: Any
    ) -> list[Any]:
        return generated.sampled_on(run_id, cell_id, prompt_id, run_idx)

    def history_run(harness: Any, planned: dict[Any, int], number: int, **_: Any) -> list[Any]:
        return generated.history_run(run_id, planned, number)

    with (
        mock.patch("pytest_gpubench.run.remeasure.remeasure", remeasure),
        mock.patch("pytest_gpubench.run.sample_on.measure_call", sampled_on),
        mock.patch("pytest_gpubench.run.history_runs.measure_run", history_run),
    ):
        yield


def run_session(
    generated: GeneratedRun,
    *,
    run_id: str = "judged-run",
    pytest_status: int = 0,
    **options_given: Any,
) -> SessionEnd:
    """The session's own begin, collect and finish over the generated run's records (options as
    Options' fields: baseline_update=True, ...), pytest's own status `pytest_status` (1: a test
    failed); its notes on the baselines in `notes`."""
    options = generated.options(**options_given)
    run = RunController(
        options,
        generated.matrix,
        root=generated.root,
        argv=["benchmarks/"],
        writes_ledger=True,
        run_id=run_id,
    )
    run.begin(build_cases(generated.matrix, options.runs))
    assert run.startup_error is None and run.ledger is not None
    run.collect(generated.session_records(run_id))
    with _remeasured_by(generated, run_id):
        status = run.finish(pytest_status, None)
    notes = tuple(run.judgement.baseline_notes)
    return SessionEnd(run.ledger.path, read_ledger(run.ledger.path), status, notes)
