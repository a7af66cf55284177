"""A benchmark that is a correctness test too: the answer must be a JSON object.

Measured, recorded and gated like the others; and the test fails, saying why, when the answer
does not parse. The embedded tiny model answers noise, never JSON: on it the test is expected to
fail (xfail, strict: the day it passes, that is reported too); `--runxfail` shows the failure.
The expectation follows the model (`model: tiny`), whatever the cell's engine kind, node or name:
an `openai` cell in front of the same llama-server expects the same failure.
On an engine with a JSON mode, add it as a request option, e.g.
`gpubench_engine.chat(MESSAGES, max_tokens=32, response_format={"type": "json_object"})`
(the tiny model's vocabulary cannot satisfy llama-server's JSON grammar: it answers HTTP 400).
"""

import json

import pytest

from pytest_gpubench.plugin import BenchEngine

MESSAGES = [
    {"role": "system", "content": "Answer with one JSON object and nothing else."},
    {"role": "user", "content": 'What is the capital of France? Answer as {"city": "..."}.'},
]
# The embedded default's model name (cells.yaml `model: tiny`), on any engine kind.
TINY_MODEL = "tiny"


@pytest.mark.gpubench(phases=["warm"], runs=5)
def test_json_answer(gpubench_engine: BenchEngine, request: pytest.FixtureRequest) -> None:
    if gpubench_engine.cell.spec.model == TINY_MODEL:
        request.applymarker(
            pytest.mark.xfail(strict=True, reason="the embedded tiny model never answers JSON")
        )
    call = gpubench_engine.chat(MESSAGES, max_tokens=32)
    assert call.error is None, f"{call['case_id']}: {call.error}"
    answer, problem = None, None
    try:
        answer = json.loads(call.text)
    except json.JSONDecodeError as exc:
        problem = f"{exc.msg}, at character {exc.pos}"
    if problem is not None:
        pytest.fail(
            f"{call['case_id']}: the answer is not JSON ({problem}): {call.text[:120]!r}",
            pytrace=False,
        )
    assert isinstance(answer, dict) and "city" in answer, f"no 'city' in the answer: {answer!r}"
