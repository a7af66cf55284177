"""Request kinds (issue 35) against the real llama-server serving the tiny model: a plain
completion, embeddings, a rerank, a tools call and a json_schema answer, each with its own figures in the
ledger and the terminal, baselined and then gated by a second run; a cell that cannot send a
kind skips it in one line. The tiny model's own chat template (ChatML) makes llama-server's
grammar sampler fail on any constrained chat (HTTP 400 "Failed to initialize samplers"), so the
generating cell runs with `--chat-template llama3`, under which response_format json_schema
constrains the answer; tools are then not offered to the model (no built-in template renders
them) and no tool call comes back: its valid rate is asserted as measured, 0. The valid tool
call, and a fall of its rate judged a regression, are shown against a stand-in that follows
OpenAI's streaming tool-call shape (support/standins.ToolCallStandin)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from support.bench_files import png
from support.standins import ImageChatStandin, OllamaStandin, ToolCallStandin, serving
from support.workload_runs import ledger_records, run_workload

from pytest_gpubench.cli.main import main
from pytest_gpubench.core.status import EXIT_REGRESSION, EXIT_UNSTEADY

TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOL = (
    "      - function:\n"
    "          name: get_weather\n"
    "          parameters: {type: object, properties: {city: {type: string, maxLength: 12}},"
    " required: [city], additionalProperties: false}\n"
)
PROMPTS = (
    "prompts:\n"
    '  C: {intent: plain completion, kind: completion, prompt: "Once upon a time", max_tokens: 8}\n'
    '  E: {intent: two texts embedded, kind: embedding, prompt: "hello world", inputs: [again]}\n'
    "  R: {intent: three documents ranked, kind: rerank, prompt: weather, "
    'documents: ["sunny day", "a fish", "rain"], top_n: 2}\n'
    "  T:\n    intent: weather tool\n    kind: tools\n    prompt: weather in Paris?\n"
    "    max_tokens: 24\n    tools:\n" + TOOL + "  J: {intent: a person, kind: json_schema, "
    f"prompt: a person, max_tokens: 64, json_schema: {json.dumps(SCHEMA)}}}\n"
)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """In this process (llama-server and the stand-ins are processes or threads of their own)."""
    return run_workload(pytester, *args, in_process=True)


def calls_by_prompt(root: Path) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for record in ledger_records(root):
        if record["type"] == "call":
            found.setdefault(record["prompt_id"], []).append(record)
    return found


def verdicts(root: Path) -> dict[tuple[str, str], str]:
    (end,) = [r for r in ledger_records(root) if r["type"] == "end"]
    return {(v["prompt_id"], v["metric"]): v["verdict"] for v in end["verdicts"]}


@pytest.mark.engine
def test_each_request_kind_is_measured_recorded_and_gated_on_the_real_llama_server(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, server_binary: '{llama_server}', "
        "server_args: [--threads, '1', --chat-template, llama3], runs: 5, phases: [warm], "
        "prompts: [C, T, J]}\n"
        # Embeddings only: the cell's launch gets --embeddings --pooling mean from the kind.
        f"  - {{node: local, engine: llamacpp, model: tiny, name: embed, "
        f"server_binary: '{llama_server}', server_args: [--threads, '1'], runs: 5, "
        "phases: [warm], prompts: [E]}\n"
        # Reranks only: --embeddings --pooling rank, what llama-server's --rerank sets.
        f"  - {{node: local, engine: llamacpp, model: tiny, name: rank, "
        f"server_binary: '{llama_server}', server_args: [--threads, '1'], runs: 5, "
        "phases: [warm], prompts: [R]}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    first = run(pytester, "--baseline-update")
    assert first.ret == 0, first.stdout.str()
    calls = calls_by_prompt(pytester.path)
    assert all(r["error"] is None for records in calls.values() for r in records), calls
    # A completion streams: a TTFT and a decode rate, as a chat call has.
    assert all(r["kind"] == "completion" and r["first_delta_ms"] > 0 for r in calls["C"])
    assert all(r["completion_tokens"] == 8 for r in calls["C"])
    # Embeddings: two vectors a call, inputs/s, and no TTFT or decode rate (absent, not 0).
    for record in calls["E"]:
        assert record["kind"] == "embedding" and record["inputs"] == 2
        assert record["inputs_per_sec"] > 0 and record["total_duration_ms"] > 0
        assert record["first_delta_ms"] is None and record["tokens_per_sec"] is None
        assert "schema_valid" not in record and "tool_call_valid" not in record
    # Rerank: three documents a call, ranked; documents/s, no TTFT or decode rate.
    for record in calls["R"]:
        assert record["kind"] == "rerank" and record["inputs"] == 3
        assert record["inputs_per_sec"] > 0 and record["first_delta_ms"] is None
    # json_schema: llama-server's grammar holds the answer to the schema on every call.
    assert [r["schema_valid"] for r in calls["J"]] == [1] * 5
    # tools: the measured figure, honestly: the tiny model's server calls no tool (see above).
    assert [r["tool_call_valid"] for r in calls["T"]] == [0] * 5
    assert all(r["tool_calls"] == 0 for r in calls["T"])
    first.stdout.fnmatch_lines(
        [
            "*kind*inputs/s p50*valid*",
            "*local:llamacpp:tiny *C *completion *- *- *",
            "*local:llamacpp:tiny *J *json_schema *- *5/5 schema valid*",
            "*local:llamacpp:tiny *T *tools *- *0/5 tool call valid*",
            "*local:llamacpp:tiny@embed *E * - *embedding *[0-9]*.[0-9] *- *",
            "*local:llamacpp:tiny@rank *R * - *rerank *[0-9]*.[0-9] *- *",
        ]
    )
    # The same figures in the reports read after the run: the pull request summary the session
    # wrote, and the Markdown and HTML reports of its ledger.
    (summary,) = (pytester.path / "runs").glob("*.summary.md")
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    report, page = pytester.path / "report.md", pytester.path / "report.html"
    assert main(["report", str(ledger), "-o", str(report)]) == 0
    assert main(["report", str(ledger), "--html", "-o", str(page)]) == 0
    for text in (summary, report, page):
        kinds = text.read_text(encoding="utf-8")
        kinds = kinds[kinds.index("Request kinds") :]
        for row in (
            ("local:llamacpp:tiny", "C", "completion", "-", "-"),
            ("local:llamacpp:tiny", "J", "json_schema", "-", "5/5 schema valid"),
            ("local:llamacpp:tiny", "T", "tools", "-", "0/5 tool call valid"),
            ("local:llamacpp:tiny@embed", "E", "embedding", r"\d+\.\d", "-"),
            ("local:llamacpp:tiny@rank", "R", "rerank", r"\d+\.\d", "-"),
        ):
            cells = [re.escape(cell) if "\\" not in cell else cell for cell in row]
            assert re.search(r"\s*(?:\|\s*|</td><td[^>]*>)".join(cells), kinds), (text, row)
    # Both cells' baselines written, the validity samples kept in the generating one's.
    written = (pytester.path / "baselines" / "local_llamacpp_tiny.json").read_text()
    assert '"schema_valid"' in written and '"tool_call_valid"' in written
    assert (
        '"inputs_per_sec"'
        in (pytester.path / "baselines" / "local_llamacpp_tiny_embed.json").read_text()
    )

    # Gated against the first: each kind judged on its figures (a timing verdict on a shared
    # machine may go either way, or not be told with five calls; steadiness is off here).
    again = run(pytester)
    assert again.ret in (0, EXIT_REGRESSION, EXIT_UNSTEADY), again.stdout.str()
    judged = verdicts(pytester.path)
    assert judged[("J", "warm_schema_valid_rate")] == "ok"
    assert judged[("T", "warm_tool_call_valid_rate")] == "ok"  # 0 held at 0
    assert ("E", "warm_total_p50_ms") in judged and ("E", "warm_success_rate") in judged
    # No TTFT or decode verdict for an embedding: the figure does not apply.
    assert ("E", "warm_ttft_p50_ms") not in judged
    assert ("E", "warm_decode_tokens_per_sec_p50") not in judged
    assert ("R", "warm_total_p50_ms") in judged and ("R", "warm_ttft_p50_ms") not in judged
    assert ("C", "warm_ttft_p50_ms") in judged
    assert again.ret != EXIT_REGRESSION or all(
        verdict != "regression"
        for (prompt, metric), verdict in judged.items()
        if "valid" in metric or metric == "warm_success_rate"
    )


@pytest.mark.engine
def test_a_cell_that_cannot_send_a_kind_skips_it_in_one_line(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    """A managed llama-server serving chat is not started with --embeddings (llama-server's
    help keeps it for embedding models), so its embedding case is skipped with the reason, and
    so is an Ollama cell's (the Ollama engine sends chat only); their chat cases run."""
    with serving(OllamaStandin()) as ollama:
        pytester.makefile(
            ".yaml",
            prompts="prompts:\n  P: {intent: p, prompt: hi, max_tokens: 4}\n"
            "  E: {intent: e, kind: embedding, prompt: hello}\n"
            "  I: {intent: i, kind: image, prompt: colour?, max_tokens: 4, images: [red.png]}\n",
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: llamacpp, model: tiny, server_binary: '{llama_server}', "
            "server_args: [--threads, '1'], runs: 2, phases: [warm]}\n"
            f"  - {{node: local, engine: ollama, model: qwen3.5:0.8b, endpoint: '{ollama}', "
            "runs: 2, phases: [warm]}\n",
        )
        pytester.path.joinpath("red.png").write_bytes(png(255))
        pytester.makepyfile(test_bench=TEST_FILE)
        result = run(pytester)
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=4, skipped=8)
    skipped = [r for r in ledger_records(pytester.path) if r["type"] == "skipped"]
    reasons = {(r["cell_id"], r["prompt_id"], r["reason"]) for r in skipped}
    assert reasons == {
        (
            "local:llamacpp:tiny",
            "E",
            "cell local:llamacpp:tiny: llama-server serves embeddings only when started with "
            "--embeddings (and a pooling other than rank), which its help keeps for embedding "
            "models: give embedding prompts a cell of their own (its prompts: key), or set the "
            "flags in its server_args",
        ),
        (
            "local:ollama:qwen3.5:0.8b",
            "E",
            "cell local:ollama:qwen3.5:0.8b: engine ollama does not send embedding requests "
            "(it sends chat)",
        ),
        (
            "local:llamacpp:tiny",
            "I",
            "cell local:llamacpp:tiny: llama-server reads images only with a multimodal "
            "projector: set --mmproj (the model's projector GGUF) in the cell's server_args",
        ),
        (
            "local:ollama:qwen3.5:0.8b",
            "I",
            "cell local:ollama:qwen3.5:0.8b: engine ollama does not send image requests "
            "(it sends chat)",
        ),
    }
    calls = calls_by_prompt(pytester.path)
    assert set(calls) == {"P"} and all(r["error"] is None for r in calls["P"])
    # A chat call's record carries none of the kinds' fields: it is as before kinds existed.
    assert not any({"kind", "inputs", "schema_valid"} & set(r) for r in calls["P"])


