"""A benchmark of its own: the third turn of a chat, the conversation so far sent whole.

The earlier answers are written out, not taken from the model: the request, and so what is
measured, is the same on every run. (The test's name is its id in the ledger and the baselines,
frozen by the hash of what it sends: a request built from the model's own answers would change
whenever an answer did.)
"""

import pytest

from pytest_gpubench.plugin import BenchEngine

CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name a planet with rings."},
    {"role": "assistant", "content": "Saturn."},
    {"role": "user", "content": "How many moons does it have?"},
    {"role": "assistant", "content": "Saturn has 146 known moons."},
    {"role": "user", "content": "Which of them is the largest, and why is it unusual?"},
]


@pytest.mark.gpubench(phases=["warm"])
def test_three_turn_chat(gpubench_engine: BenchEngine) -> None:
    call = gpubench_engine.chat(CONVERSATION, max_tokens=64)
    assert call.error is None, f"{call['case_id']}: {call.error}"
    assert call["completion_tokens"], "the engine reported no completion tokens"
    assert call.text, "the engine answered no text"
