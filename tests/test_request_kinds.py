"""Request kinds per prompt (issue 35), without an engine: prompts.yaml's `kind:` and its keys
(a chat prompt's frozen hash unchanged, bad input in one line naming file, prompt and key),
the engine's method each kind goes through (engines.send), the answer's validity against a
JSON Schema, OpenAI's streamed tool-call deltas, the flags a managed llama-server gets from its
prompts' kinds, and a fall in validity judged a regression."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import cast

import pytest
from support.bench_files import png

from pytest_gpubench.config.cell import Thresholds
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.config.prompts import Prompt, read_prompts
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.engines import Engine, Request, kind_body, note_tool_calls, send
from pytest_gpubench.engines.managed_llamacpp import kind_args, kind_missing
from pytest_gpubench.measure.call_measurement import CallMeasurement
from pytest_gpubench.measure.validity import judge_answer
from pytest_gpubench.results.gate import judge
from pytest_gpubench.results.stats import summarize

TOOLS = """\
    tools:
      - function:
          name: get_weather
          parameters: {type: object, properties: {city: {type: string}}, required: [city]}
"""
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "maximum": 150}},
    "required": ["name", "age"],
}


def prompts_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prompts.yaml"
    path.write_text("prompts:\n" + text)
    return path


def test_a_chat_prompt_keeps_the_hash_it_had_before_kinds_existed(tmp_path: Path) -> None:
    """The frozen hash of a prompt without `kind:` (or with kind: chat) is the sha256 of its text
    and max_tokens alone, as before: baselines measured before issue 35 still compare."""
    path = prompts_file(
        tmp_path,
        "  A: {intent: a, prompt: hi, max_tokens: 4}\n"
        "  B: {intent: b, prompt: hi, max_tokens: 4, kind: chat}\n"
        "  C: {intent: c, prompt: hi, max_tokens: 4, kind: completion}\n",
    )
    prompts = read_prompts(path)
    before = hashlib.sha256(
        json.dumps({"prompt": "hi", "max_tokens": 4}, sort_keys=True).encode()
    ).hexdigest()
    assert prompts["A"].sha256() == prompts["B"].sha256() == before
    # Another kind of the same text is another prompt: its numbers compare with no chat's.
    assert prompts["C"].sha256() != before


def test_each_kind_reads_its_keys_and_freezes_them(tmp_path: Path) -> None:
    path = prompts_file(
        tmp_path,
        "  E: {intent: e, kind: embedding, prompt: one, inputs: [two, three]}\n"
        "  T:\n    intent: t\n    kind: tools\n    prompt: weather?\n    max_tokens: 32\n"
        + TOOLS
        + f"  J: {{intent: j, kind: json_schema, prompt: p, max_tokens: 32, json_schema: {json.dumps(SCHEMA)}}}\n",
    )
    prompts = read_prompts(path)
    assert Request.of(prompts["E"], None).embedding_inputs() == ["one", "two", "three"]
    assert prompts["T"].kind_keys()["tool_choice"] == "required"
    assert prompts["J"].kind_keys() == {"json_schema": SCHEMA}
    # A tool's schema is part of what is frozen: a changed schema is a changed prompt.
    changed = prompts["T"].model_copy(update={"tool_choice": "auto"})
    assert changed.sha256() != prompts["T"].sha256()
    assert kind_body("tools", prompts["T"].kind_keys())["tool_choice"] == "required"
    named = kind_body("tools", {**prompts["T"].kind_keys(), "tool_choice": "get_weather"})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    response = kind_body("json_schema", prompts["J"].kind_keys())["response_format"]
    assert response["type"] == "json_schema" and response["json_schema"]["schema"] == SCHEMA


class ChatAndEmbeddings:
    """A plugin's engine that names rerank among its kinds but has no rerank()."""

    kind, base_url, model = "plugin", "http://127.0.0.1:9", "m"
    kinds = ("chat", "tools", "embedding", "rerank")

    def chat(self, request: Request, timeout_s: float) -> CallMeasurement:
        return CallMeasurement(backend="chat", text=json.dumps(request.body()))

    def embed(self, request: Request, timeout_s: float) -> CallMeasurement:
        return CallMeasurement(backend="embed", inputs=len(request.embedding_inputs()))


