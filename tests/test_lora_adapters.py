"""Several LoRA adapters on one cell (issue 35), without an engine: the cases a cell that
chooses adapters per request measures (each prompt once per adapter), the request fields that
choose one (llama-server's per-request `lora` scales, an OpenAI-compatible server's model
name), the choice under load (round robin exact, a seeded draw the same every time, weights),
the per-adapter split of a load point, and the keys' one-line errors. The real llama-server
serving two generated adapters is in tests/test_lora_real.py."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.standins import FaultyOpenAIServer, serving

from pytest_gpubench.config.cases import build_cases
from pytest_gpubench.config.matrix import Matrix, read_matrix
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.reports.load_tables import render_adapter_split
from pytest_gpubench.results.load_summary import adapter_split
from pytest_gpubench.run.load.adapters import AdapterChoice
from pytest_gpubench.run.load.driver import build_target

PROMPTS = (
    "prompts:\n"
    "  P-EASY: {intent: short, prompt: hi, max_tokens: 4}\n"
    "  P-TWO: {intent: other, prompt: there, max_tokens: 4}\n"
)


def matrix_of(tmp_path: Path, cell: str) -> Matrix:
    cells = tmp_path / "cells.yaml"
    cells.write_text(f"nodes: {{local: {{kind: local}}}}\ncells:\n  - {cell}\n")
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(PROMPTS)
    return read_matrix(cells, prompts)


def test_each_prompt_is_measured_once_per_adapter_under_its_own_id(tmp_path: Path) -> None:
    matrix = matrix_of(
        tmp_path,
        "{node: local, engine: llamacpp, model: tiny, runs: 2, "
        "lora: {sql: tiny-lora-1, chat: tiny-lora-2}}",
    )
    cases = build_cases(matrix)
    judged = Counter((case.phase, case.prompt_id) for case in cases)
    # Cold once and warm twice per (prompt, adapter), each judged under <prompt>@<adapter>.
    assert judged == {
        (phase, f"{prompt}@{adapter}"): runs
        for phase, runs in (("cold", 1), ("warm", 2))
        for prompt in ("P-EASY", "P-TWO")
        for adapter in ("sql", "chat")
    }
    for case in cases:
        assert case.adapter is not None
        assert case.source_prompt_id == case.prompt_id.removesuffix(f"@{case.adapter}")
        assert case.case_id == f"local:llamacpp:tiny-{case.prompt_id}-{case.phase}-{case.run_idx}"


def test_one_adapter_keeps_the_prompt_ids_and_cases_of_a_cell_without(tmp_path: Path) -> None:
    plain = build_cases(matrix_of(tmp_path, "{node: local, engine: llamacpp, model: tiny}"))
    one = build_cases(
        matrix_of(tmp_path, "{node: local, engine: llamacpp, model: tiny, lora: tiny-lora-1}")
    )
    assert [case.case_id for case in one] == [case.case_id for case in plain]
    assert {case.adapter for case in one} == {None}


def test_the_request_names_its_adapter_as_each_engine_expects(tmp_path: Path) -> None:
    llamacpp = matrix_of(
        tmp_path,
        "{node: local, engine: llamacpp, model: tiny, request: {extra_body: {top_k: 1}}, "
        "lora: {sql: tiny-lora-1, chat: tiny-lora-2}}",
    ).cells[0]
    prompt = read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml").prompts["P-EASY"]
    request = llamacpp.adapter_request(llamacpp.request_for(prompt), "chat")
    # llama-server: the adapters' ids are the order of its --lora flags; every one is named,
    # the chosen one at 1, so that no adapter of another request is left applied.
    assert request.extra_body == {
        "top_k": 1,
        "lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}],
    }
    # Each adapter's request is frozen by a hash of its own.
    other = llamacpp.adapter_request(llamacpp.request_for(prompt), "sql")
    assert prompt.sha256(request) != prompt.sha256(other)
    vllm = matrix_of(
        tmp_path,
        "{node: local, engine: openai, model: base, endpoint: 'http://127.0.0.1:9', "
        "lora: [sql, chat]}",
    ).cells[0]
    assert vllm.adapter_body("sql") == {"model": "sql"}


def test_round_robin_sends_each_adapter_in_turn_exactly() -> None:
    choice = AdapterChoice(["a", "b", "c"])
    assert [choice.name_of(i) for i in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    # Weighted: exactly its weight in every sum-of-weights requests, spread out.
    weighted = AdapterChoice(["a", "b"], weights={"a": 3, "b": 1})
    first = [weighted.name_of(i) for i in range(8)]
    assert Counter(first[:4]) == {"a": 3, "b": 1} and Counter(first[4:]) == {"a": 3, "b": 1}
    # Spread out, not a run of a's then the b.
    assert first[:4] == ["a", "a", "b", "a"]


def test_a_seeded_draw_is_the_same_every_time_and_follows_the_weights() -> None:
    draws = [AdapterChoice(["a", "b"], "random", seed=7).name_of(i) for i in range(200)]
    again = AdapterChoice(["a", "b"], "random", seed=7)
    # Asked out of order, the same draws: a pure function of the request's index.
    assert [again.name_of(i) for i in reversed(range(200))][::-1] == draws
    other = [AdapterChoice(["a", "b"], "random", seed=8).name_of(i) for i in range(200)]
    assert other != draws
    assert set(draws) == {"a", "b"} and draws != [draws[0]] * 200
    heavy = AdapterChoice(["a", "b"], "random", seed=7, weights={"a": 9, "b": 1})
    counts = Counter(heavy.name_of(i) for i in range(1000))
    # 9 to 1: far from an even split (a binomial with p 0.9 stays above 800 in 1000 draws).
    assert counts["a"] > 800 and counts["b"] > 0


def test_each_adapter_takes_the_points_prompts_in_turn() -> None:
    """Round robin over two adapters and two prompts: each adapter sends both prompts (request
    i mod 2 would send each adapter one prompt only); a trace's request i is its entry i."""
    choice = AdapterChoice(["a", "b"])
    sent = [(choice.name_of(i), choice.prompt_of(i, 2)) for i in range(8)]
    assert Counter(sent) == {("a", 0): 2, ("a", 1): 2, ("b", 0): 2, ("b", 1): 2}
    weighted = AdapterChoice(["a", "b"], "random", seed=1, weights={"a": 3, "b": 1})
    per_adapter: dict[str, list[int]] = {}
    for i in range(40):
        per_adapter.setdefault(weighted.name_of(i), []).append(weighted.prompt_of(i, 3))
    assert all(turns == [k % 3 for k in range(len(turns))] for turns in per_adapter.values())
    trace = AdapterChoice(["a", "b"], in_order=True)
    assert [trace.prompt_of(i, 5) for i in range(7)] == [0, 1, 2, 3, 4, 0, 1]


