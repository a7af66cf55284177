"""Timed runs against the real llama-server (docs/cells.md "Timed runs"): a warm phase that calls for
`duration_s`, a checkpoint record every `checkpoint_s`, and a run killed with -9 keeps the
checkpoints (and the calls before them) that were written before it died."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.bench_files import CHECKED_TEST_FILE, ONE_PROMPT
from support.delay_proxy import delay_proxy
from support.pytest_process import LEAN, start_pytest

from pytest_gpubench.ledger.writer import read_ledger

pytestmark = pytest.mark.engine

if TYPE_CHECKING:
    from pytest_gpubench.engines.managed import ManagedLlamaServer

# Four checkpoints (the last one final); each call of the tiny model takes milliseconds, so a
# checkpoint lands well within CHECKPOINT_S of its boundary even on a loaded machine.
DURATION_S = 4
CHECKPOINT_S = 1.0


def timed_bench(pytester: pytest.Pytester, llama_server: Path) -> None:
    pytester.makefile(
        ".yaml",
        prompts=ONE_PROMPT,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, server_binary: '{llama_server}', "
        f"server_args: [--threads, '1'], phases: [warm], duration_s: {DURATION_S}, "
        f"checkpoint_s: {CHECKPOINT_S}}}\n",
    )
    pytester.makepyfile(test_bench=CHECKED_TEST_FILE)


def test_a_timed_run_writes_a_checkpoint_every_checkpoint_s(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    timed_bench(pytester, llama_server)
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)  # one timed warm case per prompt
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    checkpoints = [r for r in records if r["type"] == "checkpoint"]
    assert [c["checkpoint_idx"] for c in checkpoints] == [1, 2, 3, 4]
    assert [c["final"] for c in checkpoints] == [False, False, False, True]
    for checkpoint in checkpoints[:3]:
        boundary = checkpoint["checkpoint_idx"] * CHECKPOINT_S
        assert boundary <= checkpoint["elapsed_s"] < boundary + CHECKPOINT_S
    assert DURATION_S <= checkpoints[-1]["elapsed_s"] < DURATION_S + 10
    calls = [r for r in records if r["type"] == "call"]
    assert sorted(c["timed_idx"] for c in calls) == list(range(len(calls)))
    assert sum(c["calls"] for c in checkpoints) == len(calls) == checkpoints[-1]["calls_so_far"]
    assert all(c["error"] is None and c["completion_tokens"] == 8 for c in calls)
    assert all(c["tokens_per_sec_p50"] is None or c["tokens_per_sec_p50"] > 0 for c in checkpoints)
    assert all(c["ttft_p50_ms"] > 0 for c in checkpoints)
    assert records[-1]["type"] == "end" and records[-1]["calls"] == len(calls)


def test_a_timed_run_killed_between_checkpoints_keeps_the_two_before_it(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    timed_bench(pytester, llama_server)
    process = start_pytest(pytester, *LEAN)
    ledger_path: Path | None = None
    seen: list[dict[str, object]] = []
    deadline = time.monotonic() + 180
    try:
        # Killed as soon as the second checkpoint is written: the third comes CHECKPOINT_S
        # later, and the run dies between them.
        while time.monotonic() < deadline and process.poll() is None and len(seen) < 2:
            time.sleep(0.02)
            ledgers = list((pytester.path / "runs").glob("*.jsonl"))
            if ledgers:
                ledger_path = ledgers[0]
                # Whole lines only: the last one may be half written.
                lines = ledger_path.read_text().split("\n")[:-1]
                seen = [json.loads(line) for line in lines if '"type":"checkpoint"' in line]
        assert len(seen) >= 2, process.stdout.read() if process.stdout else ""
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=30)
    assert ledger_path is not None
    records = read_ledger(ledger_path)
    checkpoints = [r for r in records if r["type"] == "checkpoint"]
    assert [c["checkpoint_idx"] for c in checkpoints] == [1, 2]
    assert all(not c["final"] for c in checkpoints)
    calls = [r for r in records if r["type"] == "call"]
    assert len(calls) == checkpoints[-1]["calls_so_far"] > 0  # the calls before it, kept
    assert all(r["type"] != "end" for r in records)  # killed: no end record, nothing lost
    # Killed before its first case ended: the cell record, written ahead of the checkpoints,
    # still says what was measured.
    (described,) = [r for r in records if r["type"] == "cell"]
    assert described["cell_id"] == "local:llamacpp:tiny" and described["engine_url"]


def test_a_stream_with_no_token_for_stall_s_is_aborted_and_recorded(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    """The real llama-server behind a proxy that holds its first token back 1.5 s: with
    `stall_s: 0.4` each call is cut off after 0.4 s without a token, recorded as stalled, and
    the timed run's checkpoints count the stalls."""
    with delay_proxy(server.base_url, delay_ms=1500) as proxy:
        pytester.makefile(
            ".yaml",
            prompts=ONE_PROMPT,
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{proxy.url}', "
            "phases: [warm], duration_s: 3, checkpoint_s: 1.5, stall_s: 0.4}\n",
        )
        pytester.makepyfile(
            test_bench="def test_generate(gpubench_case):\n    gpubench_case.run()\n"
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    calls = [r for r in records if r["type"] == "call"]
    assert calls and all(c["error"].startswith("stalled: no token for 0.4 s") for c in calls)
    assert all(c["finish_reason"] == "error" for c in calls)
    # Cut off at stall_s, not after the 1.5 s the token took.
    assert all(c["total_duration_ms"] < 1200 for c in calls)
    checkpoints = [r for r in records if r["type"] == "checkpoint"]
    assert checkpoints and sum(c["stalls"] for c in checkpoints) == len(calls)
    assert all(c["stalls"] == c["errors"] == c["calls"] for c in checkpoints)
