"""Baselines against the real llama-server: a baseline of another setup is `incomparable` (exit 8)
until accepted or ratified, --baseline-update merges what it measured into what was there, never
writes from --smoke, replaces a corrupt file, and a baselines directory it cannot write is exit 9.

The cells are managed: the plugin starts llama-server on the tiny model, whose sha256 is the
recorded model digest. A different digest is made by editing the baseline file (the only model
this machine has is the tiny one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from test_faults import mount_tmpfs  # noqa: F401 - the fixture, shared

from pytest_gpubench.core.status import EXIT_INCOMPARABLE, EXIT_WRITE_FAILED
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.results.baseline_format import REPAIR

pytestmark = pytest.mark.engine

CELL = "local:llamacpp:tiny"
FILE = "local_llamacpp_tiny.json"
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "hi", max_tokens: 8}
  P-MEDIUM: {intent: medium, prompt: "Explain in 4 sentences why the sky is blue.", max_tokens: 12}
  P-HARD: {intent: long, prompt: "Write a short story about a fisherman.", max_tokens: 16}
"""
OTHER_DIGEST = "sha256:" + "0" * 64


def bench(
    pytester: pytest.Pytester,
    llama_server: Path,
    *,
    runs: int,
    phases: str = "[warm]",
    prompts: str = "[P-EASY]",
) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, server_binary: '{llama_server}', "
        f"server_args: [--threads, '1'], runs: {runs}, phases: {phases}, prompts: {prompts}}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("--force-load", "-p", "no:cacheprovider", *args)


def stored(pytester: pytest.Pytester) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((pytester.path / "baselines" / FILE).read_text())
    return data


def entry_text(pytester: pytest.Pytester, prompt_id: str) -> str:
    """A prompt's entry exactly as the file holds it (sorted keys, two-space indent)."""
    text = (pytester.path / "baselines" / FILE).read_text()
    start = text.index(f'    "{prompt_id}": {{')
    end = text.index("\n    }", start)
    return text[start:end]