def test_a_request_goes_through_the_engine_s_method_for_its_kind() -> None:
    engine = cast(Engine, ChatAndEmbeddings())
    tools = Request("weather?", 8, kind="tools", kind_keys={"tools": []}, extra_body={"x": 1})
    assert json.loads(send(engine, tools, 1.0).text) == {
        "tools": [],
        "tool_choice": "required",
        "x": 1,
    }
    embedded = send(engine, Request("one", 1, kind="embedding", kind_keys={"inputs": ["two"]}), 1.0)
    assert (embedded.backend, embedded.inputs) == ("embed", 2)
    # A kind it names without the method for it: a failed call that says so, never a chat.
    ranked = send(engine, Request("q", 1, kind="rerank", kind_keys={"documents": ["d"]}), 1.0)
    assert (
        ranked.error == "engine plugin has no method for rerank" and ranked.finish_reason == "error"
    )


@pytest.mark.parametrize(
    ("entry", "line"),
    [
        (
            "  P: {intent: p, prompt: hi, max_tokens: 4, kind: rerank2}\n",
            "prompts.P.kind: Input should be 'chat', 'completion', 'embedding', 'rerank', 'tools', 'json_schema' or 'image'*",
        ),
        (
            "  P: {intent: p, prompt: hi, max_tokens: 4, kind: tools}\n",
            "prompts.P.tools: a prompt of kind tools names at least one tool",
        ),
        (
            "  P: {intent: p, prompt: hi, max_tokens: 4, json_schema: {type: object}}\n",
            "prompts.P.json_schema: only a prompt of kind json_schema takes it (this one is chat)",
        ),
        (
            "  P: {intent: p, prompt: hi, max_tokens: 4, kind: json_schema, json_schema: {type: 12}}\n",
            "prompts.P.json_schema: not a valid JSON Schema: 12 is not valid under any of the given schemas*",
        ),
        (
            "  P:\n    intent: p\n    kind: tools\n    prompt: hi\n    max_tokens: 4\n"
            "    tool_choice: get_time\n" + TOOLS,
            "prompts.P.tool_choice: auto, required or one tool's name (get_weather), not 'get_time'",
        ),
        (
            "  P:\n    intent: p\n    kind: tools\n    prompt: hi\n    max_tokens: 4\n"
            "    tools: [{function: {name: f, parameters: {type: object, required: 3}}}]\n",
            "prompts.P.tools[0].function.parameters: not a valid JSON Schema: *",
        ),
        (
            "  P: {intent: p, kind: rerank, prompt: q}\n",
            "prompts.P.documents: a prompt of kind rerank ranks at least one",
        ),
        (
            "  P: {intent: p, kind: embedding, prompt: q, top_n: 2}\n",
            "prompts.P.top_n: only a prompt of kind rerank takes it (this one is embedding)",
        ),
        (
            "  P: {intent: p, kind: json_schema, prompt: q, max_tokens: 4, "
            "json_schema: {$ref: 'http://127.0.0.1:1/s.json'}}\n",
            "prompts.P.json_schema: not a valid JSON Schema: $ref 'http://127.0.0.1:1/s.json' "
            "points outside the schema; only local refs (#/...) are read",
        ),
        (
            "  P: {intent: p, prompt: hi, max_tokens: 4, kind: completion, inputs: [x]}\n",
            "prompts.P.inputs: only a prompt of kind embedding takes it (this one is completion)",
        ),
    ],
)
def test_bad_kind_keys_are_one_line_naming_the_file_prompt_and_key(
    tmp_path: Path, entry: str, line: str
) -> None:
    path = prompts_file(tmp_path, entry)
    with pytest.raises(GpubenchError) as raised:
        read_prompts(path)
    message = str(raised.value)
    assert len(message.splitlines()) == 1, message
    # The line as written, up to a trailing `*` (jsonschema's or pydantic's own words after it).
    expected = f"{path}: {line.removesuffix('*')}"
    assert message == expected or (line.endswith("*") and message.startswith(expected)), message


def test_a_load_case_refuses_a_prompt_of_another_kind(tmp_path: Path) -> None:
    prompts_file(tmp_path, "  E: {intent: e, kind: embedding, prompt: one}\n")
    (tmp_path / "cells.yaml").write_text(
        "nodes: {local: {kind: local}}\ncells:\n"
        "  - {node: local, engine: llamacpp, model: tiny, load: {concurrency: [2], requests: 4}}\n"
    )
    with pytest.raises(GpubenchError) as raised:
        read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")
    assert "load: prompt 'E' is of kind embedding; load cases send chat requests only" in str(
        raised.value
    )


