"""The benchmark cases: one measured request per (cell, prompt, phase, run_idx), of the prompt's
request kind (docs/request-kinds.md), and a load case per load point of a cell's `load:` profile.
Each case is checked on the figure its kind has, so that the file holds on any model and kind."""

from pytest_gpubench.plugin import BenchCase

# The kinds answered in one JSON answer, no token generated: an embedding's vectors (one per
# input) and a rerank's ranked documents. How many came back is checked as the answer is read:
# an answer short of its inputs is the call's error.
ONE_ANSWER_KINDS = ("embedding", "rerank")


def test_generate(gpubench_case: BenchCase) -> None:
    call = gpubench_case.run()
    assert call["error"] is None, f"{gpubench_case.case.case_id}: {call['error']}"
    if call["type"] == "load":
        assert call["output_tokens"], "the load case generated no tokens"
        return
    kind = call.get("kind", "chat")
    if kind in ONE_ANSWER_KINDS:
        assert call["inputs"], f"the engine's {kind} answer holds no input"
        assert call["inputs_per_sec"] > 0 and call["total_duration_ms"] > 0
        return
    assert call["completion_tokens"], "the engine reported no completion tokens"
    assert 0 < call["first_delta_ms"] <= call["total_duration_ms"]
