"""The run-time half of workloads: token-exact synthetic prompts made on a live cell (through
its engine's tokenizer, once per size) and the facts their call records carry."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pytest_gpubench.config.prompts import Prompt
from pytest_gpubench.config.traces import Trace, TraceEntry
from pytest_gpubench.engines import CountsTokens, Request
from pytest_gpubench.engines.tokenizer import (
    ExactText,
    LocalCounter,
    TokenCounter,
    TokenizeUnavailable,
    exact_text,
    feedback_text,
)
from pytest_gpubench.ledger.schema import SyntheticFields

if TYPE_CHECKING:
    from pytest_gpubench.run.live_cell import LiveCell


def token_counter(live: LiveCell) -> TokenCounter | None:
    """The cell's tokenizer: the one its `tokenizer:` names, else its engine's /tokenize
    (llama-server; an OpenAI-compatible engine, vLLM's), else None (prompt count feedback)."""
    spec = live.cell.spec
    if spec.tokenizer is not None:
        return LocalCounter(Path(spec.tokenizer).expanduser())
    engine = live.engine
    return engine.token_counter() if isinstance(engine, CountsTokens) else None


def exact(live: LiveCell, size: int, seed: int) -> ExactText:
    """The text of exactly `size` tokens for this cell (counted once, then kept)."""
    known = live.exact_texts.get((size, seed))
    if known is not None:
        return known  # type: ignore[no-any-return]
    counter = token_counter(live)
    made: ExactText | None = None
    if counter is not None:
        try:
            made = exact_text(counter, size, seed)
        except TokenizeUnavailable:
            made = None  # an OpenAI-compatible engine without /tokenize: feedback below
    if made is None:
        made = feedback_text(lambda text: _prompt_count(live, text), size, seed)
    live.exact_texts[(size, seed)] = made
    return made


def _prompt_count(live: LiveCell, text: str) -> int | None:
    """The engine's own prompt token count of a one-turn chat of `text` (Ollama's
    prompt_eval_count, usage.prompt_tokens elsewhere)."""
    return live.request(Request(text, 1, live.cell.spec.request)).prompt_tokens


def exact_prompt(live: LiveCell, prompt: Prompt) -> tuple[Prompt, SyntheticFields]:
    """A synthetic prompt with its exact text, and its call records' facts."""
    assert prompt.synthetic is not None
    size = prompt.synthetic.sizes[0]
    made = exact(live, size, prompt.synthetic.seed)
    return prompt.model_copy(update={"prompt": made.text}), exact_facts(made)


def exact_facts(made: ExactText) -> SyntheticFields:
    """What a call record says of a synthetic prompt: the tokens asked for, what the chat
    template adds (usage's prompt_tokens should read their sum), and who counted them."""
    return {
        "input_tokens_requested": made.input_tokens,
        "template_tokens": made.template_tokens,
        "tokens_counted_by": made.counted_by,
    }


# Seeds of a trace's hash_id blocks start here (the prompts' own seeds are small numbers).
BLOCK_SEED = 1 << 20


def trace_texts(live: LiveCell, trace: Trace, entries: list[TraceEntry]) -> list[str]:
    """Each trace request's prompt: its hash_id blocks, each a seeded text of `block_tokens`
    tokens (the same block for the same id, so requests that shared a prefix in the trace share
    it here), the last block cut to the request's input length; a request without hash_ids
    (BurstGPT) a text of its own of its input length."""
    texts = []
    for index, entry in enumerate(entries):
        if not entry.hash_ids:
            texts.append(exact(live, entry.input_tokens, BLOCK_SEED + index).text)
            continue
        parts = []
        left = entry.input_tokens
        for block in entry.hash_ids:
            if left <= 0:
                break
            size = min(trace.block_tokens, left)
            parts.append(exact(live, size, -BLOCK_SEED - block).text)
            left -= size
        if left > 0:  # more input than its blocks cover: the rest its own
            parts.append(exact(live, left, BLOCK_SEED + index).text)
        texts.append("\n".join(parts))
    return texts
