"""Token-exact synthetic prompts: text of exactly N tokens of the model's own tokenizer, counted
through the engine's `/tokenize` (llama-server, vLLM), a tokenizer file the cell names, or, as
the last resort, the engine's own prompt count fed back (Ollama's `prompt_eval_count`); and the
chat template's overhead, the tokens a chat request adds around the text, reported apart."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from pytest_gpubench.config.words import WORDS, seeded_words
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.measure.stream import joined_url

# Rounds of cutting or adding tokens before a count is given up as not reachable (a word split
# differently at the cut moves the count by one or two; more than this is a tokenizer that does
# not round-trip).
ROUNDS = 12
# Where the cut of the seeded text starts, at most this many tokens in.
OFFSETS = 16
CONTROL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ExactText:
    """A text of `input_tokens` tokens, and what a chat request adds around it."""

    text: str
    input_tokens: int
    # Tokens the chat template adds (role markers, BOS, the generation prompt): a chat request
    # of this text reads input_tokens + template_tokens. None where nothing could say.
    template_tokens: int | None
    # How the tokens were counted: "engine /tokenize", "tokenizer <path>", "prompt count".
    counted_by: str


class TokenCounter(Protocol):
    """The model's tokenizer, as some source exposes it."""

    counted_by: str

    def encode(self, text: str) -> list[int]:
        """The token ids of `text` alone (no BOS, no template)."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_tokens(self, text: str) -> int | None:
        """The prompt tokens of a chat request with `text` as its one user turn, or None."""
        ...


class _Http:
    def __init__(self, base_url: str, headers: Mapping[str, str], verify: Any = True) -> None:
        # Not httpx's base_url: it would put the endpoint's query before the path.
        self.base_url = base_url
        self.client = httpx.Client(headers=dict(headers), timeout=CONTROL_TIMEOUT_S, verify=verify)

    def post(self, path: str, body: dict[str, object]) -> dict[str, Any]:
        try:
            response = self.client.post(joined_url(self.base_url, path), json=body)
        except httpx.HTTPError as exc:
            raise TokenizeUnavailable(f"{path}: {exc}") from None
        if response.status_code != 200:
            raise TokenizeUnavailable(f"{path}: HTTP {response.status_code}")
        data = response.json()
        if not isinstance(data, dict):
            raise TokenizeUnavailable(f"{path}: not a JSON object")
        return data


class TokenizeUnavailable(Exception):
    """The source cannot count tokens (no such endpoint, an error): the next one is tried."""


class LlamaCppCounter(_Http):
    """llama-server's /tokenize, /detokenize and /apply-template (tools/server/README.md)."""

    counted_by = "engine /tokenize"

    def encode(self, text: str) -> list[int]:
        tokens = self.post("/tokenize", {"content": text, "add_special": False})["tokens"]
        return [int(token) for token in tokens]

    def decode(self, ids: list[int]) -> str:
        return str(self.post("/detokenize", {"tokens": ids})["content"])

    def chat_tokens(self, text: str) -> int | None:
        messages = [{"role": "user", "content": text}]
        prompt = self.post("/apply-template", {"messages": messages})["prompt"]
        # As the server tokenizes a chat prompt: BOS added, the template's markers parsed.
        body = {"content": prompt, "add_special": True, "parse_special": True}
        return len(self.post("/tokenize", body)["tokens"])


class VllmCounter(_Http):
    """vLLM's /tokenize and /detokenize (its OpenAI-compatible server's tokenizer endpoints;
    a chat /tokenize applies the model's chat template with the generation prompt)."""

    counted_by = "engine /tokenize"

    def __init__(
        self, base_url: str, model: str, headers: Mapping[str, str], verify: Any = True
    ) -> None:
        super().__init__(base_url, headers, verify)
        self.model = model

    def encode(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return [int(token) for token in self.post("/tokenize", body)["tokens"]]

    def decode(self, ids: list[int]) -> str:
        return str(self.post("/detokenize", {"model": self.model, "tokens": ids})["prompt"])

    def chat_tokens(self, text: str) -> int | None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "add_generation_prompt": True,
        }
        return int(self.post("/tokenize", body)["count"])


