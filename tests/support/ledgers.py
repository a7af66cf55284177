"""Generated ledgers shaped like a real run's (meta, cell, call, sample, load and end records), for
the report, history, export, merge and gate tests."""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_gpubench.ledger.writer import compact_records, read_ledger
from pytest_gpubench.results.gate import compare
from pytest_gpubench.results.stats import summarize

CELLS = ("local:llamacpp:tiny", "gpu1:llamacpp:qwen")
PROMPTS = ("P-EASY", "P-HARD")


def run_records(
    run_id: str,
    *,
    seed: int = 0,
    slowdown: float = 1.0,
    warm: int = 30,
    started: str = "2026-11-01T10:00:00.000Z",
    baseline_update: bool = False,
    samples: bool = True,
    against: Sequence[dict[str, Any]] | None = None,
    cells: Sequence[str] = CELLS,
) -> list[dict[str, Any]]:
    """One run: per cell and prompt a cold call and `warm` warm calls (TTFT x slowdown); the end
    record judges it against the records of `against` (another run), as the gate does."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = [
        {
            "type": "meta",
            "benchmark_run_id": run_id,
            "git_sha": f"{seed:07x}",
            "git_dirty": False,
            "started_at_utc": started,
            "host": "bench-host",
            "platform": "Linux",
            "plugin_version": "0.1.0",
            "harness_version": "1",
            "command_line": [
                "pytest",
                "benchmarks/",
                *(["--baseline-update"] if baseline_update else []),
            ],
            "rootdir": "/nonexistent",
        }
    ]
    for cell_id in cells:
        records.append(
            {
                "type": "cell",
                "cell_id": cell_id,
                "engine": "llamacpp",
                "engine_version": "b6000 (abc123)",
                "model": cell_id.rsplit(":", 1)[-1],
                "model_digest": "sha256:77ea1bb2a447",
                "gpus": [{"name": "NVIDIA H100 80GB HBM3"}],
                "gpu_summary": "1x NVIDIA H100 80GB HBM3",
                "benchmark_run_id": run_id,
            }
        )
    for cell_number, cell_id in enumerate(cells):
        for prompt_number, prompt_id in enumerate(PROMPTS):
            base = 20.0 + 15 * cell_number + 30 * prompt_number
            for run_idx in range(warm + 1):
                phase = "cold" if run_idx == 0 else "warm"
                ttft = base * (8 if phase == "cold" else slowdown) * rng.lognormvariate(0, 0.05)
                decode = 400.0 / slowdown * rng.lognormvariate(0, 0.05)
                total = ttft + 64 / decode * 1000
                failed = phase == "warm" and run_idx == 3 and cell_number == 1
                records.append(
                    {
                        "type": "call",
                        "benchmark_run_id": run_id,
                        "cell_id": cell_id,
                        "node": cell_id.split(":")[0],
                        "engine": "llamacpp",
                        "model": cell_id.rsplit(":", 1)[-1],
                        "prompt_id": prompt_id,
                        "prompt_sha256": f"sha-{prompt_id}",
                        "phase": phase,
                        "run_idx": run_idx,
                        "case_id": f"{cell_id}-{prompt_id}-{phase}-{run_idx}",
                        "cold_kind": "restart" if phase == "cold" else None,
                        "started_at_utc": f"2026-11-01T10:{run_idx // 60:02d}:{run_idx % 60:02d}.000Z",
                        "first_delta_ms": None if failed else round(ttft, 3),
                        "total_duration_ms": None if failed else round(total, 3),
                        "prompt_tokens": None if failed else 12,
                        "completion_tokens": None if failed else 64,
                        "client_chunks": 0 if failed else 64,
                        "tokens_per_sec": None if failed else round(decode, 3),
                        "tpot_ms": None if failed else round(1000 / decode, 4),
                        "inter_chunk_ms": [] if failed else [2.5, 2.4, 2.6],
                        "finish_reason": "error" if failed else "length",
                        "backend": "llamacpp",
                        "error": "connection reset by peer" if failed else None,
                        "engine_timings": {} if failed else {"prompt_ms": 1.5},
                        "e2e_tokens_per_sec": None if failed else round(64 / total * 1000, 3),
                        "coalesced": None if failed else False,
                        "content_reads": None if failed else 64,
                        "engine_tokens_per_sec": None if failed else round(decode * 1.02, 3),
                        "engine_prompt_ms": None if failed else 1.5,
                        "engine_total_ms": None if failed else round(total * 0.97, 3),
                        "worker": None,
                    }
                )
                if samples and run_idx < 4:
                    records.append(_sample(run_id, cell_id, prompt_id, phase, run_idx, rng))
    records.append(_end(run_id, records, against))
    return records


def load_records(
    run_id: str,
    cell_id: str,
    *,
    seed: int = 0,
    slowdown: float = 1.0,
    points: Sequence[int] = (1, 4),
) -> list[dict[str, Any]]:
    """A cell's closed-loop load points (`c<N>` for each concurrency N) on P-EASY, each with the
    figures and per-request samples the gate compares (load/gate.py); output tokens/s / slowdown,
    TTFT and TPOT x slowdown."""
    rng = random.Random(seed)
    records = []
    for concurrency in points:
        throughput = [
            400.0 * concurrency / slowdown * rng.lognormvariate(0, 0.03) for _ in range(12)
        ]
        ttft = [20.0 * slowdown * rng.lognormvariate(0, 0.05) for _ in range(24)]
        tpot = [2.5 * slowdown * rng.lognormvariate(0, 0.05) for _ in range(24)]
        records.append(
            {
                "type": "load",
                "benchmark_run_id": run_id,
                "cell_id": cell_id,
                "node": cell_id.split(":")[0],
                "engine": "llamacpp",
                "model": cell_id.rsplit(":", 1)[-1],
                "prompt_id": "P-EASY",
                "prompt_sha256": "sha-P-EASY",
                "phase": "load",
                "case_id": f"{cell_id}-P-EASY-load-c{concurrency}",
                "load_point": f"c{concurrency}",
                "pattern": "closed",
                "concurrency": concurrency,
                "rate": None,
                "arrival": None,
                "started_at_utc": "2026-11-01T10:03:00.000Z",
                "requests": 24,
                "ok": 24,
                "errors": 0,
                "timeouts": 0,
                "valid": True,
                "invalid_reason": None,
                "achieved_rate": round(concurrency * 6.0 / slowdown, 3),
                "output_tokens_per_sec": round(statistics.median(throughput), 3),
                "ttft_ms_p50": round(statistics.median(ttft), 3),
                "ttft_ms_p99": round(max(ttft), 3),
                "tpot_ms_p50": round(statistics.median(tpot), 4),
                "tpot_ms_p99": round(max(tpot), 4),
                "e2e_ms_p99": round(max(ttft) + 64 * max(tpot), 3),
                "goodput_rate": None,
                "slo": None,
                "send_lag_ms_p99": 0.2,
                "samples": {"output_tokens_per_sec": throughput, "ttft_ms": ttft, "tpot_ms": tpot},
                "error": None,
                "worker": None,
            }
        )
    return records


def _sample(
    run_id: str, cell_id: str, prompt_id: str, phase: str, run_idx: int, rng: random.Random
) -> dict[str, Any]:
    times = [float(t) for t in range(0, 500, 100)]
    return {
        "type": "sample",
        "benchmark_run_id": run_id,
        "cell_id": cell_id,
        "node": cell_id.split(":")[0],
        "case_id": f"{cell_id}-{prompt_id}-{phase}-{run_idx}",
        "prompt_id": prompt_id,
        "phase": phase,
        "run_idx": run_idx,
        "interval_ms": 100,
        "gpu_source": "nvidia-smi",
        "cpu_source": "proc",
        "gpu": {
            "t_ms": times,
            "gpu": [0] * len(times),
            "utilization_pct": [round(rng.uniform(40, 95), 1) for _ in times],
            "memory_used_mib": [4000.0 + 10 * index for index in range(len(times))],
            "power_w": [round(rng.uniform(150, 300), 1) for _ in times],
        },
        "cpu": {
            "t_ms": times,
            "engine_rss_mib": [512.0] * len(times),
            "load1": [round(rng.uniform(0.5, 2.0), 2) for _ in times],
        },
        "notes": None,
        "worker": None,
    }


def _end(
    run_id: str, records: list[dict[str, Any]], against: Sequence[dict[str, Any]] | None
) -> dict[str, Any]:
    verdicts = compare(summarize(against), summarize(records)) if against else []
    cell_ids = sorted({r["cell_id"] for r in records if r["type"] == "call"})
    return {
        "type": "end",
        "benchmark_run_id": run_id,
        "finished_at_utc": "2026-11-01T10:05:00.000Z",
        "verdicts": [verdict.to_record() for verdict in verdicts],
        "regressions": sum(verdict.verdict == "regression" for verdict in verdicts),
        "gate_error": None,
        "cells": [
            {
                "cell_id": cell_id,
                "node": cell_id.split(":")[0],
                "status": "measured",
                "optional": False,
                "calls": 62,
                "ok_calls": 61,
            }
            for cell_id in cell_ids
        ]
        + [
            {
                "cell_id": "rented:vllm:llama",
                "node": "rented",
                "status": "failed",
                "optional": False,
                "stage": "provision",
                "reason": "no offer under max_price_per_hour",
                "calls": 0,
                "ok_calls": 0,
            }
        ],
        "exit_status": 1,
    }


def write(path: Path, records: Sequence[dict[str, Any]], *, compact: bool = False) -> Path:
    """The records as JSON lines: whole (as ledgers were written before issue 24), or `compact`
    as a session writes them (call records without their cell's keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as ledger:
        for record in compact_records(records) if compact else records:
            ledger.write(json.dumps(record, separators=(",", ":")) + "\n")
    return path


def read(path: Path) -> list[dict[str, Any]]:
    """A ledger's records as the plugin reads them (call records with their cell's keys)."""
    return read_ledger(path)


def judged_against(directory: Path) -> list[str]:
    """`gpubench merge`'s --baselines: `directory`/baselines (made, empty, where absent), which
    the merged records are judged against for the merged end record."""
    baselines = directory / "baselines"
    baselines.mkdir(parents=True, exist_ok=True)
    return ["--baselines", str(baselines)]
