"""LoRA verdicts per adapter on chosen numbers (issue 44): the LoRA tests of test_lora_real.py
show that each adapter is judged on its own, but with thresholds of 1000 % and exit 0 or 10
accepted they could not fail on a verdict. Here one adapter is made slower by a chosen amount and
the other is not, on the real llama-server, and the gate must name the slower one alone.

An `openai` cell with `lora: [one, two]` names each adapter as the request's `model` (as vLLM
serves adapters); the delaying proxy in front of the llama-server (support/delay_proxy.py) holds
back the first content of adapter `two`'s requests only. Every call is held back BASE_DELAY_MS in
both runs, so the tiny model's own few-ms TTFT, which a shared machine moves by half, is a small
part of what is compared, and the 60 % added to `two` stands far above it."""

from __future__ import annotations

import json
import re

import pytest
from support.delay_proxy import delay_proxy

from pytest_gpubench.core.status import EXIT_REGRESSION
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.ledger.writer import read_ledger

pytestmark = pytest.mark.engine

CELL = "local:openai:tiny"
PROMPTS = 'prompts:\n  P-EASY: {intent: short, prompt: "hello there", max_tokens: 4}\n'
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
BASE_DELAY_MS = 30.0
RUNS = 20
# Adapter `two`'s requests, by the model they name.
ADAPTER_TWO = re.compile(rb'"model"\s*:\s*"two"')


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(
        "--force-load", "-p", "no:cacheprovider", "--gpubench-steadiness", "off",
        "--gpubench-runs", str(RUNS), *args,
    )  # fmt: skip


def verdicts(pytester: pytest.Pytester) -> dict[tuple[str, str], str]:
    newest = max((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    (end,) = [r for r in read_ledger(newest) if r["type"] == "end"]
    return {(v["prompt_id"], v["metric"]): v["verdict"] for v in end["verdicts"]}


def test_one_adapter_60_percent_slower_to_first_token_exits_6_naming_that_adapter_alone(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    with delay_proxy(server.base_url) as proxy:
        pytester.makefile(
            ".yaml",
            prompts=PROMPTS,
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: tiny, endpoint: '{proxy.url}', "
            "lora: [one, two], phases: [warm]}\n",
        )
        pytester.makepyfile(test_bench=TEST_FILE)
        proxy.delay_ms = BASE_DELAY_MS
        ratified = run(pytester, "--baseline-update")
        assert ratified.ret == 0, ratified.stdout.str()[-3000:]
        baseline = json.loads((pytester.path / "baselines" / "local_openai_tiny.json").read_text())
        stored = baseline["prompts"]["P-EASY@two"]["warm"]["first_delta_ms"]["p50"]
        # Adapter two alone: 60 % of its baseline's TTFT p50 more (the threshold is 20 %).
        proxy.extra_delay = (ADAPTER_TWO, 0.60 * float(stored))
        slower = run(pytester)
    assert slower.ret == EXIT_REGRESSION, slower.stdout.str()[-3000:]
    judged = verdicts(pytester)
    assert judged[("P-EASY@two", "warm_ttft_p50_ms")] == "regression", judged
    assert judged[("P-EASY@one", "warm_ttft_p50_ms")] != "regression", judged
    regressed = {prompt for (prompt, _metric), verdict in judged.items() if verdict == "regression"}
    assert regressed == {"P-EASY@two"}, judged
    slower.stdout.fnmatch_lines(
        [
            f"REGRESSION: {CELL} P-EASY@two: warm TTFT p50 +*",
            "gpubench: exit status 6: benchmarks ran and at least one regressed",
        ]
    )
    assert f"REGRESSION: {CELL} P-EASY@one" not in slower.stdout.str()
