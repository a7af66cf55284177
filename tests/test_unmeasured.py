"""Nothing unmeasured passes: every planned cell ends measured, failed (stage and reason),
skipped on purpose, or missing; a required cell that was not measured fails the session with its
own status (7), against the real llama-server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpubench.core.status import EXIT_UNMEASURED
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.ledger.writer import read_ledger

pytestmark = pytest.mark.engine

PROMPTS = 'prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}\n'
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
GOOD = "  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{url}', runs: 2, phases: [warm]}}\n"
# Each cell that cannot be measured, with the cell id and what the summary says of it.
BAD = {
    "unreachable": (
        "  - {{node: local, engine: llamacpp, model: tiny, name: gone, endpoint: 'http://127.0.0.1:9', runs: 2, phases: [warm]{extra}}}\n",
        "local:llamacpp:tiny@gone",
        "health check failed",
    ),
    "unknown model": (
        "  - {{node: local, engine: openai, model: no-such-model, endpoint: '{url}', runs: 2, phases: [warm]{extra}}}\n",
        "local:openai:no-such-model",
        "health check failed",
    ),
    "unset key variable": (
        "  - {{node: local, engine: openai, model: tiny, endpoint: '{url}', runs: 2, phases: [warm], api_key_env: GPUBENCH_TEST_UNSET_KEY{extra}}}\n",
        "local:openai:tiny",
        "$GPUBENCH_TEST_UNSET_KEY is not set",
    ),
}


def bench(pytester: pytest.Pytester, url: str, bad: str, *, optional: bool = False) -> str:
    template, cell_id, _ = BAD[bad]
    extra = ", optional: true" if optional else ""
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        + GOOD.format(url=url)
        + template.format(url=url, extra=extra),
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    return cell_id


def end_record(pytester: pytest.Pytester) -> dict[str, Any]:
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    return read_ledger(ledger)[-1]


@pytest.mark.parametrize("bad", list(BAD))
def test_a_required_cell_that_cannot_be_measured_fails_the_session(
    pytester: pytest.Pytester,
    server: ManagedLlamaServer,
    bad: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GPUBENCH_TEST_UNSET_KEY", raising=False)
    cell_id = bench(pytester, server.base_url, bad)
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    assert result.ret == EXIT_UNMEASURED
    result.assert_outcomes(passed=2, skipped=2)
    reason = BAD[bad][2]
    result.stdout.fnmatch_lines(
        [
            "cell*status*calls ok*stage*reason*",
            "local:llamacpp:tiny *measured*2/2*",
            f"{cell_id} *failed*0/0*{reason}*",
        ]
    )
    assert result.outlines[-1] == "gpubench: exit status 7: a required cell was not measured"
    end = end_record(pytester)
    assert end["type"] == "end" and end["exit_status"] == EXIT_UNMEASURED
    outcomes = {cell["cell_id"]: cell for cell in end["cells"]}
    assert outcomes["local:llamacpp:tiny"]["status"] == "measured"
    assert outcomes[cell_id]["status"] == "failed" and reason in outcomes[cell_id]["reason"]


@pytest.mark.parametrize("optional", [False, True], ids=["required", "optional"])
def test_pytests_own_lines_show_a_required_cell_that_was_not_measured(
    pytester: pytest.Pytester, server: ManagedLlamaServer, optional: bool
) -> None:
    """pytest printed `..ss` and `2 passed, 2 skipped` on a run that exits 7 (issue 37): the
    cases stay skipped tests, shown as `u` (UNMEASURED with -v) and counted beside pytest's own;
    an optional cell's are plain skips."""
    cell_id = bench(pytester, server.base_url, "unreachable", optional=optional)
    quiet = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    verbose = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-v")
    for result in (quiet, verbose):
        assert result.ret == (0 if optional else EXIT_UNMEASURED)
        result.assert_outcomes(passed=2, skipped=2)
    case = f"test_bench.py::test_generate[[]{cell_id}-P-EASY-warm-0[]]"
    if optional:
        quiet.stdout.fnmatch_lines(["test_bench.py ..ss*"])
        verbose.stdout.fnmatch_lines([f"{case} SKIPPED*"])
        assert "unmeasured" not in quiet.parseoutcomes()
        return
    quiet.stdout.fnmatch_lines(["test_bench.py ..uu*"])
    verbose.stdout.fnmatch_lines([f"{case} UNMEASURED*"])
    # pytest's summary line: `2 passed, 2 skipped, 1 unmeasured in 0.3s`.
    assert quiet.parseoutcomes()["unmeasured"] == 1
    assert quiet.outlines[-1] == "gpubench: exit status 7: a required cell was not measured"


@pytest.mark.parametrize("bad", list(BAD))
def test_the_same_cell_marked_optional_is_listed_as_missing_and_passes(
    pytester: pytest.Pytester,
    server: ManagedLlamaServer,
    bad: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GPUBENCH_TEST_UNSET_KEY", raising=False)
    cell_id = bench(pytester, server.base_url, bad, optional=True)
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    assert result.ret == 0
    result.stdout.fnmatch_lines([f"{cell_id} *missing (optional)*0/0*{BAD[bad][2]}*"])
    # The last line does not claim that every benchmark was measured: it names the missing one.
    assert result.outlines[-1] == (
        f"gpubench: exit status 0: no regression; optional cells not measured: {cell_id}"
    )
    outcomes = {cell["cell_id"]: cell for cell in end_record(pytester)["cells"]}
    assert outcomes[cell_id]["status"] == "missing" and outcomes[cell_id]["optional"] is True


def test_a_cell_whose_every_call_failed_is_not_new_but_failed(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    """A healthy engine that answers every measured call with an error measured nothing."""
    pytester.makefile(
        ".yaml",
        prompts='prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}\n',
        cells="nodes: {local: {kind: local}}\ncells:\n"
        + GOOD.format(url=server.base_url).replace("runs: 2", "runs: 2, timeout_s: 0.000001"),
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    assert result.ret == EXIT_UNMEASURED
    result.stdout.fnmatch_lines(["local:llamacpp:tiny *failed*0/2*benchmark*every call failed*"])


def test_probe_fails_when_a_required_cell_is_unhealthy(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    bench(pytester, server.base_url, "unreachable")
    failing = pytester.runpytest("--force-load", "--probe")
    assert failing.ret == EXIT_UNMEASURED
    failing.stdout.fnmatch_lines(
        ["local:llamacpp:tiny *ok", "local:llamacpp:tiny@gone *health check failed*"]
    )
    bench(pytester, server.base_url, "unreachable", optional=True)
    assert pytester.runpytest("--force-load", "--probe").ret == 0
    assert not (pytester.path / "runs").exists() or not list(
        Path(pytester.path / "runs").glob("*.jsonl")
    )


@pytest.mark.parametrize(
    "option",
    ["--fixtures", "--fixtures-per-test", "--collect-only", "--setup-plan", "--markers", "--help"],
)
def test_a_run_that_measures_nothing_by_design_writes_no_ledger_and_claims_no_status(
    pytester: pytest.Pytester, option: str
) -> None:
    """`pytest --fixtures` wrote a ledger and printed "exit status 7" while pytest exited 0."""
    bench(pytester, "http://127.0.0.1:9", "unreachable")
    result = pytester.runpytest(option, "--force-load", "-p", "no:cacheprovider")
    assert result.ret == 0
    assert not list(pytester.path.glob("runs/*.jsonl"))
    assert "gpubench: exit status" not in result.stdout.str()
