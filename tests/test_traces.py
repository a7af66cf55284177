"""Trace files (config/traces.py) and the replay's schedule (run/load/trace_replay.py) without
an engine: Mooncake JSONL and BurstGPT CSV read in arrival order, cut to a window and capped;
the replay's times over its speed-up; bad input as one line naming the file and key."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest

from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.config.traces import Trace, read_trace
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.run.load import make_pattern


def write_mooncake(path: Path) -> None:
    rows = [
        {"timestamp": 2000, "input_length": 600, "output_length": 30, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 100, "output_length": 900, "hash_ids": [0]},
        {"timestamp": 5000, "input_length": 20, "output_length": 5, "hash_ids": [7]},
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")


def test_mooncake_is_read_in_arrival_order_windowed_and_capped(tmp_path: Path) -> None:
    write_mooncake(tmp_path / "t.jsonl")
    trace = Trace(path=str(tmp_path / "t.jsonl"), format="mooncake", max_output_tokens=64)
    entries = read_trace(trace, "here")
    assert [(e.at_s, e.input_tokens, e.output_tokens, e.hash_ids) for e in entries] == [
        (0.0, 100, 64, (0,)),
        (2.0, 600, 30, (0, 1)),
        (5.0, 20, 5, (7,)),
    ]
    windowed = read_trace(trace.model_copy(update={"window": (1.0, 4.0)}), "here")
    assert [(e.at_s, e.input_tokens) for e in windowed] == [(1.0, 600)]


def test_burstgpt_csv_skips_failed_requests(tmp_path: Path) -> None:
    (tmp_path / "b.csv").write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,API log\n"
    )
    entries = read_trace(Trace(path=str(tmp_path / "b.csv"), format="burstgpt"), "here")
    assert [(e.at_s, e.input_tokens, e.output_tokens) for e in entries] == [
        (0.0, 472, 18),
        (113.0, 417, 276),
    ]


def test_a_replay_sends_at_the_trace_times_over_the_speedup(tmp_path: Path) -> None:
    write_mooncake(tmp_path / "t.jsonl")
    profile = LoadProfile(
        trace={"path": str(tmp_path / "t.jsonl"), "format": "mooncake", "speedup": [1, 4]}  # type: ignore[arg-type]
    )
    assert profile.points == ["trace-x1", "trace-x4"] and profile.bounded
    fast = make_pattern(profile, "trace-x4")
    facts = fast.facts()
    assert facts["pattern"] == "trace" and facts["speedup"] == 4.0
    assert facts["trace_span_s"] == 1.25 and facts["trace_requests"] == 3
    assert fast.offered_rate == pytest.approx(2 / 1.25)


@pytest.mark.parametrize(
    ("trace", "message"),
    [
        ("{path: gone.jsonl, format: mooncake}", "*load.trace.path: *gone.jsonl: file not found"),
        (
            "{path: t.jsonl, format: sharegpt}",
            "*load.trace.format: Input should be 'mooncake' or 'burstgpt'*",
        ),
        (
            "{path: t.jsonl, format: mooncake, speedup: 0}",
            "*load.trace.speedup[[]0[]]: Input should be greater than 0*",
        ),
        (
            "{path: t.jsonl, format: mooncake, window: [10, 20]}",
            "*load.trace.window: no request of *t.jsonl arrives in (10.0, 20.0)",
        ),
        (
            "{path: bad.jsonl, format: mooncake}",
            "*load.trace.path: *bad.jsonl: line 1: input_length must be a positive count (got None)",
        ),
        (
            "{path: t.jsonl, format: burstgpt}",
            "*load.trace.path: *t.jsonl: missing column(s) Timestamp, Request tokens, Response tokens (BurstGPT CSV)",
        ),
    ],
)
def test_bad_trace_input_is_one_line_naming_the_cell_and_key(
    tmp_path: Path, trace: str, message: str
) -> None:
    write_mooncake(tmp_path / "t.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "output_length": 3}\n')
    (tmp_path / "prompts.yaml").write_text(
        "prompts:\n  P: {intent: p, prompt: hi, max_tokens: 4}\n"
    )
    (tmp_path / "cells.yaml").write_text(
        "nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, load: {{trace: {trace}}}}}\n"
    )
    with pytest.raises(GpubenchError) as caught:
        read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")
    text = str(caught.value)
    assert "\n" not in text and fnmatch.fnmatch(text, message), text
    assert text.startswith(str(tmp_path / "cells.yaml"))


def test_turns_and_prefix_keys_are_checked(tmp_path: Path) -> None:
    (tmp_path / "prompts.yaml").write_text(
        "prompts:\n  P: {intent: p, prompt: hi, max_tokens: 4}\n"
    )
    for load, message in [
        (
            "{concurrency: [2], requests: 2, turns: 0}",
            "*load.turns: Input should be greater than or equal to 1*",
        ),
        (
            "{concurrency: [2], requests: 2, prefix: {tokens: 8}}",
            "*load: Value error, prefix: shares a prefix among synthetic prompts: add synthetic:*",
        ),
        (
            "{concurrency: [2], requests: 2, synthetic: {input_tokens: 8, output_tokens: 2}, prefix: {tokens: 8, groupz: 2}}",
            "*load.synthetic.prefix.groupz: unknown key*",
        ),
    ]:
        (tmp_path / "cells.yaml").write_text(
            "nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: llamacpp, model: tiny, load: {load}}}\n"
        )
        with pytest.raises(GpubenchError) as caught:
            read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")
        assert fnmatch.fnmatch(str(caught.value), message), str(caught.value)
