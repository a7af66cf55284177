"""Prompts from a dataset file (`dataset:` in prompts.yaml and in `load:` profiles): ShareGPT-style
JSON/JSONL, OpenAI chat JSONL, plain text lines or a CSV column, filtered by length and sampled
with a seed; each sampled conversation is frozen by the sha256 of what is sent."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from pytest_gpubench.core.errors import GpubenchError

DATASET_FORMATS = ("sharegpt", "openai", "text", "csv")
# max_tokens of a sampled prompt that has no reference answer to size it by (text, csv, a
# conversation that ends with the user) and no `output_tokens` of its own.
DEFAULT_OUTPUT_TOKENS = 128
# ShareGPT's speaker names, as its dumps spell them, to OpenAI roles.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class Dataset(BaseModel):
    """Where a dataset's prompts come from and which of them are sent (vLLM `bench serve`'s
    `--dataset-name sharegpt|custom`, guidellm's `--data`): `count` entries drawn with `seed`
    from those whose prompt and reference answer pass the word-length filters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Annotated[str, Field(min_length=1)]
    format: Literal["sharegpt", "openai", "text", "csv"]
    # The CSV column holding the prompt (csv only).
    column: str | None = None
    seed: int = 0
    count: PositiveInt = 8
    # max_tokens of every request; None: the reference answer's length in words (at least 1),
    # as vLLM's ShareGPT sampling sizes its output by the recorded answer.
    output_tokens: PositiveInt | None = None
    min_input_words: Annotated[int, Field(ge=0)] = 0
    max_input_words: PositiveInt | None = None
    min_output_words: Annotated[int, Field(ge=0)] = 0
    max_output_words: PositiveInt | None = None

    @model_validator(mode="after")
    def _column_for_csv(self) -> Dataset:
        if self.format == "csv" and not self.column:
            raise ValueError("format csv needs `column:` (the CSV column holding the prompt)")
        if self.format != "csv" and self.column is not None:
            raise ValueError(f"column: only for format csv (this dataset is {self.format})")
        return self

    def resolved(self, base: Path) -> Dataset:
        """The same dataset with its path made absolute against `base` (the YAML's folder)."""
        path = Path(self.path).expanduser()
        return self.model_copy(update={"path": str(path if path.is_absolute() else base / path)})


