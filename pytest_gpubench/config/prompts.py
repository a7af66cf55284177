"""The frozen prompts of prompts.yaml (a prompt's text or turns, its max_tokens, the request keys
it adds, its request kind), a dataset entry's sampled prompts, synthetic ones by token counts, and
the rule that a shipped prompt never changes under its id."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from pytest_gpubench.config.datasets import Dataset, DatasetPrompt, sample_dataset
from pytest_gpubench.config.load_profile import Synthetic
from pytest_gpubench.config.metrics import REQUEST_KINDS
from pytest_gpubench.config.words import seeded_words
from pytest_gpubench.config.yaml_file import one_line_errors, read_yaml_mapping
from pytest_gpubench.core.errors import GpubenchError, shown_key


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
    extra_body: dict[str, object] | None = None
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

    def changed_keys(self) -> dict[str, object]:
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


RequestKind = Literal["chat", "completion", "embedding", "rerank", "tools", "json_schema", "image"]
assert set(RequestKind.__args__) == set(REQUEST_KINDS)  # type: ignore[attr-defined]


class ToolFunction(_Strict):
    """An OpenAI tool's function: its name and the JSON Schema of its arguments."""

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class Tool(_Strict):
    """One entry of a `tools` prompt's tools, as the OpenAI API takes it."""

    type: Literal["function"] = "function"
    function: ToolFunction


# The keys of a prompt that only some request kinds take: {key: the kinds that take it}.
KIND_KEYS: dict[str, tuple[str, ...]] = {
    "tools": ("tools",),
    "tool_choice": ("tools",),
    "json_schema": ("json_schema",),
    "inputs": ("embedding",),
    "documents": ("rerank",),
    "images": ("image",),
    "top_n": ("rerank",),
    "messages": ("chat", "tools", "json_schema"),
}


# The image types a chat request may carry, by file suffix.
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
               ".webp": "image/webp", ".gif": "image/gif"}  # fmt: skip


class ImageData(_Strict):
    """An image file of a prompt as it is sent: its name as written, its bytes' sha256 (what is
    frozen) and its data URL (OpenAI's `image_url`)."""

    name: str
    sha256: str
    url: str