def test_a_cell_whose_every_prompt_is_of_a_kind_it_cannot_send_is_skipped_not_failed(
    pytester: pytest.Pytester,
) -> None:
    """An Ollama cell (chat only, OllamaStandin) given an embedding prompt alone: every case is
    skipped with the reason, and the cell's outcome is `skipped`, not `failed` (exit 0, not 7);
    a kind the engine lacks is a skip reason, never a failure (issue 35)."""
    with serving(OllamaStandin()) as ollama:
        pytester.makefile(
            ".yaml",
            prompts="prompts:\n  E: {intent: e, kind: embedding, prompt: hello}\n",
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: ollama, model: qwen3.5:0.8b, endpoint: '{ollama}', "
            "runs: 2, phases: [warm]}\n",
        )
        pytester.makepyfile(test_bench=TEST_FILE)
        result = run(pytester, "-rs")
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(skipped=2)
    # Shown as the skips they are, not as an unmeasured required cell's cases (`u`,
    # UNMEASURED), which the exit status and the cell table contradicted (issue 44).
    result.stdout.fnmatch_lines(["test_bench.py ss *", "SKIPPED [[]2[]] *engine ollama does not*"])
    assert "UNMEASURED" not in result.stdout.str()
    (end,) = [r for r in ledger_records(pytester.path) if r["type"] == "end"]
    (outcome,) = end["cells"]
    assert outcome["status"] == "skipped", outcome
    assert outcome["reason"] == (
        "cell local:ollama:qwen3.5:0.8b: engine ollama does not send embedding requests "
        "(it sends chat)"
    )