@dataclass(frozen=True)
class DatasetPrompt:
    """One sampled entry: the conversation sent and its max_tokens."""

    index: int  # its position in the file (line or list entry), for messages and records
    messages: tuple[tuple[str, str], ...]  # (role, content), the last one the user's
    max_tokens: int

    @property
    def prompt(self) -> str:
        """The last user turn (what a one-turn engine call sends as `prompt`)."""
        return self.messages[-1][1]

    def chat(self) -> list[dict[str, object]]:
        return [{"role": role, "content": content} for role, content in self.messages]

    def sha256(self) -> str:
        """What is sent, frozen: the conversation and max_tokens."""
        frozen = {"messages": [list(pair) for pair in self.messages], "max_tokens": self.max_tokens}
        return hashlib.sha256(json.dumps(frozen, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class _Entry:
    index: int
    messages: tuple[tuple[str, str], ...]
    answer: str | None


def sample_dataset(dataset: Dataset, where: str) -> list[DatasetPrompt]:
    """The dataset's sampled prompts, in a fixed order for the same file, filters and seed.
    `where` names the YAML key for errors (`prompts.yaml: prompts.chat.dataset`)."""
    path = Path(dataset.path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        reason = "file not found" if isinstance(exc, FileNotFoundError) else exc.strerror
        raise GpubenchError(f"{where}.path: {path}: {reason}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise GpubenchError(
            f"{where}.path: {path}: not UTF-8 text (offset {exc.start}); save it as UTF-8"
        ) from None
    entries = list(_entries(dataset, text, f"{where}.path: {path}"))
    kept = [entry for entry in entries if _passes(dataset, entry)]
    if len(kept) < dataset.count:
        raise GpubenchError(
            f"{where}.count: {dataset.count} asked, but only {len(kept)} of the {len(entries)} "
            f"entries of {path} pass the length filters"
        )
    chosen = sorted(random.Random(dataset.seed).sample(range(len(kept)), dataset.count))
    return [_prompt(dataset, kept[i]) for i in chosen]


def dataset_sha256(prompts: list[DatasetPrompt]) -> str:
    """One hash for all a load case sends: the sampled prompts' hashes in order."""
    return hashlib.sha256("\n".join(p.sha256() for p in prompts).encode()).hexdigest()


def _words(text: str) -> int:
    return len(text.split())


def _passes(dataset: Dataset, entry: _Entry) -> bool:
    words = _words(entry.messages[-1][1])
    if words < max(1, dataset.min_input_words):
        return False
    if dataset.max_input_words is not None and words > dataset.max_input_words:
        return False
    if entry.answer is None:
        return dataset.min_output_words == 0
    answer = _words(entry.answer)
    if answer < dataset.min_output_words:
        return False
    return dataset.max_output_words is None or answer <= dataset.max_output_words


def _prompt(dataset: Dataset, entry: _Entry) -> DatasetPrompt:
    if dataset.output_tokens is not None:
        max_tokens = dataset.output_tokens
    elif entry.answer is not None:
        max_tokens = max(1, _words(entry.answer))
    else:
        max_tokens = DEFAULT_OUTPUT_TOKENS
    return DatasetPrompt(entry.index, entry.messages, max_tokens)


def _entries(dataset: Dataset, text: str, where: str) -> Iterator[_Entry]:
    if dataset.format == "text":
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                yield _Entry(number, (("user", line.strip()),), None)
        return
    if dataset.format == "csv":
        reader = csv.DictReader(io.StringIO(text))
        if dataset.column not in (reader.fieldnames or []):
            known = ", ".join(reader.fieldnames or []) or "none"
            raise GpubenchError(f"{where}: no column '{dataset.column}' (columns: {known})")
        for number, row in enumerate(reader, 2):
            value = (row.get(dataset.column or "") or "").strip()
            if value:
                yield _Entry(number, (("user", value),), None)
        return
    for number, item in _json_items(text, where):
        if dataset.format == "sharegpt":
            yield _sharegpt(number, item, where)
        else:
            yield _openai(number, item, where)


def _json_items(text: str, where: str) -> Iterator[tuple[int, Any]]:
    """(line or entry number, object) of a JSON list or of JSON lines."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GpubenchError(f"{where}: line {exc.lineno}: malformed JSON: {exc.msg}") from None
        yield from enumerate(items, 1)
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise GpubenchError(f"{where}: line {number}: malformed JSON: {exc.msg}") from None


def _conversation(
    number: int, turns: list[tuple[str, str]], where: str
) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """The turns up to the first user turn (with any system turn before it) and the answer
    that follows it, if any: the request vLLM's ShareGPT sampling sends."""
    for i, (role, _content) in enumerate(turns):
        if role == "user":
            answer = (
                turns[i + 1][1] if i + 1 < len(turns) and turns[i + 1][0] == "assistant" else None
            )
            return tuple(turns[: i + 1]), answer
    raise GpubenchError(f"{where}: entry {number}: no user turn")


@dataclass(frozen=True)
class _ChatFormat:
    """Where a chat dataset keeps an entry's turns, what each turn's keys are called, the
    roles it may name (as written, to OpenAI's) and the words of its two errors."""

    name: str
    turns: str
    speaker: str
    text: str
    roles: Mapping[str, str]
    # ShareGPT's speaker names are matched in any case; OpenAI's roles as written.
    folded: bool
    shape: str
    needs: str


SHAREGPT = _ChatFormat(
    "ShareGPT", "conversations", "from", "value", SHAREGPT_ROLES, True,
    "{from, value} turns", "a turn needs `from` (human, gpt or system) and a string `value`",
)  # fmt: skip
OPENAI_CHAT = _ChatFormat(
    "OpenAI chat", "messages", "role", "content",
    {role: role for role in ("system", "user", "assistant")}, False,
    "{role, content}", "a message needs a role (system, user, assistant) and a string content",
)  # fmt: skip


def _turns(number: int, item: Any, where: str, form: _ChatFormat) -> list[tuple[str, str]]:
    """An entry's (role, text) turns, as its format writes them; one line naming the entry
    where it is not one."""
    turns = item.get(form.turns) if isinstance(item, dict) else None
    if not isinstance(turns, list) or not turns:
        raise GpubenchError(
            f"{where}: entry {number}: expected an object with a non-empty `{form.turns}` list "
            f"of {form.shape} ({form.name})"
        )
    pairs: list[tuple[str, str]] = []
    for turn in turns:
        speaker = turn.get(form.speaker) if isinstance(turn, dict) else None
        text = turn.get(form.text) if isinstance(turn, dict) else None
        said = str(speaker).lower() if form.folded else speaker
        role = form.roles.get(said) if isinstance(said, str) else None
        if role is None or not isinstance(text, str):
            raise GpubenchError(
                f"{where}: entry {number}: {form.needs} (got {json.dumps(turn)[:80]})"
            )
        pairs.append((role, text))
    return pairs


def _sharegpt(number: int, item: Any, where: str) -> _Entry:
    messages, answer = _conversation(number, _turns(number, item, where, SHAREGPT), where)
    return _Entry(number, messages, answer)


def _openai(number: int, item: Any, where: str) -> _Entry:
    pairs = _turns(number, item, where, OPENAI_CHAT)
    # The conversation up to its last user turn; an assistant turn after it is the reference.
    last_user = (
        max(i for i, (role, _c) in enumerate(pairs) if role == "user")
        if any(role == "user" for role, _c in pairs)
        else None
    )
    if last_user is None:
        raise GpubenchError(f"{where}: entry {number}: no user message")
    after = pairs[last_user + 1 : last_user + 2]
    answer = after[0][1] if after and after[0][0] == "assistant" else None
    return _Entry(number, tuple(pairs[: last_user + 1]), answer)
