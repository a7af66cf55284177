"""The frozen prompts of prompts.yaml (a prompt's text or turns, its max_tokens, the request keys
it adds), a dataset entry's sampled prompts, synthetic ones by token counts, and the rule that a
shipped prompt never changes under its id."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError

from pytest_gpubench.config.datasets import Dataset, DatasetPrompt, sample_dataset
from pytest_gpubench.config.load_profile import Synthetic
from pytest_gpubench.config.words import seeded_words
from pytest_gpubench.config.yaml_file import one_line_errors, read_yaml_mapping
from pytest_gpubench.core.errors import GpubenchError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RequestShape(_Strict):
    """What a chat request asks for beyond the prompt (a cell's `request`, a prompt's
    `request`; the prompt's keys win). Unset keys are left out of the request, except
    temperature, which is 0 unless set."""

    temperature: Annotated[float, Field(ge=0.0)] | None = None
    seed: int | None = None
    # A fixed output length: keep generating past the end-of-sequence token, or at least this many.
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    # Merged into the request's JSON body last (engine-specific fields).
    extra_body: dict[str, Any] | None = None
    # vLLM's per-request `cache_salt`: `per_call` gives each call a salt of its own, so that no
    # call finds the prefix cache an earlier one left (a warm call then prefills its prompt).
    cache_salt: Literal["per_call"] | None = None

    def merged(self, over: RequestShape | None) -> RequestShape:
        """These keys with `over`'s set keys on top."""
        if over is None:
            return self
        return RequestShape(
            **{**self.model_dump(exclude_none=True), **over.model_dump(exclude_none=True)}
        )

    @property
    def temperature_or_default(self) -> float:
        return 0.0 if self.temperature is None else self.temperature

    def changed_keys(self) -> dict[str, Any]:
        """The keys that change the request from the default one (temperature 0, nothing else):
        what the frozen prompt hash covers, so that a baseline measured before these keys
        existed keeps its hash."""
        keys = self.model_dump(exclude_none=True)
        if keys.get("temperature") == 0:
            del keys["temperature"]
        return keys


class ChatTurn(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class Prompt(_Strict):
    intent: str
    prompt: Annotated[str, Field(min_length=1)]
    max_tokens: PositiveInt
    request: RequestShape | None = None
    # A whole conversation sent in place of `prompt` alone (a dataset's entry with a system
    # turn); `prompt` is then its last user turn.
    messages: tuple[ChatTurn, ...] | None = None
    # A token-exact synthetic prompt of one size: `prompt` holds word text until the live cell
    # counts the exact text through the engine (run/workloads.py); frozen at that point.
    synthetic: Synthetic | None = None

    def chat_messages(self) -> list[dict[str, Any]] | None:
        """The conversation to send, or None where `prompt` is sent as one user turn."""
        if self.messages is None:
            return None
        return [turn.model_dump() for turn in self.messages]

    def sha256(self, request: RequestShape | None = None) -> str:
        """The frozen hash: the text and max_tokens, plus the request keys that change what is
        measured (`request`, the effective one) only where some are set: a prompt measured
        with the default request keeps the hash it had before request keys existed. A
        conversation's turns join the hash only where there are some, for the same reason."""
        frozen: dict[str, Any] = {"prompt": self.prompt, "max_tokens": self.max_tokens}
        if self.messages is not None:
            frozen["messages"] = self.chat_messages()
        changed = request.changed_keys() if request is not None else {}
        if changed:
            frozen["request"] = changed
        canonical = json.dumps(frozen, sort_keys=True).encode()
        return hashlib.sha256(canonical).hexdigest()


class _PromptsFile(_Strict):
    prompts: dict[str, Prompt]


class DatasetEntry(_Strict):
    """A prompts.yaml entry that names a dataset: it stands for `count` prompts, one case each,
    with ids `<id>#<entry>` (the entry's line or position in the file)."""

    intent: str = ""
    dataset: Dataset
    request: RequestShape | None = None


class _DatasetPromptsFile(_Strict):
    prompts: dict[str, DatasetEntry]


class SyntheticEntry(_Strict):
    """A prompts.yaml entry of token-exact synthetic prompts: one prompt per input size, with
    ids `<id>#in<N>`."""

    intent: str = ""
    synthetic: Synthetic


class _SyntheticPromptsFile(_Strict):
    prompts: dict[str, SyntheticEntry]


def synthetic_entry_prompt(key: str, intent: str, synthetic: Synthetic, size: int) -> Prompt:
    """One size of a synthetic entry, its text still words (made exact on the live cell)."""
    one = synthetic.model_copy(update={"input_tokens": size, "spread": None})
    return Prompt(
        intent=f"{intent or key}: {size} input tokens, {synthetic.output_tokens} output",
        prompt=seeded_words(synthetic.seed, size, size),
        max_tokens=synthetic.output_tokens,
        request=RequestShape(ignore_eos=True),
        synthetic=one,
    )


def dataset_prompt(
    group: str, entry: DatasetEntry | None, item: DatasetPrompt, dataset: Dataset
) -> Prompt:
    """One sampled entry of a dataset as a frozen prompt."""
    intent = entry.intent if entry is not None and entry.intent else f"dataset {group}"
    turns = tuple(ChatTurn(role=role, content=content) for role, content in item.messages)  # type: ignore[arg-type]
    return Prompt(
        intent=f"{intent} ({Path(dataset.path).name} entry {item.index})",
        prompt=item.prompt,
        max_tokens=item.max_tokens,
        request=entry.request if entry is not None else None,
        messages=turns if len(turns) > 1 else None,
    )


def read_prompts(path: Path) -> dict[str, Prompt]:
    return read_prompt_file(path)[0]


def read_prompt_file(path: Path) -> tuple[dict[str, Prompt], dict[str, tuple[str, ...]]]:
    """The prompts of prompts.yaml, a dataset entry's sampled ones in its place, and
    {dataset entry id: its prompts' ids}."""
    raw = read_yaml_mapping(path, "a mapping with a 'prompts' key")
    if raw.get("prompts") is None and "prompts" in raw:
        raise GpubenchError(f"{path}: prompts: no prompts defined")
    entries = raw.get("prompts")
    named = entries if isinstance(entries, dict) else {}
    from_datasets = {
        key: value for key, value in named.items() if isinstance(value, dict) and "dataset" in value
    }
    generated = {
        key: value
        for key, value in named.items()
        if isinstance(value, dict) and "synthetic" in value and key not in from_datasets
    }
    plain = {
        **raw,
        "prompts": {
            k: v for k, v in named.items() if k not in from_datasets and k not in generated
        },
    }
    if not isinstance(entries, dict):
        plain = raw
    try:
        parsed = _PromptsFile.model_validate(plain)
        sampled = _DatasetPromptsFile.model_validate({"prompts": from_datasets})
        synthetic = _SyntheticPromptsFile.model_validate({"prompts": generated})
    except ValidationError as exc:
        raise one_line_errors(path, exc, raw) from None
    if not parsed.prompts and not sampled.prompts and not synthetic.prompts:
        raise GpubenchError(f"{path}: prompts: no prompts defined")
    prompts: dict[str, Prompt] = {}
    groups: dict[str, tuple[str, ...]] = {}
    for key in named:
        if key in parsed.prompts:
            prompts[key] = parsed.prompts[key]
            continue
        if key in synthetic.prompts:
            made = synthetic.prompts[key]
            if made.synthetic.prefix is not None:
                raise GpubenchError(
                    f"{path}: prompts.{key}.synthetic.prefix: a shared prefix is measured under "
                    "load (a cell's load: synthetic: with prefix:), where requests share it"
                )
            sizes = tuple(dict.fromkeys(made.synthetic.sizes))
            for size in sizes:
                prompts[f"{key}#in{size}"] = synthetic_entry_prompt(
                    key, made.intent, made.synthetic, size
                )
            groups[key] = tuple(f"{key}#in{size}" for size in sizes)
            continue
        entry = sampled.prompts[key]
        dataset = entry.dataset.resolved(path.parent)
        ids = []
        for item in sample_dataset(dataset, f"{path}: prompts.{key}.dataset"):
            prompt_id = f"{key}#{item.index}"
            if prompt_id in named:
                raise GpubenchError(
                    f"{path}: prompts.{prompt_id}: the id is taken by dataset entry {key}'s "
                    "sampled prompts; rename it"
                )
            prompts[prompt_id] = dataset_prompt(key, entry, item, dataset)
            ids.append(prompt_id)
        groups[key] = tuple(ids)
    return prompts, groups


def frozen_prompt_error(
    prompt_id: str,
    cell_id: str,
    *,
    baseline_sha256: str | None,
    current_sha256: str | None,
    source: Path | None = None,
) -> GpubenchError | None:
    """The error for a prompt changed under an id a baseline was measured with, or None.

    Prompts are frozen once shipped: numbers of two different prompts compare nothing.
    """
    if baseline_sha256 is None or current_sha256 is None or baseline_sha256 == current_sha256:
        return None
    where = f"{source}: " if source is not None else ""
    return GpubenchError(
        f"{where}prompt {prompt_id} changed since the baseline of {cell_id} was measured "
        f"(sha256 {baseline_sha256[:12]} -> {current_sha256[:12]}): shipped prompts are frozen; "
        f"restore '{prompt_id}' and add the new text under a new id"
    )
