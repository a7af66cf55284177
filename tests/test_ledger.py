"""The ledger: record order and contents, crash safety, and a reader that tolerates truncation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import ledgers
from support.pytest_process import LEAN
from support.standins import OllamaStandin, serving

from pytest_gpubench.cli.main import main
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.ledger.writer import read_ledger

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 6}
  P-MEDIUM: {intent: longer, prompt: "Say hello twice.", max_tokens: 10}
"""


def ollama_cells(url: str, runs: int = 2) -> str:
    return (
        "nodes:\n  local: {kind: local}\ncells:\n"
        f"  - {{node: local, engine: ollama, model: 'qwen3.5:0.8b', endpoint: '{url}', runs: {runs}}}\n"
    )


def test_ledger_records_meta_cell_calls_end(pytester: pytest.Pytester) -> None:
    """Ollama cannot run here: the stand-in follows Ollama's docs/api.md field by field. Its
    tokens 20 ms apart: a reply whose tokens all reach a client descheduled past them arrives in
    one read, its TTFT its total (2 ms apart, that happened beside the suite's other workers)."""
    with serving(OllamaStandin(token_s=0.02)) as url:
        pytester.makefile(".yaml", prompts=PROMPTS, cells=ollama_cells(url))
        pytester.makepyfile("def test_generate(gpubench_case):\n    gpubench_case.run()\n")
        result = pytester.runpytest("--force-load")
    result.assert_outcomes(passed=6)
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    # Each call is followed by its case's resource samples (the node's memory and load).
    assert [r["type"] for r in records] == ["meta", "cell"] + ["call", "sample"] * 6 + ["end"]
    meta, cell, *cases, end = records
    calls = cases[::2]
    run_id = meta["benchmark_run_id"]
    assert ledger.name == f"{run_id}.jsonl"
    assert all(r["benchmark_run_id"] == run_id for r in records)
    assert meta["cells_planned"] == ["local:ollama:qwen3.5:0.8b"] and meta["cases_planned"] == 6
    assert cell["engine_version"] == "0.12.3" and cell["model_digest"].startswith("2ae6f6")
    assert cell["gpus"] == []  # no nvidia-smi on this machine: an explicit empty inventory
    cold = [c for c in calls if c["phase"] == "cold"]
    assert [c["cold_kind"] for c in cold] == ["unload", "unload"]
    assert all(c["engine_timings"]["load_duration"] > 0 for c in cold)
    for call in calls:
        assert call["error"] is None and call["finish_reason"] == "length"
        assert 0 < call["first_delta_ms"] < call["total_duration_ms"]
        max_tokens = 6 if call["prompt_id"] == "P-EASY" else 10
        assert call["completion_tokens"] == call["client_chunks"] == max_tokens
    assert end["calls"] == 6 and end["finished_at_utc"] >= meta["started_at_utc"]


def test_reader_tolerates_a_truncated_last_line(tmp_path: Path) -> None:
    ledger = tmp_path / "run.jsonl"
    ledger.write_text('{"type": "meta"}\n{"type": "call", "run_idx": 0}\n{"type": "call", "ru')
    assert [r["type"] for r in read_ledger(ledger)] == ["meta", "call"]


def test_reader_names_a_corrupt_line_in_the_middle(tmp_path: Path) -> None:
    ledger = tmp_path / "run.jsonl"
    ledger.write_text('{"type": "meta"}\nnot json\n{"type": "end"}\n')
    with pytest.raises(GpubenchError, match=r"run\.jsonl: line 2 is not valid JSON"):
        read_ledger(ledger)


def test_kill_9_mid_run_leaves_complete_lines_that_parse(pytester: pytest.Pytester) -> None:
    """Ollama cannot run here: the stand-in follows Ollama's docs/api.md; it streams slowly."""
    with serving(OllamaStandin(token_s=0.02)) as url:
        pytester.makefile(".yaml", prompts=PROMPTS, cells=ollama_cells(url, runs=50))
        pytester.makepyfile("def test_generate(gpubench_case):\n    gpubench_case.run()\n")
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "--force-load", "-p", "no:cacheprovider", *LEAN],
            cwd=pytester.path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        try:
            deadline = time.monotonic() + 60
            ledgers: list[Path] = []
            while time.monotonic() < deadline:
                ledgers = list((pytester.path / "runs").glob("*.jsonl"))
                if ledgers and ledgers[0].read_text().count('"type":"call"') >= 4:
                    break
                time.sleep(0.05)
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.wait(timeout=10)
    assert process.returncode == -signal.SIGKILL
    text = ledgers[0].read_text()
    complete = text.split("\n")[:-1]  # what follows the last newline may be cut short
    records = [json.loads(line) for line in complete]
    assert records[0]["type"] == "meta" and "end" not in {r["type"] for r in records}
    assert sum(r["type"] == "call" for r in records) >= 4
    # Read back, call records carry their cell's keys again (ledger.writer.CELL_KEYS); every
    # key as written is there unchanged.
    restored = read_ledger(ledgers[0])[: len(records)]
    assert [{key: r[key] for key in raw} for r, raw in zip(restored, records, strict=True)] == (
        records
    )


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("command", ["gate", "merge", "report"])
def test_nan_or_an_infinity_in_a_call_is_one_line_from_gate_merge_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, value: str
) -> None:
    """Python's json writes and reads them, JSON has none: `gpubench gate` and `merge` took NaN
    as a figure, `report` called the line not JSON (and a last one a cut tail). Now each names
    the line and the field, with the status of a command's bad input (2, as a run's is 4:
    docs/clusters-and-leases.md)."""
    path = ledgers.write(tmp_path / "run-a.jsonl", ledgers.run_records("run-a", warm=3))
    lines = path.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if json.loads(line)["type"] == "call")
    record = json.loads(lines[number - 1])
    record["first_delta_ms"] = float(value.replace("Infinity", "inf"))
    lines[number - 1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    (tmp_path / "baselines").mkdir()
    argv = {
        "gate": ["gate", str(path), "--baselines", str(tmp_path / "baselines")],
        "merge": [
            "merge",
            str(path),
            "-o",
            str(tmp_path / "merged.jsonl"),
            *ledgers.judged_against(tmp_path),
        ],
        "report": ["report", str(path), "-o", str(tmp_path / "report.md")],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"gpubench: error: {path}: line {number}: first_delta_ms: expected a finite number, "
        f"got {value}\n"
    )


@pytest.mark.parametrize(
    "record",
    [
        {
            "type": "call",
            "ttft": 12.5,
            "tiny": 1e-05,
            "text": "ünïcode ✓",
            "nested": {"a": [1, 2.0]},
        },
        {"type": "call", "nan": float("nan")},
        {"type": "call", "big": -9223372036854775809},
        {"type": "call", "keys": {1: "one"}},
    ],
    ids=["plain", "nan", "beyond-64-bits", "number-keys"],
)
def test_a_read_record_is_written_again_with_its_values(record: dict[str, Any]) -> None:
    """gpubench merge writes the records it read with orjson (read_record_line): the values read
    back are record_line's, NaN and integers beyond 64 bits included."""
    from pytest_gpubench.ledger.writer import parse_line, read_record_line, record_line

    again, problem = parse_line(read_record_line(record).encode())
    expected, _ = parse_line(record_line(record).encode())
    assert problem is None
    assert json.dumps(again, sort_keys=True) == json.dumps(expected, sort_keys=True)