def test_streamed_tool_call_deltas_are_joined_and_checked_against_the_schema() -> None:
    """OpenAI's shape: the name once, the arguments in pieces; valid only where the arguments
    parse and follow the tool's parameters schema."""
    keys = Prompt(
        intent="t",
        prompt="p",
        max_tokens=8,
        kind="tools",
        tools=({"function": {"name": "get_weather", "parameters": SCHEMA}},),  # type: ignore[arg-type]
    ).kind_keys()

    def called(*pieces: str, name: str = "get_weather") -> CallMeasurement:
        measurement = CallMeasurement(kind="tools", finish_reason="tool_calls")
        note_tool_calls([{"index": 0, "function": {"name": name, "arguments": ""}}], measurement)
        for piece in pieces:
            note_tool_calls([{"index": 0, "function": {"arguments": piece}}], measurement)
        judge_answer(measurement, keys)
        return measurement

    assert called('{"name": "Al', 'ice", "age": 30}').tool_call_valid == 1
    assert called('{"name": "Alice", "age": 300}').tool_call_valid == 0  # over the maximum
    assert called('{"name": "Alice"').tool_call_valid == 0  # does not parse
    assert called('{"name": "A", "age": 3}', name="other").tool_call_valid == 0
    none = CallMeasurement(kind="tools", finish_reason="stop", text="just words")
    judge_answer(none, keys)
    assert none.tool_call_valid == 0
    failed = CallMeasurement(kind="tools", error="HTTP 400")
    judge_answer(failed, keys)
    assert failed.tool_call_valid is None  # a failed call counts against the success rate


def test_a_json_schema_answer_is_valid_only_where_it_parses_and_follows_the_schema() -> None:
    keys = {"json_schema": SCHEMA}
    for text, valid in (('{"name": "a", "age": 4}', 1), ('{"name": "a"}', 0), ("{oops", 0)):
        measurement = CallMeasurement(kind="json_schema", finish_reason="stop", text=text)
        judge_answer(measurement, keys)
        assert measurement.schema_valid == valid, text


def test_a_managed_llama_server_gets_the_flags_of_its_prompts_kinds() -> None:
    assert kind_args(("embedding",), ()) == ["--embeddings", "--pooling", "mean"]
    assert kind_args(("rerank",), ()) == ["--embeddings", "--pooling", "rank"]
    assert kind_args(("embedding",), ("--embeddings", "--pooling", "cls")) == []
    assert kind_args(("embedding",), ("--embeddings",)) == []
    # Mixed: --embeddings is for embedding models (llama-server's help), so none is added and
    # the embedding cases are skipped; server_args that ask for it measure them all.
    assert kind_args(("chat", "embedding"), ()) == []
    assert "--embeddings" in (kind_missing("embedding", ["llama-server"]) or "")
    assert kind_missing("chat", ["llama-server", "--embeddings"]) is None
    assert kind_missing("embedding", ["llama-server", "--embedding"]) is None
    assert kind_missing("embedding", ["llama-server", "--rerank"]) is not None
    assert kind_missing("rerank", ["llama-server", "--embeddings"]) is not None
    assert kind_missing("rerank", ["llama-server", "--embeddings", "--pooling", "rank"]) is None
    assert kind_missing("rerank", ["llama-server", "--reranking"]) is None
    assert kind_args(("tools",), ()) == ["--jinja"]
    assert kind_args(("tools",), ("--no-jinja",)) == []
    assert kind_missing("tools", ["llama-server", "--no-jinja"]) is not None


def _validity_calls(valid: list[int]) -> list[dict[str, object]]:
    return [
        {
            "type": "call",
            "cell_id": "c",
            "prompt_id": "J",
            "prompt_sha256": "s",
            "phase": "warm",
            "run_idx": index,
            "error": None,
            "finish_reason": "stop",
            "coalesced": False,
            "first_delta_ms": 10.0,
            "total_duration_ms": 20.0,
            "tokens_per_sec": 100.0,
            "kind": "json_schema",
            "schema_valid": value,
        }
        for index, value in enumerate(valid)
    ]


