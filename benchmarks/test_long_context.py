"""A benchmark of its own: prefill of a long prompt, PROMPT_TOKENS tokens long.

" the" repeated is one token per repetition for the embedded tiny model and for the BPE
tokenizers that split words first (Llama 3, Qwen, GPT); the test checks the engine's own count.
The tiny model's context is 2048 tokens: the prompt, its chat template and the answer fit in it.

Every call must prefill the whole prompt, so the engine's prompt cache is turned off wherever a
request can turn it off: `cache_prompt: false` for llama-server, on its native API (`llamacpp`
cells) and on its OpenAI-compatible one (an `openai` cell in front of it, whose warm calls with the
cache left on evaluated 1 of the 1565 prompt tokens). OpenAI-compatible servers without that key
ignore it (vLLM does). vLLM's and SGLang's prefix caches are the server's setting, not
a request's: start them with `--no-enable-prefix-caching` (vLLM) or `--disable-radix-cache` (SGLang)
for warm figures that are a prefill. Ollama reuses the last prompt's cache and has no switch for it:
on an Ollama cell only the cold call, made after the model is unloaded, prefills the whole prompt,
and the warm case is skipped, saying why. Where the engine says how many prompt tokens it evaluated
(llama-server's `timings.prompt_n`), the test checks that it evaluated them all.
"""

from typing import Any

import pytest

from pytest_gpubench.plugin import BenchEngine

PROMPT_TOKENS = 1536
PROMPT = "Count the words that follow." + " the" * PROMPT_TOKENS
# The request keys that turn the prompt cache off, by the cell's engine kind. A request option is
# part of the test's frozen request, like the messages.
NO_PROMPT_CACHE: dict[str, dict[str, Any]] = {
    "llamacpp": {"cache_prompt": False},
    "openai": {"cache_prompt": False},
}
OLLAMA_WARM = (
    "Ollama reuses the last prompt's cache and has no switch for it: a warm call would time a "
    "cached prefill (the cold call, after the model is unloaded, prefills the whole prompt)"
)


@pytest.mark.gpubench(phases=["cold", "warm"])
def test_long_context_prefill(gpubench_engine: BenchEngine) -> None:
    engine = gpubench_engine.cell.spec.engine
    if engine == "ollama" and gpubench_engine.case.phase == "warm":
        pytest.skip(OLLAMA_WARM)
    options = NO_PROMPT_CACHE.get(engine, {})
    call = gpubench_engine.chat(PROMPT, max_tokens=16, **options)
    assert call.error is None, f"{call['case_id']}: {call.error}"
    assert call["prompt_tokens"] >= PROMPT_TOKENS, (
        f"the prompt was {call['prompt_tokens']} tokens, not {PROMPT_TOKENS} or more"
    )
    evaluated = (call["engine_timings"] or {}).get("prompt_n")
    if evaluated is not None:
        assert evaluated >= PROMPT_TOKENS, (
            f"{call['case_id']}: the engine evaluated {evaluated} of {call['prompt_tokens']} "
            "prompt tokens: the rest came from its prompt cache"
        )
