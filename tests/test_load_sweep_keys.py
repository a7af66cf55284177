"""Sweep steps named by their place for the gate, and the saturation rate judged on the
throughput threshold (pure parts; the whole run is tests/test_load_sweep_gate.py)."""

from __future__ import annotations

from pathlib import Path

from pytest_gpubench.config.load_profile import LoadThresholds
from pytest_gpubench.results.load_baseline import read_load_baseline, write_load_baselines
from pytest_gpubench.results.load_gate import judge_loads, point_key

CELL = "local:openai:m"


def sweep(saturation: float | None) -> dict[str, object]:
    return {
        "type": "load", "cell_id": CELL, "prompt_id": "P", "load_point": "sweep",
        "pattern": "sweep", "saturation_rate": saturation, "prompt_sha256": "s",
        "error": None if saturation else "no step of the sweep was a valid result",
    }  # fmt: skip


def test_a_step_is_named_by_its_place_not_its_rate() -> None:
    step = {"prompt_id": "P", "load_point": "sweep-r12.5", "sweep_step": "s1"}
    assert point_key(step) == "P@load-sweep-s1"
    assert point_key({"prompt_id": "P", "load_point": "c4"}) == "P@load-c4"
    assert point_key(sweep(3.0)) == "P@load-sweep"


def test_the_saturation_rate_is_judged_on_the_throughput_threshold(tmp_path: Path) -> None:
    notes = write_load_baselines(tmp_path, [sweep(10.0), sweep(None) | {"cell_id": "other"}])
    assert (
        "load baseline NOT written for other P@load-sweep: no step of the sweep was a valid result"
        in notes
    )
    baselines = {CELL: read_load_baseline(tmp_path, CELL)}
    assert baselines[CELL]["P@load-sweep"]["saturation_rate"] == 10.0
    thresholds = {CELL: LoadThresholds(throughput=0.3)}

    def verdict(saturation: float | None) -> tuple[str, str]:
        (found,) = judge_loads([sweep(saturation)], baselines, thresholds)
        return found.verdict, found.message

    assert verdict(6.0) == (
        "regression",
        f"{CELL} P@load-sweep: saturation rate -40.0% (10 → 6 req/s), past the 30% threshold",
    )
    assert verdict(9.0)[0] == "ok"
    assert verdict(15.0)[0] == "win"
    assert verdict(None) == (
        "inconclusive",
        f"{CELL} P@load-sweep: saturation rate: not found (no step of the sweep was a valid result)",
    )
    (new,) = judge_loads([sweep(5.0)], {}, thresholds)
    assert new.verdict == "new" and new.metric == "load_saturation_rate"