def test_a_fall_in_validity_is_a_regression_and_a_floor_is_absolute() -> None:
    """Without a floor a fall is a regression where it is significant (Fisher's exact test, one
    answer in six less is not: inconclusive, which holds the run back); a floor is absolute."""
    (baseline,) = summarize(_validity_calls([1, 1, 1, 1, 1, 1]))
    (fell,) = summarize(_validity_calls([1, 1, 1, 0, 1, 1]))
    (collapsed,) = summarize(_validity_calls([0, 0, 0, 0, 1, 0]))
    (held,) = summarize(_validity_calls([1] * 6))

    def verdict_of(current: object, thresholds: Thresholds | None = None) -> str:
        verdicts = judge(current, baseline, thresholds)  # type: ignore[arg-type]
        (found,) = [v for v in verdicts if v.metric == "warm_schema_valid_rate"]
        return f"{found.verdict}: {found.message}"

    assert verdict_of(fell).startswith(
        "inconclusive: c J: warm schema valid rate 0.83 (5/6) fell from 1.00, but not significant "
        "(p = 0.5 ≥ 0.05)"
    )
    assert verdict_of(collapsed).startswith(
        "regression: c J: warm schema valid rate 0.17 (1/6) fell from 1.00, p = 0.00758"
    )
    assert verdict_of(held).startswith("ok: ")
    # With a floor, the floor decides: 5/6 is above 0.8.
    assert verdict_of(fell, Thresholds(schema_valid_rate=0.8)).startswith("ok: ")
    assert verdict_of(fell, Thresholds(schema_valid_rate=0.9)).startswith("regression: ")
    # A chat (cell, prompt) has no validity verdict at all (absent, not 0).
    chat = [{**call, "kind": None, "schema_valid": None} for call in _validity_calls([1] * 6)]
    (plain,) = summarize(chat)
    assert not [v for v in judge(plain, plain) if "valid" in v.metric]


def test_an_image_prompt_sends_its_files_and_is_frozen_by_their_bytes(tmp_path: Path) -> None:
    (tmp_path / "red.png").write_bytes(png(255))
    path = prompts_file(
        tmp_path,
        "  I: {intent: i, kind: image, prompt: what colour?, max_tokens: 4, images: [red.png]}\n",
    )
    prompt = read_prompts(path)["I"]
    (turn,) = prompt.chat_messages() or []
    text, image = turn["content"]
    assert text == {"type": "text", "text": "what colour?"}
    url = image["image_url"]["url"]
    assert image["type"] == "image_url" and url.startswith("data:image/png;base64,")
    import base64

    assert base64.b64decode(url.split(",", 1)[1]) == png(255)
    before = prompt.sha256()
    # Same name, other bytes: another prompt, refused against the first one's baseline.
    (tmp_path / "red.png").write_bytes(png(254))
    assert read_prompts(path)["I"].sha256() != before


@pytest.mark.parametrize(
    ("entry", "line"),
    [
        (
            "  I: {intent: i, kind: image, prompt: p, max_tokens: 4, images: [gone.png]}\n",
            "prompts.I.images[0]: cannot read {dir}/gone.png: No such file or directory",
        ),
        (
            "  I: {intent: i, kind: image, prompt: p, max_tokens: 4, images: [notes.txt]}\n",
            "prompts.I.images[0]: notes.txt is not one of .png, .jpg, .jpeg, .webp, .gif",
        ),
        (
            "  I: {intent: i, kind: image, prompt: p, max_tokens: 4}\n",
            "prompts.I.images: a prompt of kind image sends at least one",
        ),
        (
            "  I: {intent: i, prompt: p, max_tokens: 4, images: [red.png]}\n",
            "prompts.I.images: only a prompt of kind image takes it (this one is chat)",
        ),
    ],
)
def test_a_bad_image_key_is_one_line(tmp_path: Path, entry: str, line: str) -> None:
    (tmp_path / "notes.txt").write_text("not an image")
    path = prompts_file(tmp_path, entry)
    with pytest.raises(GpubenchError) as raised:
        read_prompts(path)
    assert str(raised.value) == f"{path}: {line.format(dir=tmp_path)}"


