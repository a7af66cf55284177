"""A load point's figures are compared only with a baseline measured under the same settings:
its arrival process, warm-up, SLO, sessions, a sweep's steps and a LoRA mix shape them as much
as its rate does, so a baseline measured under others is `incomparable` (exit 8), naming what
changed, until `--baseline-update` ratifies the new settings. How long a point runs (requests,
duration_s) or who sends it does not make it incomparable: that is its sample's size.

The engine is tests/support/keepalive_server.py (a stand-in OpenAI-style streaming server:
the subject is the gate's bookkeeping, not a model's figures)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from support.keepalive_server import keepalive_server
from test_load import write_load_project

from pytest_gpubench.cli.main import main
from pytest_gpubench.config.load_profile import LoadProfile, LoadThresholds
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.results.load_gate import judge_point

# The subject is the settings' bookkeeping, not the shared machine's steadiness.
# Each open-loop point allows a send lag of 1 s: on a busy shared machine the default 10 ms left
# the first point invalid, so no baseline was written and the changed run was "new", exit 0.
ARGS = ("--force-load", "-p", "no:cacheprovider", "-m", "load", "--gpubench-steadiness", "off")


def newest_ledger(root: Path) -> Path:
    return max((root / "runs").glob("*.jsonl"), key=lambda path: path.stat().st_mtime)


def load_verdicts(root: Path) -> list[dict[str, Any]]:
    (end,) = [r for r in read_ledger(newest_ledger(root)) if r["type"] == "end"]
    return list(end.get("load_verdicts") or [])


def test_a_changed_arrival_is_incomparable_naming_it_until_ratified(
    pytester: pytest.Pytester,
) -> None:
    def run(url: str, load: str, *more: str) -> pytest.RunResult:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', load: {load}}}\n",
        )
        return pytester.runpytest(*ARGS, *more)

    with keepalive_server() as server:
        update = run(
            server.url,
            "{rate: [40], arrival: poisson, requests: 20, max_send_lag_ms: 1000}",
            "--baseline-update",
        )
        assert update.ret == 0, update.stdout.str()[-3000:]
        changed = run(
            server.url, "{rate: [40], arrival: constant, requests: 20, max_send_lag_ms: 1000}"
        )
        # More requests is a larger sample of the same point, not another point.
        longer = run(
            server.url, "{rate: [40], arrival: poisson, requests: 30, max_send_lag_ms: 1000}"
        )
        ratified = run(
            server.url,
            "{rate: [40], arrival: constant, requests: 20, max_send_lag_ms: 1000}",
            "--baseline-update",
        )
        assert ratified.ret == 0, ratified.stdout.str()[-3000:]
        again = run(
            server.url, "{rate: [40], arrival: constant, requests: 20, max_send_lag_ms: 1000}"
        )
    assert changed.ret == 8, changed.stdout.str()[-3000:]
    changed.stdout.fnmatch_lines(
        [
            "*local:openai:m P-EASY@load-r40: the load settings changed since the load baseline"
            " was measured (arrival poisson → constant): ratify them with --baseline-update*"
        ]
    )
    assert "incomparable" not in {v["verdict"] for v in load_verdicts(pytester.path)}
    for result in (longer, again):
        assert result.ret != 8 and "load settings changed" not in result.stdout.str()


def test_gpubench_gate_judges_the_changed_settings_as_the_session_did(
    pytester: pytest.Pytester,
) -> None:
    with keepalive_server() as server:
        for arrival, more in (("poisson", ("--baseline-update",)), ("constant", ())):
            write_load_project(
                pytester,
                f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
                f" load: {{rate: [40], arrival: {arrival}, requests: 20,"
                " max_send_lag_ms: 1000}}\n",
            )
            result = pytester.runpytest(*ARGS, *more)
    assert result.ret == 8, result.stdout.str()[-3000:]
    ledger, baselines = newest_ledger(pytester.path), str(pytester.path / "baselines")
    assert main(["gate", str(ledger), "--baselines", baselines]) == 8


def test_a_load_point_whose_request_changed_fails_the_run_with_exit_8(
    pytester: pytest.Pytester,
) -> None:
    """It was printed INCOMPARABLE and the run still exited 0: only the warm verdicts counted."""
    with keepalive_server() as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {concurrency: [2], requests: 10}}\n",
        )
        assert pytester.runpytest(*ARGS, "--baseline-update").ret == 0
        prompts = (pytester.path / "prompts.yaml").read_text()
        (pytester.path / "prompts.yaml").write_text(
            prompts.replace("max_tokens: 8", "max_tokens: 9")
        )
        result = pytester.runpytest(*ARGS)
    assert result.ret == 8, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(
        ["INCOMPARABLE: local:openai:m P-EASY@load-c2: the request changed since the load*"]
    )


def point(settings: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    throughput, ttft = [1000.0 + i for i in range(10)], [10.0 + i / 10 for i in range(20)]
    record: dict[str, Any] = {
        "type": "load", "cell_id": "c", "prompt_id": "P", "prompt_sha256": "s",
        "load_point": "r40", "pattern": "open", "valid": True,
        "output_tokens_per_sec": statistics.median(throughput), "ttft_ms_p99": max(ttft),
        "tpot_ms_p99": 2.0, "slo": None,
        "samples": {"output_tokens_per_sec": throughput, "ttft_ms": ttft, "tpot_ms": [2.0] * 20},
    }  # fmt: skip
    if settings is not None:
        record["load_settings"] = settings
    return {**record, **extra}


def shaping(**keys: Any) -> dict[str, Any]:
    return LoadProfile.model_validate(keys).shaping(open_loop=True, sweep=True, adapters=False)


@pytest.mark.parametrize(
    ("before", "after", "said"),
    [
        ({"warmup_s": 0}, {"warmup_s": 5}, "warmup_s 0 → 5"),
        ({}, {"slo": {"ttft_ms": 200}}, "slo unset → {ttft_ms: 200, attainment: 0.99}"),
        ({"arrival": "gamma"}, {"arrival": "gamma", "burstiness": 0.5}, "burstiness 1 → 0.5"),
        ({"turns": 2}, {"turns": 3}, "turns 2 → 3"),
        (
            {"sweep": {"rates": 3}},
            {"sweep": {"rates": 3, "up_to": 2}},
            "sweep {rates: 3, max_concurrency: 16, up_to: 1} → {rates: 3, max_concurrency: 16,"
            " up_to: 2}",
        ),
    ],
)
def test_each_setting_that_shapes_the_figures_makes_the_point_incomparable(
    before: dict[str, Any], after: dict[str, Any], said: str
) -> None:
    (verdict,) = judge_point(point(shaping(**after)), point(shaping(**before)), LoadThresholds())
    assert verdict.verdict == "incomparable"
    assert f"({said})" in verdict.message


def test_what_only_sizes_or_sends_the_point_leaves_it_comparable() -> None:
    base = shaping(requests=20, seed=1, processes=1, max_send_lag_ms=10)
    other = shaping(duration_s=30, seed=2, processes=4, max_send_lag_ms=50, slice_s=5)
    assert base == other
    verdicts = judge_point(point(other), point(base), LoadThresholds())
    assert {v.verdict for v in verdicts} == {"ok"}


def test_a_baseline_written_before_settings_were_kept_is_judged_as_before() -> None:
    verdicts = judge_point(point(shaping(arrival="constant")), point(None), LoadThresholds())
    assert {v.verdict for v in verdicts} == {"ok"}
    # A hand-edited baseline whose settings are not a mapping says nothing either.
    odd = point("poisson")  # type: ignore[arg-type]
    assert {v.verdict for v in judge_point(point(shaping()), odd, LoadThresholds())} == {"ok"}


def test_a_sweeps_saturation_rate_is_incomparable_under_other_sweep_settings() -> None:
    sweep = {"pattern": "sweep", "saturation_rate": 40.0, "load_point": "sweep"}
    baseline = point(shaping(sweep={"rates": 3}), **sweep)
    current = point(shaping(sweep={"rates": 5}), **sweep)
    (verdict,) = judge_point(current, baseline, LoadThresholds())
    assert verdict.verdict == "incomparable" and verdict.metric == "load_saturation_rate"
    assert "rates: 3, " in verdict.message and "rates: 5, " in verdict.message


def test_ratified_settings_start_the_points_history_afresh() -> None:
    """The between-run spread of a point is of runs under one request and one set of settings:
    runs measured under the old ones would widen it by the change itself (issue 37's blinding)."""
    from pytest_gpubench.results.load_gate import baseline_point

    first = baseline_point(point(shaping(), benchmark_run_id="r1"))
    second = baseline_point(point(shaping(), benchmark_run_id="r2"), first)
    assert [run["benchmark_run_id"] for run in second["history"]] == ["r1", "r2"]
    changed = point(shaping(arrival="constant"), benchmark_run_id="r3")
    assert [run["benchmark_run_id"] for run in baseline_point(changed, second)["history"]] == ["r3"]
    reworded = point(shaping(), benchmark_run_id="r3", prompt_sha256="t")
    assert [r["benchmark_run_id"] for r in baseline_point(reworded, second)["history"]] == ["r3"]


@pytest.mark.parametrize("deep", [{}, []], ids=["object", "list"])
def test_a_baseline_setting_nested_thousands_deep_is_shown_cut_short(deep: Any) -> None:
    """A baseline edited by hand whose SLO nests 3000 levels: the point is incomparable, its
    message says so with the deep part cut short, never a RecursionError."""
    nested: Any = deep
    for _ in range(3000):
        nested = {"k": nested} if isinstance(deep, dict) else [nested]
    baseline = {**shaping(), "slo": {"ttft_ms": nested}}
    (verdict,) = judge_point(point(shaping()), point(baseline), LoadThresholds())
    assert verdict.verdict == "incomparable"
    assert "slo {ttft_ms: " in verdict.message and "…" in verdict.message
