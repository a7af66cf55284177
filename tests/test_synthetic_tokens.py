"""Token-exact synthetic prompts without an engine: the sizes a `synthetic:` key asks for (a
list, or a mean with a spread drawn the same way every time), the cut-to-size loop against a
tokenizer whose words split unevenly, the prompt-count feedback (Ollama's last resort), and bad
keys as one line naming the file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpubench.config.load_profile import Synthetic
from pytest_gpubench.config.prompts import read_prompt_file
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.engines.tokenizer import exact_text, feedback_text


class SplitLongWords:
    """A tokenizer that splits words longer than four letters in two (as BPE splits rare
    words): N words are not N tokens, and a cut may land inside a word."""

    counted_by = "test"

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def _id(self, piece: str) -> int:
        if piece not in self.pieces:
            self.pieces.append(piece)
        return self.pieces.index(piece)

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            parts = [word[:4], "##" + word[4:]] if len(word) > 4 else [word]
            ids += [self._id(part) for part in parts]
        return ids

    def decode(self, ids: list[int]) -> str:
        text = ""
        for piece in (self.pieces[i] for i in ids):
            text += piece[2:] if piece.startswith("##") else " " + piece
        return text

    def chat_tokens(self, text: str) -> int | None:
        return len(self.encode(text)) + 7


@pytest.mark.parametrize("size", [1, 5, 37, 250])
def test_exact_text_has_exactly_the_tokens_asked_for(size: int) -> None:
    counter = SplitLongWords()
    made = exact_text(counter, size, seed=3)
    assert len(counter.encode(made.text)) == size
    assert made.template_tokens == 7 and made.input_tokens == size
    assert exact_text(counter, size, seed=3).text == made.text  # the same on every run


def test_feedback_reaches_the_size_through_the_engine_prompt_count() -> None:
    counter = SplitLongWords()
    asked: list[str] = []

    def prompt_eval_count(text: str) -> int:
        asked.append(text)
        return len(counter.encode(text)) + 11  # Ollama: the templated prompt's count

    made = feedback_text(prompt_eval_count, 60, seed=1)
    assert len(counter.encode(made.text)) == 60
    assert made.template_tokens == 11 and made.counted_by == "prompt count"
    assert len(asked) <= 13


def test_sizes_from_a_list_or_a_mean_and_spread() -> None:
    assert Synthetic(input_tokens=[8, 64], output_tokens=4).sizes == (8, 64)
    assert Synthetic(input_tokens=100, output_tokens=4).sizes == (100,)
    spread = Synthetic(input_tokens=100, output_tokens=4, spread=20, count=50, seed=2)
    sizes = spread.sizes
    assert sizes == spread.sizes and len(sizes) == 50 and min(sizes) >= 1
    assert 80 < sum(sizes) / len(sizes) < 120 and len(set(sizes)) > 10
    assert spread.prompt_id == "synthetic-in100sd20-out4"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "{input_tokens: 0, output_tokens: 4}",
            "prompts.syn.synthetic.input_tokens: Value error, a positive token count, or a non-empty list of them (got 0)",
        ),
        (
            "{input_tokens: [8, 16], output_tokens: 4, spread: 3}",
            "prompts.syn.synthetic: Value error, spread: only with one input_tokens mean*",
        ),
        ("{input_tokens: 8}", "prompts.syn.synthetic.output_tokens: required key is missing"),
        (
            "{input_tokens: [8, -1], output_tokens: 4}",
            "prompts.syn.synthetic.input_tokens: Value error, a positive*",
        ),
        (
            "{input_tokens: 8, output_tokens: 4, words: 3}",
            "prompts.syn.synthetic.words: unknown key*",
        ),
    ],
)
def test_bad_synthetic_keys_are_one_line(tmp_path: Path, entry: str, message: str) -> None:
    import fnmatch

    (tmp_path / "prompts.yaml").write_text(f"prompts:\n  syn: {{synthetic: {entry}}}\n")
    with pytest.raises(GpubenchError) as caught:
        read_prompt_file(tmp_path / "prompts.yaml")
    text = str(caught.value)
    assert fnmatch.fnmatch(text, f"{tmp_path}/prompts.yaml: {message}"), text
