"""One judgement (results/judging.py): the session's end and `gpubench gate` on the same ledger give
the same verdicts and the same exit status, whatever the run held, and whatever happened to
cells.yaml or the command line since. The real job array's ledgers are gated from an empty folder
in test_slurm_array.py."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.judged_runs import CellPlan, GeneratedRun, run_session
from support.standins import OllamaStandin, serving

from pytest_gpubench.cli.main import main
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.results.gate import Verdict
from pytest_gpubench.results.judging import RunRecords, holds_back
from pytest_gpubench.results.judging_settings import SETTINGS_KEY, JudgingSettings
from pytest_gpubench.results.ledger_judgement import judge_ledger


def gate_of(ledger: Path, baselines: Path) -> tuple[list[dict[str, Any]], int]:
    """`gpubench gate`'s verdicts (as the end record holds them) and its exit status."""
    judged = judge_ledger(read_ledger(ledger), baselines, source=str(ledger))
    verdicts = [verdict.to_record() for verdict in judged.judgement.every_verdict]
    return json.loads(json.dumps(verdicts)), judged.exit_status


# -- the property ------------------------------------------------------------------------------

SLOWDOWNS = st.sampled_from([1.0, 1.05, 1.3, 2.0, 0.6])


@st.composite
def cell_plans(draw: st.DrawFn) -> list[CellPlan]:
    """One to three cells against their baselines, and maybe an A/B candidate of the first:
    thresholds, runs, sequential looks, the engine's change, the machine's drift and pressure,
    what the re-measure finds, load points, 0 to 4 runs of baseline history, and an engine
    upgraded since its baseline."""
    count = draw(st.integers(1, 3))
    plans = []
    for number in range(count):
        plans.append(
            CellPlan(
                name=f"c{number}",
                threshold=draw(st.sampled_from([0.1, 0.2, 0.5])),
                runs=draw(st.integers(3, 8)),
                slowdown=draw(SLOWDOWNS),
                drift=draw(st.sampled_from([1.0, 1.0, 1.6])),
                pressure=draw(st.sampled_from([0.0, 0.0, 0.4])),
                again=draw(st.sampled_from([1.0, 2.0, None])),
                load_slowdown=draw(st.sampled_from([None, 1.0, 2.0])),
                history=draw(st.integers(0, 4)),
                upgraded=draw(st.sampled_from([False, False, False, True])),
            )
        )
    if draw(st.booleans()):
        plans.append(
            CellPlan(
                name="candidate",
                runs=plans[0].runs,
                min_runs=draw(st.sampled_from([None, 3])),
                reference=plans[0].cell_id,
                slowdown=draw(SLOWDOWNS) * plans[0].slowdown,
                drift=plans[0].drift,
                history=0,
            )
        )
    return plans


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    plans=cell_plans(),
    seed=st.integers(0, 1000),
    runs_override=st.sampled_from([None, None, 4]),
    accept=st.booleans(),
    pytest_status=st.sampled_from([0, 0, 0, 1, 5]),
    baseline_update=st.sampled_from([False, False, False, True]),
)
def test_the_gate_on_a_ledger_says_what_its_session_said(
    tmp_path_factory: pytest.TempPathFactory,
    plans: list[CellPlan],
    seed: int,
    runs_override: int | None,
    accept: bool,
    pytest_status: int,
    baseline_update: bool,
) -> None:
    """Generated runs (warm calls, load points, A/B pairs with and without sequential looks,
    re-measure passes that confirm, clear or cannot run, steadiness readings, baselines with and
    without history, --gpubench-runs, --gpubench-accept-incomparable, a test that failed or
    nothing collected, --baseline-update): the verdicts in the session's end record equal those
    of `gpubench gate` on its ledger, compared as JSON, and so do the exit statuses. A baseline
    update is gated against the baselines as its session found them (it then wrote them): the
    gate decides what it ratified as the session did (a changed setup ratified passes)."""
    root = tmp_path_factory.mktemp("run")
    generated = GeneratedRun(
        root, plans, seed=seed, runs_override=runs_override, accept_incomparable=accept
    )
    generated.write_baselines()
    before = root / "baselines-before"
    if generated.baselines.is_dir():
        shutil.copytree(generated.baselines, before)
    else:
        before.mkdir()  # no baseline yet (no history)
    session = run_session(generated, pytest_status=pytest_status, baseline_update=baseline_update)
    verdicts, status = gate_of(session.ledger, before)
    for verdict in verdicts:
        kind = "A/B" if verdict.get("reference") else verdict["metric"].split("_")[0]
        event(f"{kind} {verdict['verdict']}{' ' + str(verdict['remeasure'] or '')}")
    event(f"exit status {status}")
    assert verdicts == session.end["verdicts"]
    assert status == session.exit_status == session.end["exit_status"]


