"""Synthetic prompts given by token counts, before the engine counts them: a seeded text of
`input_tokens` words (engines/tokenizer.py makes it exactly that many tokens on the live cell),
asking for exactly `output_tokens` (ignore_eos)."""

from __future__ import annotations

from pytest_gpubench.config.load_profile import Synthetic
from pytest_gpubench.config.prompts import Prompt, RequestShape
from pytest_gpubench.config.words import WORDS, seeded_words

__all__ = ["WORDS", "synthetic_prompt"]


def synthetic_prompt(synthetic: Synthetic) -> Prompt:
    """The same prompt for the same (input_tokens, output_tokens, seed), on every machine."""
    size = synthetic.sizes[0]
    text = seeded_words(synthetic.seed, size, size)
    return Prompt(
        intent=(
            f"synthetic: {size} input tokens, "
            f"{synthetic.output_tokens} output tokens (seed {synthetic.seed})"
        ),
        prompt=text,
        max_tokens=synthetic.output_tokens,
        request=RequestShape(ignore_eos=True),
    )
