"""LoRA adapters on the real llama-server: two adapters generated for the tiny model (as the
model itself is generated), each on a managed cell of its own (`lora: tiny-lora-<seed>`). They
answer the same prompt differently, and each adapter's cell gets its own baseline and verdicts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_gpubench.core.files import file_sha256
from pytest_gpubench.engines.tinymodel import ensure_tiny_lora, tiny_lora_seed
from pytest_gpubench.ledger.writer import read_ledger

pytestmark = pytest.mark.engine

PROMPTS = 'prompts:\n  P-EASY: {intent: short, prompt: "hello there", max_tokens: 8}\n'
TESTS = """
def test_generate(gpubench_case):
    gpubench_case.run()


def test_answer(gpubench_engine):
    call = gpubench_engine.chat("hello there", max_tokens=8, temperature=0)
    assert call.error is None, call.error
    print("ANSWER", gpubench_engine.cell.cell_id, repr(call.text))
"""
ADAPTED = ("local:llamacpp:tiny@lora-1", "local:llamacpp:tiny@lora-2")


def test_two_generated_adapters_answer_differently_and_are_judged_each_on_its_own(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    managed = (
        f"node: local, engine: llamacpp, model: tiny, runs: 4, phases: [warm], "
        f"server_binary: '{llama_server}', server_args: [--threads, '1']"
    )
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{{managed}}}\n"
        f"  - {{{managed}, name: lora-1, lora: tiny-lora-1}}\n"
        f"  - {{{managed}, name: lora-2, lora: tiny-lora-2}}\n",
    )
    pytester.makepyfile(test_bench=TESTS)
    steady = ("--force-load", "--gpubench-steadiness", "off", "-s")
    ratified = pytester.runpytest(*steady, "--baseline-update")
    assert ratified.ret == 0, ratified.stdout.str()
    answers = dict(re.findall(r"ANSWER (\S+) '(.*)'", ratified.stdout.str()))
    assert set(answers) == {"local:llamacpp:tiny", *ADAPTED}
    # Three answers, all different: each adapter changes what the model says.
    assert len(set(answers.values())) == 3, answers
    baselines = sorted(path.name for path in (pytester.path / "baselines").glob("*.json"))
    assert baselines == [
        "local_llamacpp_tiny.json",
        "local_llamacpp_tiny_lora-1.json",
        "local_llamacpp_tiny_lora-2.json",
    ]
    # Each adapter is part of its cell's setup: its digest follows the model's.
    first = min((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    digests = {r["cell_id"]: r["model_digest"] for r in read_ledger(first) if r["type"] == "cell"}
    model = digests["local:llamacpp:tiny"]
    for cell, seed in zip(ADAPTED, (1, 2), strict=True):
        adapter = f"sha256:{file_sha256(ensure_tiny_lora(seed))}"
        assert digests[cell] == f"{model}+lora:{adapter}"
    # A second run is judged per adapter, against that adapter's baseline.
    judged = pytester.runpytest(*steady)
    assert judged.ret in (0, 10), judged.stdout.str()
    for cell in ADAPTED:
        verdict = rf"{re.escape(cell)}\s+P-EASY\s.*\s(pass|win|unsteady|blind|inconclusive)\s*$"
        judged.stdout.re_match_lines([verdict])
    newest = max((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    (end,) = [r for r in read_ledger(newest) if r["type"] == "end"]
    judged_cells = {v["cell_id"] for v in end["verdicts"] if v["metric"] == "warm_ttft_p50_ms"}
    assert judged_cells == {"local:llamacpp:tiny", *ADAPTED}


def test_a_generated_adapter_is_written_once_and_named_by_its_seed(tmp_path: Path) -> None:
    assert (tiny_lora_seed("tiny-lora-7"), tiny_lora_seed("tiny-lora-x")) == (7, None)
    first = ensure_tiny_lora(1, tmp_path)
    written = first.read_bytes()
    other = ensure_tiny_lora(2, tmp_path)
    assert ensure_tiny_lora(1, tmp_path) == first and other != first
    assert written != other.read_bytes()
    # The same seed writes the same bytes: a baseline's adapter is the one written again.
    first.unlink()
    assert ensure_tiny_lora(1, tmp_path).read_bytes() == written
