"""Realistic call records, built by the plugin's own record builder (ledger.records.call_record)
from a measurement shaped like a real one: the shipped prompts of mixed length (P-EASY 64 tokens,
P-MEDIUM 512, P-HARD 1024, as the tiny model answers them: it ignores EOS), one gap per token
measured to the ns and rounded as measure.stream rounds it, llama-server's `timings`, and the
telemetry fields filled. `packed=False` gives the record as it was written before issue 24 (the
gaps a list of ms), `compact=False` with its cell's keys (run id, node, engine, model) in it, as
written before issue 24 too; and the bytes per record of each, for P-EASY and P-HARD:

    python benchmarks_dev/realistic_ledger.py
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pytest_gpubench.config.cases import Case, build_cases
from pytest_gpubench.config.cell import Cell
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.ledger.gaps import PACKED_FIELD, unpack_gaps
from pytest_gpubench.ledger.records import call_record, cell_record
from pytest_gpubench.ledger.schema import as_json
from pytest_gpubench.ledger.writer import CellKeys, record_line
from pytest_gpubench.measure.call_measurement import CallMeasurement
from pytest_gpubench.telemetry.aggregate import TelemetryFields

PROMPT_TOKENS = {"P-EASY": 64, "P-MEDIUM": 512, "P-HARD": 1024}
PROMPTS = Path(__file__).parent.parent / "prompts.yaml"


def cells_and_cases(cells: int) -> list[tuple[Cell, Case]]:
    """`cells` llama.cpp cells on nodes of their own, with their warm cases of every prompt."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "cells.yaml"
        nodes = "".join(f"  node{i}: {{kind: local}}\n" for i in range(cells))
        rows = "".join(
            f"  - {{node: node{i}, engine: llamacpp, model: tiny,"
            f" endpoint: 'http://127.0.0.1:{9000 + i}', runs: 1}}\n"
            for i in range(cells)
        )
        path.write_text(f"nodes:\n{nodes}cells:\n{rows}")
        matrix = read_matrix(path, PROMPTS)
    by_id = {cell.cell_id: cell for cell in matrix.cells}
    return [
        (by_id[case.cell_id], case)
        for case in build_cases(matrix)
        if case.phase == "warm" and case.prompt_id in PROMPT_TOKENS
    ]


def measurement(rng: random.Random, tokens: int) -> CallMeasurement:
    """One successful call of `tokens` tokens at about 4.5 ms a token (the gaps drawn in ns by
    numpy, seeded from `rng`, and rounded as measure.stream rounds them)."""
    draw = np.random.default_rng(rng.getrandbits(64))
    arrivals = np.cumsum(draw.lognormal(15.3, 0.35, tokens - 1).astype(np.int64))
    gaps = np.round(np.diff(arrivals, prepend=0) / 1e6, 4).tolist()
    ttft = round(rng.lognormvariate(3.0, 0.3), 4)
    total = round(ttft + int(arrivals[-1]) / 1e6, 4)
    decode = (total - ttft) / (tokens - 1)
    return CallMeasurement(
        first_delta_ms=ttft,
        total_duration_ms=total,
        prompt_tokens=24,
        completion_tokens=tokens,
        client_chunks=tokens,
        tokens_per_sec=round(1000 / decode, 3),
        tpot_ms=round(decode, 6),
        inter_chunk_ms=gaps,
        finish_reason="length",
        backend="llamacpp",
        engine_timings={
            "cache_n": 0,
            "prompt_n": 24,
            "prompt_ms": 1.52,
            "prompt_per_token_ms": 0.063,
            "prompt_per_second": 15789.5,
            "predicted_n": tokens,
            "predicted_ms": round(total - ttft, 3),
            "predicted_per_token_ms": round(decode, 4),
            "predicted_per_second": round(1000 / decode, 3),
        },
        e2e_tokens_per_sec=round(tokens / total * 1000, 3),
        content_reads=tokens,
        engine_tokens_per_sec=round(1000 / decode, 3),
        engine_prompt_ms=1.52,
        engine_total_ms=round(total - ttft + 1.52, 4),
        connection_reused=True,
    )