def test_a_valid_tool_call_is_counted_and_a_fall_in_its_rate_fails_the_gate(
    pytester: pytest.Pytester,
) -> None:
    """Against ToolCallStandin (OpenAI's streamed tool-call shape, the request checked field by
    field): no model here returns a tool call (see the module's note). Its calls are valid while
    it sends arguments that follow the tool's schema; once they do not, the gate's verdict on
    the tool call valid rate is a regression and the session's exit status says so."""
    standin = ToolCallStandin(arguments='{"city": "Paris"}')
    with serving(standin) as url:
        pytester.makefile(
            ".yaml",
            prompts="prompts:\n  T:\n    intent: weather\n    kind: tools\n    prompt: weather?\n"
            "    max_tokens: 24\n    tool_choice: get_weather\n    tools:\n" + TOOL,
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', runs: 6, "
            "phases: [warm]}\n",
        )
        pytester.makepyfile(test_bench=TEST_FILE)
        first = run(pytester, "--baseline-update")
        assert first.ret == 0, first.stdout.str()
        records = calls_by_prompt(pytester.path)["T"]
        assert [r["tool_call_valid"] for r in records] == [1] * 6
        assert all(r["tool_calls"] == 1 and r["finish_reason"] == "tool_calls" for r in records)
        # A tool call's streamed pieces are not tokens: its count is not checked against usage.
        assert all(r.get("token_mismatch") is None for r in records)
        # Its tokens are the call's: a TTFT from the first tool-call delta.
        assert all(r["first_delta_ms"] is not None for r in records)
        (sent,) = {json.dumps(body["tool_choice"]) for _, _, body in standin.requests if body}
        assert json.loads(sent) == {"type": "function", "function": {"name": "get_weather"}}
        first.stdout.fnmatch_lines(["*T *tools *6/6 tool call valid*"])

        standin.arguments = '{"town": 12}'  # not the tool's schema: city required, no town
        fell = run(pytester)
    assert fell.ret == EXIT_REGRESSION, fell.stdout.str()
    assert verdicts(pytester.path)[("T", "warm_tool_call_valid_rate")] == "regression"
    fell.stdout.fnmatch_lines(
        [
            "*T *tools *0/6 tool call valid*regression*",
            "REGRESSION: local:openai:m T: warm tool call valid rate 0.00 (0/6) fell from 1.00, "
            "p = 0.00108",
        ]
    )