def test_the_gate_on_the_ledger_of_a_session_whose_tests_failed_exits_as_it_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A test failed (pytest's 1) in a session that also regressed: the session exits 1, as a
    failed test stands above the gate's findings; `gpubench gate` on its ledger judged the
    findings alone and exited 6 (issue 44). It reads pytest's status in the end record."""
    generated = GeneratedRun(tmp_path, [CellPlan("main", slowdown=2.0, again=2.0)], seed=3)
    generated.write_baselines()
    session = run_session(generated, pytest_status=1)
    assert session.exit_status == session.end["exit_status"] == 1
    assert any(verdict["verdict"] == "regression" for verdict in session.end["verdicts"])
    assert main(["gate", str(session.ledger), "--baselines", str(generated.baselines)]) == 1
    assert "gpubench gate: exit status 1: some tests failed" in capsys.readouterr().out


# -- the two contradictions seen from outside ---------------------------------------------------


def test_cells_yaml_edited_after_the_run_changes_nothing_the_gate_says(tmp_path: Path) -> None:
    """The session judged with a 10 % threshold and found a regression (exit 6); cells.yaml then
    raises it to 900 % and drops a cell. `gpubench gate` on the ledger still says exit 6 with the
    same verdicts: it reads the thresholds the run recorded, not today's cells.yaml. Before, it
    re-read cells.yaml and passed the same ledger."""
    plans = [
        CellPlan("main", threshold=0.1, slowdown=2.0, again=2.0, history=2),
        CellPlan("other", threshold=0.1, history=2),
    ]
    generated = GeneratedRun(tmp_path, plans, seed=5)
    generated.write_baselines()
    session = run_session(generated)
    assert session.exit_status == 6
    generated.write_cells([CellPlan("main", threshold=9.0)])
    verdicts, status = gate_of(session.ledger, generated.baselines)
    assert status == 6
    assert verdicts == session.end["verdicts"]
    assert any(v["verdict"] == "regression" for v in verdicts)


def test_a_ledger_copied_to_an_empty_folder_is_judged_the_same(tmp_path: Path) -> None:
    """No cells.yaml, no prompts.yaml, no command line: the ledger and the baselines alone."""
    plans = [CellPlan("main", threshold=0.2, slowdown=1.3, again=1.3, history=3)]
    generated = GeneratedRun(tmp_path / "project", plans, seed=9)
    generated.write_baselines()
    session = run_session(generated)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(session.ledger, empty / "run.jsonl")
    shutil.copytree(generated.baselines, empty / "baselines")
    shutil.rmtree(generated.root)
    verdicts, status = gate_of(empty / "run.jsonl", empty / "baselines")
    assert (verdicts, status) == (session.end["verdicts"], session.exit_status)


PROMPTS = 'prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 3}\n'
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"


def ab_cells(main_url: str, pr_url: str) -> str:
    cell = "node: local, engine: ollama, model: 'qwen3.5:0.8b', phases: [warm], runs: 4"
    return (
        "nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{{cell}, name: main, endpoint: '{main_url}'}}\n"
        f"  - {{{cell}, name: pr, endpoint: '{pr_url}', min_runs: 3,"
        " reference: 'local:ollama:qwen3.5:0.8b@main'}\n"
    )


def test_runs_set_in_the_ini_file_are_the_runs_the_gate_judges_with(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpubench_runs = 7` in the ini file raises the A/B pairs to 7 (cells.yaml says 4): the
    session judged the candidate with up to 7 pairs and its looks at 3, 4, 5 and 7. `gpubench
    gate` on the ledger judges with the same, though the command line names no runs; before, it
    read --gpubench-runs back from the command line and judged with 4 (another max_pairs and
    look schedule). Ollama cannot run here: the stand-in follows its documented API."""
    with (
        serving(OllamaStandin(token_s=0.004)) as main_url,
        serving(OllamaStandin(token_s=0.004)) as pr_url,
    ):
        pytester.makefile(".yaml", prompts=PROMPTS, cells=ab_cells(main_url, pr_url))
        pytester.makeini("[pytest]\ngpubench_runs = 7\n")
        pytester.makepyfile(test_bench=TEST_FILE)
        # The planned pairs alone (a candidate they leave undecided is sampled on past them, its
        # max_pairs then the budget's: test_pairs_left_undecided_are_sampled_on_in_pairs_...).
        result = pytester.runpytest("--force-load", "--gpubench-sample-on-runs", "0")
    ledger = next((pytester.path / "runs").glob("*.jsonl"))
    records = read_ledger(ledger)
    end = records[-1]
    assert records[0][SETTINGS_KEY]["runs_override"] == 7
    ab = [v for v in end["verdicts"] if v.get("reference")]
    assert ab and {v["max_pairs"] for v in ab} == {7}
    assert "--gpubench-runs" not in " ".join(records[0]["command_line"])
    (pytester.path / "baselines").mkdir(exist_ok=True)
    verdicts, status = gate_of(ledger, pytester.path / "baselines")
    assert verdicts == end["verdicts"]
    assert status == result.ret == end["exit_status"]
    assert main(["gate", str(ledger), "--baselines", str(pytester.path / "baselines")]) == status
    assert "max_pairs" not in capsys.readouterr().err


# -- settings recorded, and ledgers that recorded none -------------------------------------------


def test_the_meta_record_holds_every_cells_resolved_thresholds(tmp_path: Path) -> None:
    """The defaults in force are written in (20 % where cells.yaml gave none, success 0.95), so a
    release with other defaults judges today's ledger as today's session did."""
    generated = GeneratedRun(tmp_path, [CellPlan("main", threshold=0.3)], seed=1)
    session = run_session(generated)
    recorded = session.records[0][SETTINGS_KEY]
    cell = recorded["cells"]["local:llamacpp:tiny@main"]
    assert cell["thresholds"]["ttft_p50"] == 0.3
    assert cell["thresholds"]["first_answer_p50"] == 0.2
    assert cell["thresholds"]["success_rate"] == 0.95
    assert cell["runs"] == 6 and cell["node"] == "local"
    assert recorded["alpha"] == 0.05 and recorded["baseline_update"] is False


def test_a_ledger_of_an_earlier_release_is_judged_with_a_note_saying_what_was_assumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    generated = GeneratedRun(tmp_path, [CellPlan("main", slowdown=2.0, again=2.0)], seed=2)
    generated.write_baselines()
    session = run_session(generated)
    records = read_ledger(session.ledger)
    del records[0][SETTINGS_KEY]
    older = tmp_path / "older.jsonl"
    older.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert main(["gate", str(older), "--baselines", str(generated.baselines)]) == 6
    out = capsys.readouterr().out
    assert (
        f"note: the ledger records no settings (written by an earlier release): judged with "
        f"{generated.root / 'cells.yaml'} as it is now"
    ) in out


def test_bad_recorded_settings_are_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    generated = GeneratedRun(tmp_path, [CellPlan("main")], seed=3)
    generated.write_baselines()
    session = run_session(generated)
    records = read_ledger(session.ledger)
    records[0][SETTINGS_KEY]["cells"]["local:llamacpp:tiny@main"]["runs"] = "many"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert main(["gate", str(bad), "--baselines", str(generated.baselines)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"gpubench: error: {bad}: meta record: judging.cells.")
    assert "runs" in error and error.count("\n") == 1


def test_settings_from_a_record_refuse_unknown_keys() -> None:
    with pytest.raises(GpubenchError, match=r"ledger: meta record: judging\.surprise: "):
        JudgingSettings.from_record({"surprise": 1}, "ledger")


def test_a_run_s_records_are_kept_by_kind_and_a_cell_described_twice_once() -> None:
    run = RunRecords()
    cell = {"type": "cell", "cell_id": "a:b:c"}
    assert run.add(cell) is True
    assert run.add(dict(cell, engine_version="other")) is False
    run.add({"type": "call", "cell_id": "a:b:c", "phase": "warm"})
    run.add({"type": "call", "cell_id": "a:b:c", "phase": "warm", "pass": 2})
    run.add({"type": "call", "cell_id": "a:b:c", "phase": "load"})
    run.add({"type": "not_remeasured", "cell_id": "a:b:c", "prompt_id": "P", "reason": "why"})
    assert (len(run.calls), len(run.remeasured), len(run.load_calls)) == (1, 1, 1)
    assert run.not_remeasured == {("a:b:c", "P"): "why"}
    assert dict(run.cells["a:b:c"]) == cell


def test_a_baseline_corrupted_after_the_run_is_one_error_line_and_exit_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As in a session that cannot read its baselines (a usage error: nothing was judged), not
    a traceback and not gpubench's own exit 2."""
    generated = GeneratedRun(tmp_path, [CellPlan("main", history=2)], seed=4)
    generated.write_baselines()
    session = run_session(generated)
    (baseline,) = generated.baselines.glob("*.json")
    baseline.write_text('{"format_version": 5, "cell_id": ')
    assert main(["gate", str(session.ledger), "--baselines", str(generated.baselines)]) == 4
    out = capsys.readouterr().out
    assert f"ERROR: {baseline}: corrupt baseline: " in out
    assert "gpubench gate: exit status 4: usage error" in out and "Traceback" not in out


def test_the_first_baseline_update_on_a_busy_machine_says_so(tmp_path: Path) -> None:
    """Tasks waited for a CPU 40 % of the calls' time while the baseline was ratified (issue 37):
    the note says that a change against it will be unsteady until it has runs of history; a
    quiet machine's update says nothing of the kind."""
    busy = GeneratedRun(tmp_path / "busy", [CellPlan("main", pressure=0.4)], seed=6)
    notes = run_session(busy, baseline_update=True).notes
    assert any(
        note.startswith("baseline of local:llamacpp:tiny@main measured on a busy machine (tasks "
                        "waited for a CPU 40% of the calls' time): until it has 3 runs of history")
        for note in notes
    ), notes  # fmt: skip
    quiet = GeneratedRun(tmp_path / "quiet", [CellPlan("main")], seed=6)
    assert not any(
        "busy machine" in note for note in run_session(quiet, baseline_update=True).notes
    )


def test_a_ratified_change_starts_a_new_history_and_does_not_blind_the_gate(
    tmp_path: Path,
) -> None:
    """Issue 37: five unchanged runs of history, then --baseline-update ratifies TTFT and total
    twice as slow. Kept beside the runs before it, that step made the between-run spread so
    wide that a +40 % run read `inconclusive` (p = 0.087 between runs) and exited 0. Now the
    ratified run starts a new segment: the history holds it alone, the file's figures are its
    own, an unchanged run passes and +40 % is a regression (exit 6)."""
    import random

    from pytest_gpubench.results.baseline import find_baseline
    from pytest_gpubench.results.baseline_update import update_baselines

    plans = [CellPlan("main", history=5)]
    generated = GeneratedRun(tmp_path / "before", plans, seed=11)
    generated.write_baselines()
    (plan,) = generated.plans
    ratified = generated.calls(
        "ratified", plan, rng=random.Random(3), slowdown=2.0, drift=1.0, pressure=0.0, runs=8
    )
    meta = {"type": "meta", "benchmark_run_id": "ratified", "started_at_utc": "2026-11-26T10Z"}
    update_baselines(
        generated.baselines, [meta, generated.cell_record("ratified", plan), *ratified]
    )
    baseline = find_baseline(generated.baselines, plan.cell_id)
    assert baseline is not None
    for prompt_id in ("P-EASY", "P-HARD"):
        assert [run.benchmark_run_id for run in baseline.runs(prompt_id)] == ["ratified"]

    def judged(slowdown: float, name: str) -> int:
        run = GeneratedRun(tmp_path / name, [CellPlan("main", slowdown=slowdown, again=slowdown)])
        shutil.copytree(generated.baselines, run.baselines)
        return run_session(run).exit_status

    assert judged(2.0, "unchanged") == 0
    assert judged(2.8, "slower") == 6


def test_the_gate_on_a_baseline_update_ledger_says_what_its_session_ratified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What --baseline-update writes is decided in the judgement, from the settings the ledger
    recorded (results/ratification.py): `gpubench gate` on the ledger says which cells the
    session ratified and why it refused the others (two warm runs can never be significant
    against two), line for line as the session's notes; it said only that the run ratified."""
    generated = GeneratedRun(tmp_path, [CellPlan("main", runs=6), CellPlan("few", runs=2)], seed=5)
    session = run_session(generated, baseline_update=True)
    written = sorted(
        note.split(": ", 1)[1].split(" -> ")[0]
        for note in session.notes
        if note.startswith("baseline written: ")
    )
    refused = sorted(note for note in session.notes if note.startswith("baseline NOT written"))
    assert written == ["local:llamacpp:tiny@main"] and len(refused) == 1, session.notes
    assert "local:llamacpp:tiny@few" in refused[0]
    assert main(["gate", str(session.ledger), "--baselines", str(generated.baselines)]) == 0
    notes = [line[6:] for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    ratified = sorted(
        note.split(": ", 1)[1].split(" -> ")[0]
        for note in notes
        if note.startswith("ratified (--baseline-update): ")
    )
    assert ratified == written, notes
    assert sorted(note for note in notes if note.startswith("baseline NOT written")) == refused


def test_the_gate_on_an_update_that_ratified_a_new_engine_exits_as_its_session(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine was upgraded since the baseline: --baseline-update ratifies the new setup and
    the session exits 0. `gpubench gate` on its ledger, against the baselines the session found,
    called the cell incomparable and exited 8: it could not rebuild what the update ratified."""
    generated = GeneratedRun(tmp_path, [CellPlan("main", upgraded=True, history=2)], seed=8)
    generated.write_baselines()
    before = tmp_path / "baselines-before"
    shutil.copytree(generated.baselines, before)
    session = run_session(generated, baseline_update=True)
    assert session.exit_status == 0
    assert any("ratified for this setup" in note for note in session.notes), session.notes
    verdicts, status = gate_of(session.ledger, before)
    assert "incomparable" in {verdict["verdict"] for verdict in verdicts}
    assert status == session.exit_status == 0
    assert main(["gate", str(session.ledger), "--baselines", str(before)]) == 0
    assert f"ratified (--baseline-update): {CellPlan('main').cell_id} -> " in (
        capsys.readouterr().out
    )


def test_a_ratified_step_after_two_updates_is_the_new_reference(tmp_path: Path) -> None:
    """Issue 43, item 5: two updates of an unchanged engine, then --baseline-update ratifies
    TTFT 40 % slower (P-HARD 50 → 70 ms). Two runs before it cannot bound a prediction interval,
    so the step stayed in the history, the reference was the three runs' mean and the unchanged
    run at the new level read `inconclusive` (+25 %, p ≈ 0.2 between runs): exit 10 every time.
    The run after the step is now compared with what the update ratified: the unchanged run
    exits 0, and 40 % slower again is a regression (exit 6)."""
    import random

    from pytest_gpubench.results.baseline import find_baseline
    from pytest_gpubench.results.baseline_update import update_baselines
    from pytest_gpubench.results.run_history import current_segment

    generated = GeneratedRun(tmp_path / "before", [CellPlan("main", history=2)], seed=5)
    generated.write_baselines()
    (plan,) = generated.plans
    ratified = generated.calls(
        "ratified", plan, rng=random.Random(4), slowdown=1.4, drift=1.0, pressure=0.0, runs=8
    )
    meta = {"type": "meta", "benchmark_run_id": "ratified", "started_at_utc": "2026-11-26T10Z"}
    update_baselines(
        generated.baselines, [meta, generated.cell_record("ratified", plan), *ratified]
    )
    baseline = find_baseline(generated.baselines, plan.cell_id)
    assert baseline is not None
    # The file keeps the two runs before the step; the gate leaves them out.
    assert len(baseline.runs("P-HARD")) == 3
    assert [run.benchmark_run_id for run in current_segment(baseline.runs("P-HARD"))] == [
        "ratified"
    ]

    def judged(slowdown: float, name: str) -> tuple[int, list[str]]:
        run = GeneratedRun(tmp_path / name, [CellPlan("main", slowdown=slowdown, again=slowdown)])
        shutil.copytree(generated.baselines, run.baselines)
        end = run_session(run)
        return end.exit_status, [v["message"] for v in end.end["verdicts"]]

    status, messages = judged(1.4, "unchanged")
    assert status == 0, messages
    status, messages = judged(1.96, "slower")
    assert status == 6, messages
    assert any("warm TTFT p50 +" in m and "(slower: 7" in m for m in messages), messages


class ShortReplies(GeneratedRun):
    """Replies of 4 tokens: 3 gaps between them, a decode rate decided by when the threads ran
    (the client's reads of them now together, now apart), which swings either way per call."""

    def calls(self, run_id: str, plan: CellPlan, **given: Any) -> list[dict[str, Any]]:
        import random

        rng = random.Random(f"{run_id}-short")
        records = super().calls(run_id, plan, **given)
        for record in records:
            record["completion_tokens"] = record["client_chunks"] = 4
            record["tokens_per_sec"] = round(record["tokens_per_sec"] * rng.uniform(0.4, 2.5), 3)
        return records


def test_a_decode_rate_of_replies_too_short_to_time_never_holds_the_run_back(
    tmp_path: Path,
) -> None:
    """Issue 43, item 3: 4-token replies give a decode rate that swings -60 % to +150 % per call.
    Judged, it was `blind` or `inconclusive` (exit 10) session after session, and no re-run
    could settle it. It is `ungated` for the prompt: the run exits 0, and the one line says why
    and which setting would make it gateable; TTFT and total are judged as before, and `gpubench
    gate` agrees."""
    generated = ShortReplies(tmp_path, [CellPlan("main", history=3, runs=8)], seed=2)
    generated.write_baselines()
    end = run_session(generated)
    decode = [v for v in end.end["verdicts"] if v["metric"] == "warm_decode_tokens_per_sec_p50"]
    assert [v["verdict"] for v in decode] == ["ungated", "ungated"], decode
    assert decode[0]["message"].startswith("local:llamacpp:tiny@main P-EASY: warm decode tokens/s")
    assert decode[0]["message"].endswith(
        ": not gated for this prompt: its replies carry 3 gaps between tokens, fewer than the 16 "
        "a decode figure needs (so few are decided by when the threads were scheduled); raise "
        "the prompt's max_tokens to 17 or more to gate it"
    )
    ttft = [v["verdict"] for v in end.end["verdicts"] if v["metric"] == "warm_ttft_p50_ms"]
    assert ttft == ["ok", "ok"]
    assert end.exit_status == 0, [v["message"] for v in end.end["verdicts"]]
    assert gate_of(end.ledger, generated.baselines)[1] == 0


# -- an undecided figure measured until it is decided (issue 43, item 2) ----------------------


def test_a_blind_figure_is_sampled_on_and_decided_within_the_budget(tmp_path: Path) -> None:
    """Six calls whose TTFT and decode rate swing ±50 % (the engine was still warming its
    caches) leave every figure `blind` within the run: exit 10, and a re-run would do the same.
    The session now samples on: more warm calls of both prompts, interleaved, judged again at
    each planned look (their spread narrows to 2 %), until decided: `ok`, exit 0, within the
    default budget of as many calls again, and `gpubench gate` judges the ledger alike."""
    plan = CellPlan("main", runs=6, spread=0.5, sampled_spread=0.02)
    generated = GeneratedRun(tmp_path, [plan], seed=3)
    generated.write_baselines()
    end = run_session(generated)
    messages = [v["message"] for v in end.end["verdicts"]]
    assert end.exit_status == 0, messages
    ttft = [v for v in end.end["verdicts"] if v["metric"] == "warm_ttft_p50_ms"]
    assert [v["verdict"] for v in ttft] == ["ok", "ok"], messages
    sampled = {(c["prompt_id"], c["run_idx"]) for c in generated.sampled}
    more = sum(1 for prompt, _ in sampled if prompt == "P-EASY")
    assert ttft[0]["message"].endswith(
        f"; decided with {more} more calls sampled on after the planned 6"
    )
    assert {prompt for prompt, _ in sampled} == {"P-EASY", "P-HARD"}
    assert 0 < len(sampled) <= 2 * 6 and min(run_idx for _, run_idx in sampled) == 6
    calls = [r for r in end.records if r.get("type") == "call" and r.get("sampled_on")]
    assert len(calls) == len(sampled)
    assert gate_of(end.ledger, generated.baselines) == (
        json.loads(json.dumps(end.end["verdicts"])),
        0,
    )


class TransportJitter(GeneratedRun):
    """Calls whose client TTFT is the engine's prompt time plus a transport that adds 0 to 60 ms
    at random (a loaded proxy, a shared link): llama-server's own prompt time, steady within 2 %,
    takes the run's `slowdown`; the transport takes `transport` (class attribute) whatever the
    engine did."""

    transport = 1.0

    def calls(self, run_id: str, plan: CellPlan, **given: Any) -> list[dict[str, Any]]:
        import random

        rng = random.Random(f"{run_id}-{given.get('first_run', 0)}-transport")
        records = super().calls(run_id, plan, **given)
        slowdown = given["slowdown"]
        for record in records:
            base = 20.0 if record["prompt_id"] == "P-EASY" else 50.0
            prompt = base * slowdown * rng.lognormvariate(0, 0.02)
            ttft = prompt + rng.uniform(0.0, 60.0) * self.transport
            decode = record["total_duration_ms"] - record["first_delta_ms"]
            record["engine_prompt_ms"] = round(prompt, 3)
            record["engine_timings"] = {"prompt_ms": round(prompt, 3)}
            record["first_delta_ms"] = round(ttft, 3)
            record["total_duration_ms"] = round(ttft + decode, 3)
            record["engine_total_ms"] = round(prompt + decode * 0.97, 3)
        return records


def test_a_change_the_engine_s_own_timings_share_is_decided_with_fewer_calls(
    tmp_path: Path,
) -> None:
    """Issue 43, item 6: llama-server's prompt time 40 % slower, seen by the client through a
    transport that adds 0-60 ms at random. The client's TTFT alone is `inconclusive` (its
    spread is the transport's), and the session sampled on. The engine's own prompt time over the
    same calls moved as far and is significant: the regression is decided at the planned runs,
    nothing sampled on, exit 6, the message saying the engine's figure decided it; `gpubench
    gate` agrees."""
    plan = CellPlan("main", runs=6, slowdown=1.4, again=1.4, history=1)
    generated = TransportJitter(tmp_path, [plan], seed=4)
    generated.write_baselines()
    end = run_session(generated)
    messages = [v["message"] for v in end.end["verdicts"]]
    assert end.exit_status == 6, messages
    ttft = {v["prompt_id"]: v for v in end.end["verdicts"] if v["metric"] == "warm_ttft_p50_ms"}
    assert ttft["P-EASY"]["verdict"] == "regression", messages
    assert ", not significant on its own (p = " in ttft["P-EASY"]["message"]
    assert (
        "but decided with llama-server's own prompt time, which moved with it over the same "
        "calls: llama-server's own prompt time +3" in ttft["P-EASY"]["message"]
    )
    assert "engine-side: llama-server's own prompt time +3" in ttft["P-EASY"]["message"]
    assert not generated.sampled
    assert gate_of(end.ledger, generated.baselines) == (
        json.loads(json.dumps(end.end["verdicts"])),
        6,
    )


def test_a_change_the_engine_s_own_timings_do_not_share_stays_the_client_s_to_decide(
    tmp_path: Path,
) -> None:
    """The converse: the engine unchanged, the transport's 0-60 ms now 0-90 ms. The client's
    TTFT moved past the threshold and is not significant; the engine's own prompt time held, so
    it decides nothing: the figure stays the client's to decide (sampled on, attributed to the
    client or the transport side), never a regression the engine's figure made."""
    plan = CellPlan("main", runs=6, history=1)
    generated = TransportJitter(tmp_path, [plan], seed=4)
    generated.write_baselines()
    TransportJitter.transport = 1.5
    try:
        end = run_session(generated, sample_on_runs=0)
    finally:
        TransportJitter.transport = 1.0
    ttft = [v for v in end.end["verdicts"] if v["metric"] == "warm_ttft_p50_ms"]
    inconclusive = [v for v in ttft if v["verdict"] == "inconclusive"]
    assert inconclusive, [v["message"] for v in ttft]
    assert all("decided with" not in v["message"] for v in ttft)
    assert all(
        "client or transport side: the engine's own timings held" in v["message"]
        for v in inconclusive
    )
    assert end.exit_status == 10


def test_a_figure_still_undecided_when_the_budget_is_spent_says_the_budget(
    tmp_path: Path,
) -> None:
    """The same ±50 % spread, and the calls sampled on no steadier: after the budget (3 runs
    per (cell, prompt) here) the figure is still `blind`, the run exits 10, and the message says
    what was spent of which budget and what would settle it. With the budget at 0 nothing is
    sampled on (and the message is today's)."""
    plan = CellPlan("main", runs=6, spread=0.5)
    generated = GeneratedRun(tmp_path / "spent", [plan], seed=3)
    generated.write_baselines()
    end = run_session(generated, sample_on_runs=3)
    assert end.exit_status == 10
    assert len(generated.sampled) == 2 * 3
    found = [Verdict.from_record(record) for record in end.end["verdicts"]]
    undecided = [asdict(v) for v in found if v is not None and holds_back(v)]
    assert undecided and all(v["verdict"] in ("blind", "inconclusive") for v in undecided)
    assert all(
        "; sampled on: 3 more calls after the planned 6 left it undecided (budget 3 runs and "
        "120 s per (cell, prompt); its runs spent): settle it with a larger budget "
        "(--gpubench-sample-on-runs 6, --gpubench-sample-on-seconds), a baseline of more runs, "
        "or runs of history (`gpubench calibrate`)" in v["message"]
        for v in undecided
    ), [v["message"] for v in undecided]
    assert gate_of(end.ledger, generated.baselines)[1] == 10
    off = GeneratedRun(tmp_path / "off", [plan], seed=3)
    off.write_baselines()
    assert run_session(off, sample_on_runs=0).exit_status == 10 and not off.sampled


SPREAD = 0.3


def ab_plans(slowdown: float, sampled_spread: float | None) -> list[CellPlan]:
    """An A/B pair of cells with no baselines: the reference and a candidate `slowdown` times
    slower, whose planned calls swing ±30 % (a busy neighbour) and whose calls sampled on swing
    `sampled_spread` (None: as much)."""
    reference = CellPlan("main", runs=8, spread=SPREAD, sampled_spread=sampled_spread, history=0)
    candidate = CellPlan(
        "pr",
        runs=8,
        spread=SPREAD,
        sampled_spread=sampled_spread,
        history=0,
        reference=reference.cell_id,
        slowdown=slowdown,
    )
    return [reference, candidate]


def ab_ttft(end: Any) -> list[dict[str, Any]]:
    return [
        v for v in end.end["verdicts"] if v["metric"] == "warm_ttft_p50_ms" and v.get("reference")
    ]


@pytest.mark.parametrize(
    ("slowdown", "verdict", "status"), [(1.0, "ok", 0), (1.3, "regression", 6)]
)
def test_an_ab_candidate_left_undecided_is_sampled_on_in_pairs_until_decided(
    tmp_path: Path, slowdown: float, verdict: str, status: int
) -> None:
    """Issue 43, item 2, for A/B: eight pairs whose calls swing ±30 % leave the candidate's TTFT
    `blind` or `inconclusive` (exit 10 before). The session samples on in pairs, the candidate's
    call and its reference's of one run_idx each time (their spread now 2 %), judged again at
    each look, until decided: unchanged `ok` and exit 0, 30 % slower a `regression` and exit 6,
    each saying after how many pairs, within the default budget of as many pairs again; `gpubench
    gate` judges the ledger alike."""
    generated = GeneratedRun(tmp_path, ab_plans(slowdown, 0.02), seed=6)
    planned = run_session(generated, sample_on_runs=0)
    assert planned.exit_status == 10, [v["message"] for v in ab_ttft(planned)]
    generated = GeneratedRun(tmp_path / "sampled", ab_plans(slowdown, 0.02), seed=6)
    end = run_session(generated)
    (ttft,) = [v for v in ab_ttft(end) if v["prompt_id"] == "P-HARD"]
    assert ttft["verdict"] == verdict and end.exit_status == status, ttft["message"]
    sampled = [(c["cell_id"], c["prompt_id"], c["run_idx"]) for c in generated.sampled]
    hard = sorted(idx for cell, prompt, idx in sampled if prompt == "P-HARD" and "@pr" in cell)
    assert hard and hard == sorted(
        idx for cell, prompt, idx in sampled if prompt == "P-HARD" and "@main" in cell
    )  # each pair: both cells, one run_idx
    assert hard[0] == 8 and len(hard) <= 8
    assert ttft["message"].endswith(
        f"; decided with {len(hard)} more pairs sampled on after the planned 8"
    )
    assert gate_of(end.ledger, generated.baselines) == (
        json.loads(json.dumps(end.end["verdicts"])),
        status,
    )


def test_an_ab_candidate_still_undecided_when_the_budget_is_spent_says_the_budget(
    tmp_path: Path,
) -> None:
    """The pairs sampled on swing as much as the planned ones: after the budget (3 pairs here)
    the candidate's TTFT is still undecided, exit 10, and the message says what was spent and
    what would settle it."""
    generated = GeneratedRun(tmp_path, ab_plans(1.0, None), seed=6)
    end = run_session(generated, sample_on_runs=3)
    assert end.exit_status == 10
    undecided = [v for v in ab_ttft(end) if v["verdict"] in ("blind", "inconclusive")]
    assert undecided, [v["message"] for v in ab_ttft(end)]
    assert all(
        "; sampled on: 3 more pairs after the planned 8 left it undecided (budget 3 runs and "
        "120 s per (cell, prompt); its runs spent): settle it with a larger budget "
        "(--gpubench-sample-on-runs 6, --gpubench-sample-on-seconds), or both engines placed "
        "alike on a quieter machine" in v["message"]
        for v in undecided
    ), [v["message"] for v in undecided]
    assert gate_of(end.ledger, generated.baselines)[1] == 10


def test_the_update_that_ratified_a_step_says_its_history_starts_again(tmp_path: Path) -> None:
    """After two updates of an unchanged engine, a --baseline-update session that ratifies TTFT
    40 % slower notes that the gate's history is back to one run (the runs before the step are
    left out, issue 43): the between-run noise floor is unknown again. It said nothing: the file
    holds three runs."""
    before = GeneratedRun(tmp_path / "before", [CellPlan("main", history=2)], seed=5)
    before.write_baselines()
    step = GeneratedRun(tmp_path / "step", [CellPlan("main", slowdown=1.4)], seed=5)
    shutil.copytree(before.baselines, step.baselines)
    notes = run_session(step, baseline_update=True).notes
    assert (
        "baseline of local:llamacpp:tiny@main: runs of history P-EASY (1), P-HARD (1): the "
        "between-run noise floor is still unknown until 3 (seed it with `gpubench calibrate`)"
    ) in notes, notes


# -- a baseline knows its between-run spread from the first update (issue 43, item 4) ---------


def test_a_first_baseline_update_records_runs_and_a_faster_unchanged_run_is_no_win(
    tmp_path: Path,
) -> None:
    """The engine ran 25 % faster than during its one baseline run (its speed moves between
    runs of itself: 0.8 and 1.1 of the first's in two more): judged within that run alone, the
    unchanged engine was a significant `win`, as in 4 of 5 sessions of issue 43. A first
    --baseline-update with --gpubench-baseline-runs 3 measures each (cell, prompt) in three
    runs, its engine started again between them, and records each run in the history: the next
    session judges between runs, reports no win, and exits 0. With one run (the default), the
    same session reports the false win."""
    plan = CellPlan("main", history=0, run_slowdowns=(0.8, 1.1))
    first = GeneratedRun(tmp_path / "first", [plan], seed=8)
    update = run_session(first, baseline_update=True, run_id="first-update", baseline_runs=3)
    assert update.exit_status == 0
    later = [r for r in update.records if r.get("type") == "call" and r.get("history_run")]
    assert sorted({r["history_run"] for r in later}) == [1, 2]
    assert len(later) == 2 * 2 * 6  # two more runs of both prompts, six calls each
    stored = json.loads((first.baselines / "local_llamacpp_tiny_main.json").read_text())
    assert [run["benchmark_run_id"] for run in stored["prompts"]["P-EASY"]["history"]] == [
        "first-update#0",
        "first-update#1",
        "first-update#2",
    ]

    def judged(name: str) -> list[dict[str, Any]]:
        run = GeneratedRun(tmp_path / name, [CellPlan("main", slowdown=0.75)], seed=8)
        shutil.copytree(first.baselines, run.baselines)
        end = run_session(run)
        verdicts: list[dict[str, Any]] = end.end["verdicts"]
        assert end.exit_status == 0, [v["message"] for v in verdicts]
        return verdicts

    verdicts = judged("after")
    assert not [v for v in verdicts if v["verdict"] == "win"], verdicts
    one = GeneratedRun(tmp_path / "one", [plan], seed=8)
    run_session(one, baseline_update=True, run_id="one-run")
    faster = GeneratedRun(tmp_path / "faster", [CellPlan("main", slowdown=0.75)], seed=8)
    shutil.copytree(one.baselines, faster.baselines)
    assert [v for v in run_session(faster).end["verdicts"] if v["verdict"] == "win"]
    assert all(
        v["noise"].startswith("between runs (3 runs of history)")
        for v in verdicts
        if v["metric"] == "warm_ttft_p50_ms"
    )