def telemetry(rng: random.Random, tokens: int) -> TelemetryFields:
    energy = rng.uniform(20.0, 90.0)
    cpu = rng.uniform(0.2, 4.0)
    return {
        "telemetry_interval_ms": 100, "telemetry_gpu_source": "nvml",
        "telemetry_cpu_source": "proc", "telemetry_samples": rng.randint(2, 60),
        "telemetry_notes": None, "gpu_peak_memory_used_mib": rng.uniform(5000, 9000),
        "gpu_memory_total_mib": 24576.0, "gpu_utilization_mean_pct": rng.uniform(40, 99),
        "gpu_power_mean_w": rng.uniform(150, 300), "gpu_temperature_max_c": rng.uniform(50, 80),
        "gpu_energy_j": energy, "gpu_energy_source": "nvml_counter",
        "gpu_energy_j_per_token": energy / tokens, "gpu_tokens_per_j": tokens / energy,
        "engine_cpu_s": cpu, "engine_cpu_s_per_token": cpu / tokens,
        "engine_peak_rss_mib": rng.uniform(800, 1200),
        "system_mem_used_peak_mib": rng.uniform(8000, 12000),
        "system_load1_max": rng.uniform(0.5, 3.0), "engine_gpu_memory_peak_mib": None,
    }  # fmt: skip


RUN_ID = "00000000-0000-4000-8000-000000000000"


def cell_lines(cells: int = 40) -> list[str]:
    """The cells' records (engine facts, one GPU), as a session writes them before the calls."""
    seen: dict[str, Cell] = {}
    for cell, _ in cells_and_cases(cells):
        seen.setdefault(cell.cell_id, cell)
    return [record_line(cell_of(cell)) for cell in seen.values()]


def cell_of(cell: Cell) -> dict[str, Any]:
    return as_json(
        cell_record(
            run_id=RUN_ID,
            cell=cell,
            engine_facts={
                "engine_version": "b6000 (abc123)",
                "model_digest": "sha256:" + "7e" * 32,
            },
            gpus=[{"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": "81559"}],
            gpu_summary="1x NVIDIA H100 80GB HBM3",
            node_info={"cpu_model": "x86_64", "cpu_count": 2015},
            engine_url=cell.endpoint_as_written,
        )
    )


def records(
    count: int, cells: int = 40, seed: int = 0, packed: bool = True, compact: bool = True
) -> Iterator[str]:
    """`count` call record lines, the cells' prompts in turn; `compact`: as the ledger writes
    them after its cell records (cell_lines), without their cell's keys."""
    rng = random.Random(seed)
    cases = cells_and_cases(cells)
    cell_keys = CellKeys()
    if compact:
        for cell, _ in cases:
            cell_keys.note(cell_of(cell))
    for number in range(count):
        cell, case = cases[number % len(cases)]
        tokens = PROMPT_TOKENS[case.prompt_id]
        record = as_json(
            call_record(
                run_id=RUN_ID,
                cell=cell,
                case=case,
                prompt_sha256="ab" * 32,
                cold_kind=None,
                started_at_utc="2026-11-25T10:00:00.000000Z",
                measurement=measurement(rng, tokens),
                telemetry=telemetry(rng, tokens),
            )
        )
        record["run_idx"] = number // len(cases)
        if not packed:
            record = unpacked(record)
        yield record_line(cell_keys.compact(record))


def unpacked(record: dict[str, Any]) -> dict[str, Any]:
    """The record as it was written before issue 24: its gaps a list of ms, in the same place."""
    return {
        ("inter_chunk_ms" if key == PACKED_FIELD else key): (
            unpack_gaps(value) if key == PACKED_FIELD else value
        )
        for key, value in record.items()
    }


def main() -> None:
    cases = cells_and_cases(1)
    rng = random.Random(1)
    cell_keys = CellKeys()
    cell_keys.note(cell_of(cases[0][0]))
    print(
        f"{'prompt':10} {'tokens':>6} {'before B':>9} {'gaps packed B':>14} "
        f"{'+ cell keys once B':>19} {'after/before':>13}"
    )
    for prompt_id in ("P-EASY", "P-HARD"):
        cell, case = next((c, k) for c, k in cases if k.prompt_id == prompt_id)
        tokens = PROMPT_TOKENS[prompt_id]
        record = as_json(call_record(
            run_id=RUN_ID, cell=cell, case=case,
            prompt_sha256="ab" * 32, cold_kind=None,
            started_at_utc="2026-11-25T10:00:00.000000Z",
            measurement=measurement(rng, tokens), telemetry=telemetry(rng, tokens),
        ))  # fmt: skip
        before = len(record_line(unpacked(record)).encode()) + 1
        packed = len(record_line(record).encode()) + 1
        after = len(record_line(cell_keys.compact(record)).encode()) + 1
        print(
            f"{prompt_id:10} {tokens:6} {before:9,} {packed:14,} {after:19,} {after / before:13.2f}"
        )
    example = json.loads(next(records(1, compact=False)))
    print("\nfields of a record:", len(example), "written:", len(json.loads(next(records(1)))))


if __name__ == "__main__":
    main()