def test_a_client_process_given_the_choice_makes_the_same_one() -> None:
    """`processes: N` sends a pickled target: its copy names the same adapters, drawn or not."""
    for choice in (AdapterChoice(["a", "b", "c"], "random", seed=3), AdapterChoice(["a", "b"])):
        choice.of(5)  # partly made before it is sent
        copy = pickle.loads(pickle.dumps(choice))
        assert [copy.of(i) for i in range(50)] == [choice.of(i) for i in range(50)]


def test_each_load_request_carries_its_adapters_fields() -> None:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    per_adapter = tuple(
        tuple(
            json.dumps({**payload, "n": n, "lora": [{"id": 0, "scale": float(i == 0)}]}).encode()
            for n in range(2)
        )
        for i in range(2)
    )
    target = build_target(
        "llamacpp",
        "http://127.0.0.1:9",
        json.dumps(payload).encode(),
        {},
        5.0,
        adapters=AdapterChoice(["a", "b"]),
        adapter_payloads=per_adapter,
    )
    sent = [target.request_for(i).split(b"\r\n\r\n", 1)[1] for i in range(4)]
    sent_as = [(json.loads(body)["lora"][0]["scale"], json.loads(body)["n"]) for body in sent]
    # Adapter a (scale 1) and b in turn, each with the point's two prompts in turn.
    assert sent_as == [(1.0, 0), (0.0, 0), (1.0, 1), (0.0, 1)]


def call(adapter: str, ttft: float, window: str = "measured", error: str | None = None) -> Any:
    return {
        "lora_adapter": adapter,
        "load_window": window,
        "first_delta_ms": ttft,
        "total_duration_ms": ttft * 2,
        "error": error,
    }