def test_a_bad_prompts_yaml_stops_the_session_with_the_usage_status(
    pytester: pytest.Pytester,
) -> None:
    """The documented exit status of a bad prompts.yaml (4, docs/exit-statuses.md), its line on
    stderr."""
    pytester.makefile(
        ".yaml",
        prompts="prompts:\n  P: {intent: p, prompt: hi, max_tokens: 4, kind: tools}\n",
        cells="cells:\n  - {node: local, engine: llamacpp, model: tiny}\n",
    )
    pytester.makepyfile(test_bench="def test_generate(gpubench_case):\n    gpubench_case.run()\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--allow-dirty")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*prompts.yaml: prompts.P.tools: a prompt of kind tools names at least one tool"]
    )


def test_an_embedding_ab_pair_is_judged_on_its_total_only() -> None:
    """An A/B candidate of embedding calls gets no TTFT or decode verdict (the figures do not
    apply: absent, not inconclusive), and its total is judged as a chat pair's is."""
    from pytest_gpubench.results.paired import judge_candidate
    from pytest_gpubench.results.pairs import Pairs

    def call(cell: str, index: int, total: float) -> dict[str, object]:
        return {
            "type": "call", "cell_id": cell, "prompt_id": "E", "phase": "warm",
            "run_idx": index, "error": None, "finish_reason": "stop", "kind": "embedding",
            "first_delta_ms": None, "tokens_per_sec": None, "total_duration_ms": total,
            "inputs": 2, "inputs_per_sec": 2000 / total,
        }  # fmt: skip

    pairs = Pairs(
        candidate={i: call("b", i, 10.0 + i * 0.01) for i in range(8)},
        reference={i: call("a", i, 5.0 + i * 0.01) for i in range(8)},
    )

    class Cell:
        thresholds = Thresholds()
        runs = 8
        min_runs = None
        reference = "a"

    verdicts = judge_candidate("b", Cell(), "E", pairs)
    assert [v.metric for v in verdicts] == ["warm_total_p50_ms"]
    assert verdicts[0].verdict == "regression"  # twice as slow in every pair


def test_sequential_sampling_of_embeddings_stops_on_their_total() -> None:
    """Sequential sampling against a baseline (min_runs) decides an embedding (cell, prompt) on
    the figures it has: twice as slow in total stops as a regression at the first look, where
    a TTFT it never has kept it sampling to the end."""
    from pytest_gpubench.results.sequential_runs import sequential_stop

    def calls(total: float) -> list[dict[str, object]]:
        return [
            {
                "type": "call",
                "cell_id": "c",
                "prompt_id": "E",
                "prompt_sha256": "s",
                "phase": "warm",
                "run_idx": i,
                "error": None,
                "finish_reason": "stop",
                "kind": "embedding",
                "first_delta_ms": None,
                "tokens_per_sec": None,
                "total_duration_ms": total + i * 0.01,
                "coalesced": False,
            }
            for i in range(12)
        ]

    (baseline,) = summarize(calls(5.0))
    assert sequential_stop(calls(10.0), baseline, Thresholds(), 6, 12) == ("regression", 6)


@pytest.mark.parametrize("kind", ["embedding", "rerank", "chat"])
def test_a_baseline_counts_the_warm_calls_of_each_request_kind(tmp_path: Path, kind: str) -> None:
    """The runs of a baseline's history say how many warm calls each ratified (`n`): it was
    the count of TTFT samples, 0 for an embedding or a rerank, which have none."""
    from pytest_gpubench.results.baseline import baseline_path
    from pytest_gpubench.results.baseline_update import update_baselines

    generating = kind == "chat"
    calls = [
        {
            "type": "call", "cell_id": "local:llamacpp:tiny", "prompt_id": "P",
            "prompt_sha256": "s", "phase": "warm", "run_idx": index, "error": None,
            "finish_reason": "stop", "kind": None if generating else kind,
            "first_delta_ms": 2.0 + index * 0.01 if generating else None,
            "tokens_per_sec": 500.0 if generating else None,
            "total_duration_ms": 5.0 + index * 0.01, "coalesced": False,
        }
        for index in range(12)
    ]  # fmt: skip
    update_baselines(tmp_path, calls)
    written = json.loads(baseline_path(tmp_path, "local:llamacpp:tiny").read_text())
    assert [run["n"] for run in written["prompts"]["P"]["history"]] == [12]