class LocalCounter:
    """A tokenizer file the cell names (`tokenizer:`): a tokenizer.json, or a model folder
    holding one (and its chat template, chat_template.jinja or tokenizer_config.json's)."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise GpubenchError(
                f"tokenizer: {path}: counting tokens with a local tokenizer needs the "
                "`tokenizers` package (pip install tokenizers)"
            ) from None
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:
            raise GpubenchError(f"tokenizer: {file}: not a tokenizer.json ({exc})") from None
        self.counted_by = f"tokenizer {file}"
        self.template, self.special = _chat_template(folder)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))

    def chat_tokens(self, text: str) -> int | None:
        if self.template is None:
            return None
        import jinja2

        rendered = (
            jinja2.Environment()
            .from_string(self.template)
            .render(
                messages=[{"role": "user", "content": text}],
                add_generation_prompt=True,
                **self.special,
            )
        )
        return len(self.tokenizer.encode(rendered, add_special_tokens=False).ids)


def _chat_template(folder: Path) -> tuple[str | None, dict[str, str]]:
    """The folder's chat template and the special tokens it may name (bos_token, eos_token)."""
    special: dict[str, str] = {}
    template: str | None = None
    config = folder / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        for key in ("bos_token", "eos_token"):
            if isinstance(data.get(key), str):
                special[key] = data[key]
        if isinstance(data.get("chat_template"), str):
            template = data["chat_template"]
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template, special


def exact_text(counter: TokenCounter, size: int, seed: int) -> ExactText:
    """A text of exactly `size` tokens by `counter`: the seeded words' first `size` token ids,
    decoded, cut or grown until the decoded text counts `size` again."""
    source = seeded_words(seed, size, size * 2 + 16)
    ids = counter.encode(source)
    while len(ids) < size + ROUNDS + OFFSETS:
        source += " " + seeded_words(seed + len(ids), size, size + 16)
        ids = counter.encode(source)
    # A cut may fall where decoding and encoding again merge or split tokens, and the count
    # swing between size - 1 and size + 1: then the window starts a token later and tries again.
    for start in range(OFFSETS):
        window = ids[start:]
        take, tried = size, set()
        for _ in range(ROUNDS):
            if take in tried or take > len(window):
                break
            tried.add(take)
            text = counter.decode(window[:take]).strip()
            got = len(counter.encode(text))
            if got == size:
                return ExactText(text, size, _overhead(counter, text, size), counter.counted_by)
            take = max(1, take + size - got)
    raise GpubenchError(
        f"synthetic: no text of exactly {size} tokens found ({counter.counted_by}): the "
        "tokenizer does not round-trip its own tokens"
    )


def _overhead(counter: TokenCounter, text: str, size: int) -> int | None:
    chat = counter.chat_tokens(text)
    return None if chat is None else chat - size


def feedback_text(prompt_tokens: Callable[[str], int | None], size: int, seed: int) -> ExactText:
    """The last resort (Ollama): words added or cut until the engine's own prompt count of a
    chat request says `size` plus the template's overhead, that overhead read from a one-word
    request (a common word, one token in the common tokenizers)."""
    one = prompt_tokens(WORDS[0])
    if one is None:
        raise GpubenchError(
            f"synthetic: the engine reports no prompt token count, and no tokenizer counts "
            f"{size} tokens: name one with the cell's `tokenizer:` (a tokenizer.json)"
        )
    overhead = one - 1
    words = seeded_words(seed, size, size * 2 + 16).split()
    take = size
    for _ in range(ROUNDS):
        text = " ".join(words[:take])
        got = (prompt_tokens(text) or 0) - overhead
        if got == size:
            return ExactText(text, size, overhead, "prompt count")
        take = max(1, min(len(words), take + size - got))
    raise GpubenchError(
        f"synthetic: the engine's prompt count never read {size} tokens plus the template's "
        f"{overhead}: name a tokenizer with the cell's `tokenizer:`"
    )
