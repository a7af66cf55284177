"""Inter-chunk gaps packed in the ledger: restored exactly, a call record carries them packed,
a record written before (a list of ms) still reads, a corrupt one is one clear error, and a load
point's summary is the same from either."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from pytest_gpubench.config.cases import build_cases
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.ledger.gaps import gaps_ms, pack_gaps, unpack_gaps
from pytest_gpubench.ledger.records import call_record
from pytest_gpubench.ledger.writer import record_line
from pytest_gpubench.measure.call_measurement import CallMeasurement
from pytest_gpubench.results.load_summary import summarize_point


def measured_gaps(count: int, seed: int = 0) -> list[float]:
    """Gaps as measure.stream stores them: ns differences rounded to 4 decimals of a ms."""
    rng = random.Random(seed)
    arrivals = [0]
    for _ in range(count):
        arrivals.append(arrivals[-1] + int(rng.lognormvariate(15.3, 0.4)))  # about 4.5 ms
    return [round((b - a) / 1e6, 4) for a, b in itertools.pairwise(arrivals)]


def test_gaps_restore_exactly_and_take_about_half_the_bytes() -> None:
    gaps = measured_gaps(1023)
    packed = pack_gaps(gaps)
    assert unpack_gaps(packed) == gaps
    assert unpack_gaps(pack_gaps([])) == []
    assert len(packed) < 0.6 * len(json.dumps(gaps, separators=(",", ":")))


def test_a_record_before_packing_still_reads_and_corrupt_text_is_one_error() -> None:
    assert gaps_ms({"inter_chunk_ms": [1.5, 2.25]}) == [1.5, 2.25]
    assert gaps_ms({}) == []
    with pytest.raises(ValueError, match="corrupt packed inter-chunk gaps"):
        unpack_gaps("z1:not base64!")
    with pytest.raises(ValueError, match="not packed"):
        unpack_gaps("[1.0]")


def test_a_call_record_carries_its_gaps_packed(tmp_path: Path) -> None:
    (tmp_path / "cells.yaml").write_text(
        "nodes: {local: {kind: local}}\n"
        "cells:\n  - {node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:1'}\n"
    )
    (tmp_path / "prompts.yaml").write_text(
        "prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 8}\n"
    )
    matrix = read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")
    gaps = measured_gaps(63)
    measurement = CallMeasurement(inter_chunk_ms=gaps, finish_reason="length", client_chunks=64)
    record = call_record(
        run_id="r",
        cell=matrix.cells[0],
        case=build_cases(matrix)[-1],
        prompt_sha256="s",
        cold_kind=None,
        started_at_utc="2026-11-25T00:00:00Z",
        measurement=measurement,
    )
    assert "inter_chunk_ms" not in record
    line = json.loads(record_line(record))
    assert gaps_ms(line) == gaps


def test_a_load_summary_is_the_same_from_packed_and_listed_gaps() -> None:
    calls = []
    for index in range(6):
        gaps = measured_gaps(15, seed=index)
        calls.append(
            {
                "send_ms": index * 50.0,
                "first_delta_ms": 10.0,
                "total_duration_ms": 10.0 + sum(gaps),
                "tpot_ms": sum(gaps) / 15,
                "completion_tokens": 16,
                "error": None,
                "finish_reason": "length",
                "load_window": "measured",
                "inter_chunk_ms": gaps,
            }
        )
    packed = [
        {**{k: v for k, v in c.items() if k != "inter_chunk_ms"},
         "inter_chunk_packed": pack_gaps(c["inter_chunk_ms"])}  # type: ignore[arg-type]
        for c in calls
    ]  # fmt: skip
    listed = summarize_point(calls, offered_rate=None, slo=None, max_send_lag_ms=None)
    again = summarize_point(packed, offered_rate=None, slo=None, max_send_lag_ms=None)
    assert listed == again and listed["itl_ms_n"] == 90
