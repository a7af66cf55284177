"""The benchmark cases: one streamed generation per (cell, prompt, phase, run_idx), and a load
case per load point of a cell's `load:` profile."""

from pytest_gpubench.plugin import BenchCase


def test_generate(gpubench_case: BenchCase) -> None:
    call = gpubench_case.run()
    assert call["error"] is None, f"{gpubench_case.case.case_id}: {call['error']}"
    if call["type"] == "load":
        assert call["output_tokens"], "the load case generated no tokens"
        return
    assert call["completion_tokens"], "the engine reported no completion tokens"
    assert 0 < call["first_delta_ms"] <= call["total_duration_ms"]