def test_an_image_case_sends_its_file_and_is_frozen_by_its_bytes(pytester: pytest.Pytester) -> None:
    """Against ImageChatStandin, which checks OpenAI's vision request shape field by field: no
    tiny vision model and projector can be generated or installed here, and the real
    llama-server without --mmproj refuses images (the skip above). Each call carries the file's
    bytes; a second run is gated against the first; the same file name with other bytes is a
    changed prompt, refused against the baseline like a changed text."""
    import hashlib

    standin = ImageChatStandin()
    with serving(standin) as url:
        pytester.path.joinpath("red.png").write_bytes(png(255))
        pytester.makefile(
            ".yaml",
            prompts="prompts:\n  I: {intent: colour of an image, kind: image, prompt: colour?, "
            "max_tokens: 6, images: [red.png]}\n",
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', runs: 6, "
            "phases: [warm]}\n",
        )
        pytester.makepyfile(test_bench=TEST_FILE)
        first = run(pytester, "--baseline-update")
        assert first.ret == 0, first.stdout.str()
        records = calls_by_prompt(pytester.path)["I"]
        assert all(r["kind"] == "image" and r["error"] is None for r in records)
        # The stand-in counts each image's tokens in the prompt: the image reached it.
        assert all(r["prompt_tokens"] == 5 + 64 for r in records)
        assert set(standin.received) == {hashlib.sha256(png(255)).hexdigest()}
        posts = [body for method, _, body in standin.requests if method == "POST"]
        assert len(standin.received) == len(posts) >= 6  # each call (and the warm-up) had it
        first.stdout.fnmatch_lines(["*I *image *- *- *new*"])
        again = run(pytester)
        assert again.ret in (0, EXIT_REGRESSION, EXIT_UNSTEADY), again.stdout.str()
        assert verdicts(pytester.path)[("I", "warm_success_rate")] == "ok"

        pytester.path.joinpath("red.png").write_bytes(png(254))
        stopped = run(pytester)
    assert stopped.ret == pytest.ExitCode.USAGE_ERROR
    stopped.stderr.fnmatch_lines(["*prompt I changed since the baseline of local:openai:m*"])
