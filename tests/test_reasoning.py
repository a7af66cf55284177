"""Reasoning models measured alike on every engine: a stand-in streams thinking then answer in
vLLM's, llama.cpp's and Ollama's documented formats (tests/support/reasoning_standin.py), with
its timing fixed; time to first token (the first token of any kind), time to first answer
token and the reasoning token count come out the same on the three, single-call and through
the load client."""

from __future__ import annotations

import asyncio
import json

import pytest
from support.reasoning_standin import Script, reasoning_standin

from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.engines import Request
from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.engines.ollama import OllamaEngine
from pytest_gpubench.engines.openai import OpenAIEngine
from pytest_gpubench.measure.call_measurement import CallMeasurement
from pytest_gpubench.run.load.driver import LoadRun, build_target

SCRIPT = Script(delay_s=0.08, gap_s=0.02, reasoning=6, answer=4)
# The stand-in's times: the first token after delay_s, the first answer 6 gaps later. A busy
# shared machine may add a few ms to any one of them; the three must agree within that.
FIRST_MS = SCRIPT.delay_s * 1000
ANSWER_MS = FIRST_MS + SCRIPT.reasoning * SCRIPT.gap_s * 1000
SLACK_MS = 15.0
# This machine is shared: a measurement during which neighbours held both cores is taken again.
ATTEMPTS = 4


def measure_three(base_url: str) -> dict[str, CallMeasurement]:
    return {
        "vllm": OpenAIEngine(base_url, "vllm-r").chat(Request("think", 32), 30.0),
        "llamacpp": LlamaCppEngine(base_url, "r").chat(Request("think", 32), 30.0),
        "ollama": OllamaEngine(base_url, "r").chat(Request("think", 32), 30.0),
    }


def check_alike(measured: dict[str, CallMeasurement]) -> bool:
    """Counts equal (asserted); True when the times also agree (False: measure again)."""
    for engine, m in measured.items():
        assert m.error is None, (engine, m.error)
        assert m.reasoning_tokens == SCRIPT.reasoning, engine
        assert m.answer_tokens == SCRIPT.answer, engine
        assert m.completion_tokens == SCRIPT.reasoning + SCRIPT.answer, engine
        assert m.first_delta_ms is not None and m.first_answer_ms is not None
        # TTFT is the first reasoning token, not the first answer token: never before either.
        assert m.first_delta_ms >= FIRST_MS and m.first_answer_ms >= ANSWER_MS, engine
        assert m.text == "".join(f" word{i}" for i in range(SCRIPT.answer)), engine
    on_time = all(
        m.first_delta_ms is not None
        and m.first_answer_ms is not None
        and m.first_delta_ms < FIRST_MS + SLACK_MS
        and m.first_answer_ms < ANSWER_MS + SLACK_MS
        for m in measured.values()
    )
    if not on_time:
        print(
            "late on a busy machine:",
            {e: (m.first_delta_ms, m.first_answer_ms) for e, m in measured.items()},
        )
    return on_time


def test_ttft_first_answer_and_reasoning_count_are_alike_on_three_formats() -> None:
    for _ in range(ATTEMPTS):
        with reasoning_standin(SCRIPT) as base_url:
            measured = measure_three(base_url)
        if check_alike(measured):
            break
    else:
        pytest.fail(f"never all within {SLACK_MS} ms of the stand-in's times in {ATTEMPTS} tries")
    record = measured["vllm"].to_record()
    assert record["reasoning_tokens"] == SCRIPT.reasoning and record["first_answer_ms"]


@pytest.mark.parametrize("model", ["vllm-r", "r"])
def test_the_load_client_reads_reasoning_the_same_way(model: str) -> None:
    for _ in range(ATTEMPTS):
        with reasoning_standin(SCRIPT) as base_url:
            engine = OpenAIEngine(base_url, model)
            payload = json.dumps(engine.payload(Request("think", 32))).encode()
            target = build_target("openai", base_url, payload, {}, 30.0)
            run = LoadRun(target, LoadProfile(requests=1))

            async def one(run: LoadRun = run) -> None:
                await run.open(1)
                await run.send(run.started_ns, "measured")
                await run.close()

            asyncio.run(one())
        (sent,) = run.sent
        if check_alike({model: sent.measurement}):
            return
    pytest.fail(f"never within {SLACK_MS} ms of the stand-in's times in {ATTEMPTS} tries")


def test_a_model_without_reasoning_has_zero_reasoning_tokens_and_answer_at_ttft() -> None:
    with reasoning_standin(Script(delay_s=0.02, gap_s=0.005, reasoning=0, answer=5)) as base_url:
        measured = measure_three(base_url)
    for engine, m in measured.items():
        assert m.reasoning_tokens == 0 and m.answer_tokens == 5, engine
        assert m.first_answer_ms == m.first_delta_ms, engine