class Prompt(_Strict):
    intent: str
    prompt: Annotated[str, Field(min_length=1)]
    max_tokens: PositiveInt
    # What is asked of the engine (docs/request-kinds.md): a chat completion (the default), a
    # plain streamed completion, embeddings, a chat with tools, a chat whose answer a JSON Schema
    # constrains (response_format json_schema).
    kind: RequestKind = "chat"
    # kind tools: the tools offered, and which the model must call (`required`, the default: any
    # of them; `auto`; or one tool's name).
    tools: tuple[Tool, ...] | None = None
    tool_choice: Annotated[str, Field(min_length=1)] | None = None
    # kind json_schema: the JSON Schema the answer must follow.
    json_schema: dict[str, object] | None = None
    # kind embedding: further inputs sent in the same request after `prompt`.
    inputs: tuple[Annotated[str, Field(min_length=1)], ...] | None = None
    # kind rerank: the documents ranked against `prompt` (the query), and how many come back.
    documents: tuple[Annotated[str, Field(min_length=1)], ...] | None = None
    top_n: PositiveInt | None = None
    # kind image: image files (paths relative to prompts.yaml) sent with `prompt` in one user
    # turn; read when the file is, frozen by their sha256 (`image_data`, filled by the reader).
    images: tuple[Annotated[str, Field(min_length=1)], ...] | None = None
    image_data: tuple[ImageData, ...] | None = None
    request: RequestShape | None = None
    # A whole conversation sent in place of `prompt` alone (a dataset's entry with a system
    # turn); `prompt` is then its last user turn.
    messages: tuple[ChatTurn, ...] | None = None
    # A token-exact synthetic prompt of one size: `prompt` holds word text until the live cell
    # counts the exact text through the engine (run/workloads.py); frozen at that point.
    synthetic: Synthetic | None = None

    @model_validator(mode="before")
    @classmethod
    def _embedding_needs_no_max_tokens(cls, value: Any) -> Any:
        # An embedding or a rerank generates nothing: its max_tokens may be left out (1, never
        # sent).
        if isinstance(value, dict) and value.get("kind") in ("embedding", "rerank"):
            return {"max_tokens": 1, **value}
        return value

    def kind_keys(self) -> dict[str, object]:
        """What the kind adds to the request, as JSON (also frozen in the hash)."""
        keys: dict[str, object] = {}
        if self.tools is not None:
            keys["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
            keys["tool_choice"] = self.tool_choice or "required"
        if self.json_schema is not None:
            keys["json_schema"] = self.json_schema
        if self.inputs is not None:
            keys["inputs"] = list(self.inputs)
        if self.documents is not None:
            keys["documents"] = list(self.documents)
        if self.top_n is not None:
            keys["top_n"] = self.top_n
        if self.image_data is not None:
            keys["images"] = [{"name": i.name, "sha256": i.sha256} for i in self.image_data]
        return keys

    def chat_messages(self) -> list[dict[str, Any]] | None:
        """The conversation to send, or None where `prompt` is sent as one user turn. An image
        prompt's one user turn holds the text and each image (OpenAI's content parts)."""
        if self.image_data is not None:
            parts: list[dict[str, Any]] = [{"type": "text", "text": self.prompt}]
            parts += [{"type": "image_url", "image_url": {"url": i.url}} for i in self.image_data]
            return [{"role": "user", "content": parts}]
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
            frozen["messages"] = [turn.model_dump() for turn in self.messages]
        changed = request.changed_keys() if request is not None else {}
        if changed:
            frozen["request"] = changed
        # A chat prompt's hash is the one it had before request kinds existed.
        if self.kind != "chat":
            frozen["kind"] = self.kind
            frozen.update(self.kind_keys())
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
            check_kind_keys(path, key, parsed.prompts[key])
            prompts[key] = with_images(path, key, parsed.prompts[key])
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


def check_kind_keys(path: Path, prompt_id: str, prompt: Prompt) -> None:
    """A prompt's kind and the keys it sets agree, and its schemas are JSON Schema: else one
    line naming the file, the prompt and the key (exit status 4, a bad prompts.yaml)."""
    where = f"{path}: prompts.{shown_key(prompt_id)}"
    for key, kinds in KIND_KEYS.items():
        if getattr(prompt, key) is not None and prompt.kind not in kinds:
            raise GpubenchError(
                f"{where}.{key}: only a prompt of kind {' or '.join(kinds)} takes it "
                f"(this one is {prompt.kind})"
            )
    if prompt.kind == "tools":
        if not prompt.tools:
            raise GpubenchError(f"{where}.tools: a prompt of kind tools names at least one tool")
        names = [tool.function.name for tool in prompt.tools]
        if len(set(names)) != len(names):
            raise GpubenchError(f"{where}.tools: two tools are named alike ({', '.join(names)})")
        choice = prompt.tool_choice
        if choice is not None and choice not in ("auto", "required") and choice not in names:
            raise GpubenchError(
                f"{where}.tool_choice: auto, required or one tool's name ({', '.join(names)}), "
                f"not {choice!r}"
            )
        for index, tool in enumerate(prompt.tools):
            problem = schema_problem(tool.function.parameters)
            if problem is not None:
                raise GpubenchError(
                    f"{where}.tools[{index}].function.parameters: not a valid JSON Schema: "
                    f"{problem}"
                )
    if prompt.kind == "image" and not prompt.images:
        raise GpubenchError(f"{where}.images: a prompt of kind image sends at least one")
    if prompt.image_data is not None:
        raise GpubenchError(f"{where}.image_data: unknown key (remove it or check its spelling)")
    if prompt.kind == "rerank" and not prompt.documents:
        raise GpubenchError(f"{where}.documents: a prompt of kind rerank ranks at least one")
    if prompt.kind == "json_schema":
        if prompt.json_schema is None:
            raise GpubenchError(f"{where}.json_schema: a prompt of kind json_schema needs one")
        problem = schema_problem(prompt.json_schema)
        if problem is not None:
            raise GpubenchError(f"{where}.json_schema: not a valid JSON Schema: {problem}")


def with_images(path: Path, prompt_id: str, prompt: Prompt) -> Prompt:
    """An image prompt with its files read (relative to prompts.yaml): a missing or unreadable
    file, or one of a type a chat request does not carry, is one line naming the file, the
    prompt and the key."""
    if not prompt.images:
        return prompt
    read = []
    for index, name in enumerate(prompt.images):
        where = f"{path}: prompts.{shown_key(prompt_id)}.images[{index}]"
        file = (path.parent / name).expanduser()
        media = IMAGE_TYPES.get(file.suffix.lower())
        if media is None:
            shown = name if name.isprintable() else repr(name)
            raise GpubenchError(f"{where}: {shown} is not one of {', '.join(IMAGE_TYPES)}")
        try:
            data = file.read_bytes()
        except OSError as exc:
            shown = str(file) if str(file).isprintable() else repr(str(file))
            raise GpubenchError(f"{where}: cannot read {shown}: {exc.strerror}") from None
        encoded = base64.b64encode(data).decode()
        read.append(
            ImageData(
                name=name,
                sha256=hashlib.sha256(data).hexdigest(),
                url=f"data:{media};base64,{encoded}",
            )
        )
    return prompt.model_copy(update={"image_data": tuple(read)})


def schema_problem(schema: dict[str, object]) -> str | None:
    """Why `schema` is not a JSON Schema (draft 2020-12), in one line; None when it is."""
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        # On one line: a key or value that holds a line break is quoted.
        at = "/".join(shown_key(str(part)) for part in exc.path)
        message = exc.message if exc.message.isprintable() else repr(exc.message)
        return message + (f" (at {at})" if at else "")
    remote = next(_remote_refs(schema), None)
    if remote is not None:
        # Nothing is fetched: an answer is judged against what the file holds.
        return f"$ref {remote!r} points outside the schema; only local refs (#/...) are read"
    return None


def _remote_refs(value: Any) -> Iterator[str]:
    """The `$ref`s of a schema that do not point inside it."""
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            yield ref
        for item in value.values():
            yield from _remote_refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _remote_refs(item)


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
