"""A benchmark of its own: prefill of a long prompt, PROMPT_TOKENS tokens long.

" the" repeated is one token per repetition for the embedded tiny model and for the BPE
tokenizers that split words first (Llama 3, Qwen, GPT); the test checks the engine's own count.
The tiny model's context is 2048 tokens: the prompt, its chat template and the answer fit in it.
"""

import pytest

from pytest_gpubench.plugin import BenchEngine

PROMPT_TOKENS = 1536
PROMPT = "Count the words that follow." + " the" * PROMPT_TOKENS


@pytest.mark.gpubench(phases=["cold", "warm"])
def test_long_context_prefill(gpubench_engine: BenchEngine) -> None:
    # llama-server keeps the last prompt's cache: a warm call would prefill only what changed
    # (nothing). Turned off, every call prefills the whole prompt. A request option is part of
    # the test's frozen request, like the messages.
    options = {"cache_prompt": False} if gpubench_engine.cell.spec.engine == "llamacpp" else {}
    call = gpubench_engine.chat(PROMPT, max_tokens=16, **options)
    assert call.error is None, f"{call['case_id']}: {call.error}"
    assert call["prompt_tokens"] >= PROMPT_TOKENS, (
        f"the prompt was {call['prompt_tokens']} tokens, not {PROMPT_TOKENS} or more"
    )