def test_a_points_split_counts_each_adapters_measured_requests() -> None:
    calls = [
        call("a", 10.0),
        call("a", 30.0),
        call("b", 20.0),
        call("b", 99.0, window="warmup"),
        call("b", 5.0, error="boom"),
    ]
    split = adapter_split(calls, ["a", "b", "c"])
    assert [(row["adapter"], row["requests"], row["errors"]) for row in split] == [
        ("a", 2, 0),
        ("b", 2, 1),
        ("c", 0, 0),
    ]
    assert split[0]["ttft_ms_p50"] == pytest.approx(20.0)
    assert split[1]["ttft_ms_p50"] == 20.0 and split[1]["e2e_ms_p99"] == 40.0
    points: Any = [{"load_point": "c2", "lora_split": split}, {"load_point": "c4"}]
    text = render_adapter_split(points)
    # One row per (point, adapter) that chose adapters; a point without a split has none.
    rows = [line.split() for line in text.splitlines()[2:]]
    assert [row[:4] for row in rows] == [
        ["c2", "a", "2", "0"],
        ["c2", "b", "2", "1"],
        ["c2", "c", "0", "0"],
    ]
    assert render_adapter_split(points[1:]) == ""


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        (
            "{node: local, engine: llamacpp, model: tiny, lora: [a, b]}",
            r"lora: a list names the adapters an OpenAI-compatible server serves",
        ),
        (
            "{node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:9', "
            "lora: {a: x.gguf}}",
            r"lora: an openai cell lists the names the server serves its adapters under",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, lora: {'a@b': tiny-lora-1}}",
            r"lora: adapter name 'a@b' must be letters, digits",
        ),
        (
            "{node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:9', lora: [a, a]}",
            r"lora: .*names an adapter twice",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, lora: {}}",
            r"lora: .*names no adapter",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, lora: tiny-lora-1, "
            "load: {concurrency: [2], requests: 4, lora_choice: random}}",
            r"load\.lora_choice: the cell chooses no LoRA adapter per request",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, lora: {a: tiny-lora-1, b: tiny-lora-2},"
            " load: {concurrency: [2], requests: 4, lora_weights: {a: 1, c: 2}}}",
            r"load\.lora_weights: 'c' is not an adapter of the cell \(adapters: a, b\)",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, lora: {a: tiny-lora-1, b: tiny-lora-2},"
            " load: {concurrency: [2], requests: 4, lora_weights: {a: 1}}}",
            r"load\.lora_weights: no weight for adapter 'b'",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, lora: {a: tiny-lora-1, b: tiny-lora-2},"
            " load: {concurrency: [2], requests: 4, lora_choice: sometimes}}",
            r"lora_choice: .*'round_robin' or 'random'",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, lora: {a: tiny-lora-1, b: tiny-lora-2},"
            " load: {concurrency: [2], requests: 4, turns: 2}}",
            r"load\.turns: a multi-turn session names no LoRA adapter per request yet",
        ),
    ],
)
def test_a_bad_adapter_key_is_one_line_naming_it(tmp_path: Path, cell: str, message: str) -> None:
    with pytest.raises(GpubenchError, match=message) as raised:
        matrix_of(tmp_path, cell)
    assert "\n" not in str(raised.value)
    assert "cells[0]" in str(raised.value)


def test_an_openai_cell_names_each_adapter_as_the_requests_model(pytester: pytest.Pytester) -> None:
    """vLLM serves each adapter under its own model name (`--lora-modules sql=... chat=...`) and
    a request chooses one by its `model`. Against FaultyOpenAIServer (tests/support/standins.py,
    OpenAI's chat completions streaming protocol field by field; it keeps every request's body)
    in place of vLLM: the CPU build needs a model and adapters in Hugging Face's format, which
    nothing here generates. The warm calls of `P-EASY@sql` ask for model `sql`, the load point's
    requests for `sql` and `chat` in turn."""
    server = FaultyOpenAIServer()
    with serving(server) as url:
        pytester.makefile(
            ".yaml",
            prompts="prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 4}\n",
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', runs: 2,"
            " phases: [warm], lora: [sql, chat],"
            " load: {concurrency: [1], requests: 4, max_send_lag_ms: 1000}}\n",
        )
        pytester.makepyfile(
            test_bench="def test_generate(gpubench_case):\n    gpubench_case.run()\n"
        )
        result = pytester.runpytest("--force-load", "--gpubench-steadiness", "off")
    assert result.ret == 0, result.stdout.str()
    models = [
        body["model"]
        for method, path, body in server.requests
        if method == "POST" and path == "/v1/chat/completions" and body
    ]
    # Warm: each adapter's case a warm-up (its first request may load it) and 2 runs; then the
    # point's 4 sends, in turn.
    assert models[:6] == ["sql"] * 3 + ["chat"] * 3
    assert models[-4:] == ["sql", "chat", "sql", "chat"]
    ledger = next((pytester.path / "runs").glob("*.jsonl"))
    (load,) = [r for r in read_ledger(ledger) if r["type"] == "load"]
    assert [(row["adapter"], row["requests"]) for row in load["lora_split"]] == [
        ("sql", 2),
        ("chat", 2),
    ]


def test_an_ab_pair_chooses_the_same_adapters_on_both_sides(tmp_path: Path) -> None:
    """A candidate's `P-EASY@sql` is paired with its reference's: both choose the same adapters."""
    reference = "{node: local, engine: llamacpp, model: tiny, lora: {sql: tiny-lora-1}}"
    candidate = (
        "{node: local, engine: llamacpp, model: tiny, name: b, reference: local:llamacpp:tiny, "
        "lora: {chat: tiny-lora-2}}"
    )
    with pytest.raises(GpubenchError) as raised:
        matrix_of(tmp_path, f"{reference}\n  - {candidate}")
    assert str(raised.value).endswith(
        "cells[1] (local:llamacpp:tiny@b): lora: this cell chooses the adapters [chat] per "
        "request, its reference 'local:llamacpp:tiny' [sql]; an A/B pair measures each "
        "adapter's prompts on both sides (the same names, in the same order)"
    )
    same = candidate.replace("chat: tiny-lora-2", "sql: tiny-lora-2")
    pair = build_cases(matrix_of(tmp_path, f"{reference}\n  - {same}"))
    warm = {(case.cell_id, case.prompt_id) for case in pair if case.phase == "warm"}
    assert warm == {
        ("local:llamacpp:tiny", "P-EASY@sql"),
        ("local:llamacpp:tiny@b", "P-EASY@sql"),
    } | {
        ("local:llamacpp:tiny", "P-TWO@sql"),
        ("local:llamacpp:tiny@b", "P-TWO@sql"),
    }