def end_record(pytester: pytest.Pytester) -> dict[str, Any]:
    newest = max((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    return read_ledger(newest)[-1]


def test_another_model_digest_is_incomparable_until_accepted_or_ratified(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    bench(pytester, llama_server, runs=20)
    assert run(pytester, "--baseline-update").ret == 0
    baseline = stored(pytester)
    digest = baseline["provenance"]["model_digest"]
    assert str(digest).startswith("sha256:") and len(str(digest)) == 71
    assert baseline["provenance"]["model_identity"] == "digest"
    # llama-server's stream carries a system_fingerprint (its build): every call the same one.
    fingerprint = baseline["provenance"]["system_fingerprint"]
    assert fingerprint and fingerprint == baseline["provenance"]["engine_version"]
    baseline["provenance"]["model_digest"] = OTHER_DIGEST
    path = pytester.path / "baselines" / FILE
    path.write_text(json.dumps(baseline, indent=2, sort_keys=True) + "\n")
    change = f"model digest sha256:000000000000… → {str(digest)[:19]}…"

    refused = run(pytester, "--junitxml=junit.xml")
    assert refused.ret == EXIT_INCOMPARABLE
    refused.stdout.fnmatch_lines(
        [
            f"{CELL}*P-EASY*incomparable",
            f"INCOMPARABLE: {CELL} P-EASY: baseline measured on another setup ({change}): its "
            "numbers are not judged; accept them with --gpubench-accept-incomparable or ratify "
            "this setup with --baseline-update",
            f"gpubench: the baselines of {CELL} in * were measured on another setup: not judged",
        ]
    )
    assert "REGRESSION" not in refused.stdout.str()
    assert refused.outlines[-1] == (
        "gpubench: exit status 8: a baseline is not comparable with this run"
    )
    end = end_record(pytester)
    assert end["exit_status"] == EXIT_INCOMPARABLE
    assert [v["verdict"] for v in end["verdicts"]] == ["incomparable"]
    root = ElementTree.parse(pytester.path / "junit.xml").getroot()
    gate = {
        c.get("name"): c for c in root.iter("testcase") if c.get("classname") == "gpubench.gate"
    }
    failure = gate[f"{CELL} P-EASY provenance"].find("failure")
    assert failure is not None and failure.get("message", "").startswith(
        f"INCOMPARABLE: {CELL} P-EASY: baseline measured on another setup ({change})"
    )
    from pytest_gpubench.cli.main import main

    (ledger,) = [
        p for p in (pytester.path / "runs").glob("*.jsonl") if p.read_text().count('"incomparable"')
    ]
    markdown = pytester.path / "report.md"
    assert main(["report", str(ledger), "-o", str(markdown)]) == 0
    text = markdown.read_text()
    assert "| baseline setup |" in text and f"- INCOMPARABLE: {CELL} P-EASY:" in text

    # No sampling on past the planned runs (--gpubench-sample-on-runs 0): an undecided verdict
    # that sampled on ends its message with what it sampled ("; sampled on: 20 more calls..."),
    # after the acceptance asserted below, and whether it is undecided is the machine's (beside a
    # whole parallel suite the run's spread left a verdict BLIND and it sampled on).
    accepted = run(pytester, "--gpubench-accept-incomparable", "--gpubench-sample-on-runs", "0")
    # Judged as usual: the numbers are compared (a noisy machine may still call a change).
    assert accepted.ret != EXIT_INCOMPARABLE
    accepted.stdout.fnmatch_lines(
        [
            f"{CELL}*P-EASY*",
            f"baseline of {CELL} measured on another setup ({change}): compared all the same "
            "(--gpubench-accept-incomparable)",
        ]
    )
    verdicts = end_record(pytester)["verdicts"]
    assert {v["metric"] for v in verdicts} >= {"warm_ttft_p50_ms", "warm_success_rate"}
    assert all(
        v["message"].endswith("accepted with --gpubench-accept-incomparable]") for v in verdicts
    )

    ratified = run(pytester, "--baseline-update")
    assert ratified.ret == 0
    ratified.stdout.fnmatch_lines(
        [
            f"ACCEPTED (incomparable): {CELL} P-EASY: baseline measured on another setup*",
            f"baseline written: {CELL} -> *{FILE}",
            f"baseline of {CELL} ratified for this setup: {change}",
        ]
    )
    assert stored(pytester)["provenance"]["model_digest"] == digest
    again = run(pytester)
    assert again.ret != EXIT_INCOMPARABLE
    assert "INCOMPARABLE" not in again.stdout.str()
    assert "incomparable" not in {v["verdict"] for v in end_record(pytester)["verdicts"]}


def test_an_update_of_one_prompt_or_phase_keeps_the_rest_byte_identical(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    bench(
        pytester, llama_server, runs=5, phases="[cold, warm]", prompts="[P-EASY, P-MEDIUM, P-HARD]"
    )
    assert run(pytester, "--baseline-update").ret == 0
    before = {p: entry_text(pytester, p) for p in ("P-EASY", "P-MEDIUM", "P-HARD")}

    easy = run(pytester, "--baseline-update", "-k", "P-EASY")
    assert easy.ret == 0, easy.stdout.str()
    easy.stdout.fnmatch_lines([f"baseline written: {CELL} -> *{FILE}"])
    assert entry_text(pytester, "P-MEDIUM") == before["P-MEDIUM"]
    assert entry_text(pytester, "P-HARD") == before["P-HARD"]
    assert entry_text(pytester, "P-EASY") != before["P-EASY"]  # new samples

    cold_before = {p: stored(pytester)["prompts"][p]["cold"] for p in before}
    warm_before = stored(pytester)["prompts"]["P-EASY"]["warm"]
    warm = run(pytester, "--baseline-update", "-m", "warm")
    assert warm.ret == 0, warm.stdout.str()
    after = stored(pytester)["prompts"]
    assert {p: after[p]["cold"] for p in before} == cold_before
    assert after["P-EASY"]["warm"] != warm_before


def test_smoke_never_writes_a_baseline(pytester: pytest.Pytester, llama_server: Path) -> None:
    bench(pytester, llama_server, runs=5)
    result = run(pytester, "--smoke", "--baseline-update")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        ["baselines NOT written: --smoke measures one call, too few to judge against"]
    )
    assert not (pytester.path / "baselines").exists()
    assert run(pytester, "--baseline-update").ret == 0
    written = (pytester.path / "baselines" / FILE).read_bytes()
    assert run(pytester, "--smoke", "--baseline-update").ret == 0
    assert (pytester.path / "baselines" / FILE).read_bytes() == written


def test_a_run_too_short_for_the_cell_is_not_written(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    """Two warm samples against the cell's five later ones: smallest p = 1/C(7, 2) = 0.048 can
    be significant; one cannot (1/6), so that baseline would make every later run inconclusive."""
    bench(pytester, llama_server, runs=5)
    result = run(pytester, "--baseline-update", "--gpubench-runs", "1")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            f"baseline NOT written for {CELL}: too few warm samples ever to be significant against "
            "the cell's runs: P-EASY 1 against 5 (smallest possible p = 0.167 ≥ 0.05) (measure "
            "more warm runs: --gpubench-runs N)"
        ]
    )
    assert not (pytester.path / "baselines" / FILE).exists()
    assert run(pytester, "--baseline-update", "--gpubench-runs", "2").ret == 0
    assert (pytester.path / "baselines" / FILE).exists()


def test_a_corrupt_baseline_is_replaced_by_baseline_update_saying_so(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    bench(pytester, llama_server, runs=5)
    path = pytester.path / "baselines" / FILE
    path.parent.mkdir()
    path.write_text("{not json")
    refused = run(pytester)
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(
        [f"ERROR: *{FILE}: corrupt baseline: not valid JSON*write it again with --baseline-update"]
    )
    replaced = run(pytester, "--baseline-update")
    assert replaced.ret == 0, replaced.stdout.str()
    replaced.stdout.fnmatch_lines(
        [
            f"*{FILE}: corrupt baseline: not valid JSON (line 1, column 2: *): replaced with this "
            "run's numbers",
            f"baseline written: {CELL} -> *{FILE}",
        ]
    )
    assert stored(pytester)["cell_id"] == CELL
    assert run(pytester).ret != pytest.ExitCode.USAGE_ERROR


def test_a_read_only_baselines_directory_is_one_error_and_exit_9(
    pytester: pytest.Pytester,
    llama_server: Path,
    mount_tmpfs: Any,  # noqa: F811
) -> None:
    bench(pytester, llama_server, runs=5)
    mount_tmpfs(pytester.path / "baselines", "ro,size=64k")
    result = run(pytester, "--baseline-update")
    assert result.ret == EXIT_WRITE_FAILED
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output and "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert errors == [
        f"ERROR: {pytester.path / 'baselines' / FILE}: cannot write baseline: Read-only file system"
    ]
    assert result.outlines[-1] == (
        "gpubench: exit status 9: the ledger or a baseline could not be written"
    )
    assert end_record(pytester)["exit_status"] == EXIT_WRITE_FAILED


def _not_finite(value: str) -> float:
    return float(value.replace("Infinity", "inf"))


@pytest.mark.parametrize("value", ["Infinity", "NaN"])
def test_nan_or_infinity_in_a_history_figure_is_one_line_and_exit_4_before_anything_runs(
    pytester: pytest.Pytester, llama_server: Path, value: str
) -> None:
    """Issue 37: with three runs of history, one figure Infinity crashed the session in the
    gate's between-run spread (AttributeError: 'float' object has no attribute 'numerator'),
    with a traceback and no end record; NaN was read as a figure. The frozen-prompts guard reads
    the file first: one line naming the key, exit 4, nothing measured."""
    bench(pytester, llama_server, runs=5)
    assert run(pytester, "--baseline-update").ret == 0
    data = stored(pytester)
    entry = data["prompts"]["P-EASY"]
    first = json.dumps(entry["history"][0])
    entry["history"] = [{**json.loads(first), "benchmark_run_id": f"r{i}"} for i in range(3)]
    metric = sorted(entry["history"][2]["figures"])[0]
    entry["history"][2]["figures"][metric] = _not_finite(value)
    path = pytester.path / "baselines" / FILE
    path.write_text(json.dumps(data, indent=2))
    result = run(pytester)
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output and "INTERNALERROR" not in output, output
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [*result.stdout.lines, *result.stderr.lines]
    assert [line for line in lines if line.startswith("ERROR:")] == [
        f"ERROR: {path}: corrupt baseline: prompts.P-EASY.history[2].figures.{metric}: expected "
        f"a finite number, got float {value}; restore it with `git checkout -- <file>` or write "
        "it again with --baseline-update"
    ]
    assert len(list((pytester.path / "runs").glob("*.jsonl"))) == 1  # the update's only


@pytest.mark.parametrize("value", ["Infinity", "NaN"])
def test_a_baseline_spoilt_with_nan_or_infinity_during_a_run_ends_it_with_its_end_record(
    pytester: pytest.Pytester, llama_server: Path, value: str
) -> None:
    """A baseline read at the session's end (a checkout while the run ran): the calls stay in the
    ledger, the end record says why nothing was judged, exit 4, no traceback."""
    bench(pytester, llama_server, runs=5)
    assert run(pytester, "--baseline-update").ret == 0
    data = stored(pytester)
    data["prompts"]["P-EASY"]["samples"]["first_delta_ms"][1] = _not_finite(value)
    spoilt = pytester.path / "spoilt.json"
    spoilt.write_text(json.dumps(data, indent=2))
    # The guard has read the good file by the time the first case runs.
    pytester.makepyfile(
        test_bench=TEST_FILE + "    import shutil\n"
        f"    shutil.copyfile({str(spoilt)!r}, 'baselines/{FILE}')\n"
    )
    result = run(pytester)
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output and "INTERNALERROR" not in output, output
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    problem = (
        f"{pytester.path / 'baselines' / FILE}: corrupt baseline: "
        f"prompts.P-EASY.samples.first_delta_ms[1]: expected a finite number, got float {value}"
    )
    errors = [line for line in result.stdout.lines if line.startswith("ERROR:")]
    assert errors == [f"ERROR: {problem}; {REPAIR}"]
    end = end_record(pytester)
    assert end["exit_status"] == pytest.ExitCode.USAGE_ERROR
    assert str(end["gate_error"]).startswith(problem)
    assert end["calls"] == 5


def test_a_first_update_in_three_runs_starts_the_engine_again_between_them(
    pytester: pytest.Pytester, llama_server: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43, item 4, on the real llama-server: with --gpubench-baseline-runs 3 a first
    --baseline-update measures P-EASY in two more runs, the managed engine stopped and started
    again before each (a new process: the engine's own speed moves between its runs), and the
    file's history holds the three runs; the calls of each later run follow a warm-up, as the
    planned ones do (their success, their figures present)."""
    from pytest_gpubench.engines.managed import ManagedServer

    restarts: list[int | None] = []
    restart = ManagedServer.restart

    def counted(server: ManagedServer) -> str:
        restarts.append(server.pid)
        return restart(server)

    monkeypatch.setattr(ManagedServer, "restart", counted)
    bench(pytester, llama_server, runs=3)
    result = run(pytester, "--baseline-update", "--gpubench-baseline-runs", "3")
    assert result.ret == 0, result.stdout.str()
    records = read_ledger(max((pytester.path / "runs").glob("*.jsonl")))
    calls = [r for r in records if r.get("type") == "call"]
    assert sorted(r.get("history_run", 0) for r in calls) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(r["error"] is None and r["first_delta_ms"] > 0 for r in calls)
    # Stopped and started again before each later run: two processes replaced.
    assert len(restarts) == 2 and all(pid is not None for pid in restarts)
    assert restarts[0] != restarts[1]
    history = stored(pytester)["prompts"]["P-EASY"]["history"]
    assert [run["benchmark_run_id"].partition("#")[2] for run in history] == ["0", "1", "2"]
