"""A benchmark that judges the answer too: is it a JSON object with a `city`?

The answer is judged against ANSWER_SCHEMA, and its validity is a figure, not a failed test: each
call is recorded with `schema_valid` (1 or 0), the terminal shows `5/5 schema valid` (or `0/5`),
and the gate judges the rate like a json_schema prompt's (docs/request-kinds.md): a fall from the
baseline's rate that is significant, or a rate below the cell's floor (`thresholds:
{schema_valid_rate: 0.95}`), is a regression. A model that answers in prose is measured and its
numbers ratified like any other (`pytest benchmarks/ --baseline-update`), its rate 0; the embedded
tiny model answers noise, never JSON: 0/5.

The request is plain chat, which every engine takes. To hold the answer to the schema as well, add
the engine's JSON mode as a request option (a changed request, under a new test name), e.g.
`response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema":
ANSWER_SCHEMA}}` on vLLM or a llama-server whose chat template allows it (the tiny model's does
not: llama-server answers HTTP 400), or Ollama's `format=ANSWER_SCHEMA`.
"""

import pytest

from pytest_gpubench.plugin import BenchEngine

MESSAGES = [
    {"role": "system", "content": "Answer with one JSON object and nothing else."},
    {"role": "user", "content": 'What is the capital of France? Answer as {"city": "..."}.'},
]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


@pytest.mark.gpubench(phases=["warm"], runs=5)
def test_json_answer(gpubench_engine: BenchEngine) -> None:
    call = gpubench_engine.chat(MESSAGES, max_tokens=32, answer_schema=ANSWER_SCHEMA)
    assert call.error is None, f"{call['case_id']}: {call.error}"
    assert call["completion_tokens"], "the engine reported no completion tokens"
    assert call["schema_valid"] in (0, 1)
