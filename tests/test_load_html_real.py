"""The HTML report's load section from a real llama-server sweep (the tiny model, 4 slots,
/metrics on): a baseline run and a second run, the report drawn against the load baseline and
opened in headless Chromium (charts drawn, no console errors). The record of each point carries
llama-server's own prompt and generation times beside the client's."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from test_html_report import chromium, console_problems, needs_chromium

from pytest_gpubench.cli.main import main
from pytest_gpubench.core.status import EXIT_UNSTEADY
from pytest_gpubench.ledger.writer import read_ledger

PROMPTS = "prompts:\n  P-LOAD: {intent: load, prompt: 'Count to ten.', max_tokens: 32}\n"
TEST_FILE = (Path(__file__).parent.parent / "benchmarks" / "test_inference.py").read_text()
CELLS = (
    "nodes: {local: {kind: local}}\ncells:\n"
    "  - {node: local, engine: llamacpp, model: tiny, parallel: 4,"
    " server_args: [--threads, '1'], load: {sweep: {rates: 2, max_concurrency: 4},"
    " requests: 8, max_send_lag_ms: 50, slo: {ttft_ms: 400}}}\n"
)
# Where a copy of the screenshot goes when set (to look at it, or check it in under docs/).
SCREENSHOT_COPY = "GPUBENCH_LOAD_SCREENSHOT"


def newest_ledger(root: Path) -> Path:
    return max((root / "runs").glob("*.jsonl"), key=lambda path: path.stat().st_mtime)


@needs_chromium
@pytest.mark.browser
@pytest.mark.engine
def test_a_real_sweep_draws_its_load_section_in_chromium(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path, tmp_path: Path
) -> None:
    pytester.makefile(".yaml", prompts=PROMPTS, cells=CELLS)
    pytester.makepyfile(test_bench=TEST_FILE)
    args = ("--force-load", "--allow-dirty", "-p", "no:cacheprovider", "-m", "load",
            "--gpubench-steadiness", "off")  # fmt: skip
    # In this process: llama-server is a process of its own, and a subprocess would add 2-5 s of
    # imports to each run.
    update = pytester.runpytest(*args, "--baseline-update")
    assert update.ret == 0, update.stdout.str()[-3000:]
    second = pytester.runpytest(*args)
    # Judged: passed, regressed, or not told (exit 10: a point's evidence too thin to rule out
    # a change of the threshold's size); the HTML below is the subject.
    assert second.ret in (0, 6, EXIT_UNSTEADY), second.stdout.str()[-3000:]
    ledger = newest_ledger(pytester.path)
    records = read_ledger(ledger)
    steps = [r for r in records if r["type"] == "load" and r["pattern"] != "sweep"]
    assert {r["sweep_step"] for r in steps} == {"c1", "c4", "s1", "s2"}
    for step in steps:
        check = step["server_check"]
        assert check is not None and check["engine"] == "llamacpp", step["engine_metrics_notes"]
        assert check["ttft_ms"]["server_mean"] > 0 and check["tpot_ms"]["server_mean"] > 0

    output = tmp_path / "report.html"
    baselines = pytester.path / "baselines"
    assert (
        main(["report", str(ledger), "--html", "-o", str(output), "--baselines", str(baselines)])
        == 0
    )
    page = output.read_text()
    section = page.split("<h2>Load</h2>", 1)[1].split("<h2>", 1)[0]
    # One chart (four panels) for the sweep, this run's points beside the baseline's.
    charts = re.findall(r"<svg\b.*?</svg>", section, flags=re.S)
    assert len(charts) == 1
    for label in ("output tokens/s", "TTFT p99 ms against req/s", "send lag p99 ms",
                  "(baseline)", "saturation", "SLO TTFT", "sweep-c4"):  # fmt: skip
        assert label in charts[0], label
    assert "TTFT client / engine / offset ms" in section

    screenshot = tmp_path / "load.png"
    anchor = tmp_path / "load.html"
    # The load section alone, with the report's own head (style): Chromium's --screenshot takes
    # the top of a page.
    head = page.split("<body>", 1)[0]
    anchor.write_text(f"{head}<body>\n<h2>Load</h2>{section}</body></html>\n")
    shot = chromium(anchor, tmp_path / "profile-1", "--window-size=1300,1100",
                    "--hide-scrollbars", f"--screenshot={screenshot}")  # fmt: skip
    dom = chromium(output, tmp_path / "profile-2", "--dump-dom")
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 50_000
    assert console_problems(shot.stderr + dom.stderr) == []
    # Chromium parsed the load chart (and the telemetry chart after it) into its DOM.
    assert "TTFT p99 ms against req/s" in dom.stdout and len(re.findall(r"<svg\b", dom.stdout)) >= 1
    if os.environ.get(SCREENSHOT_COPY):
        shutil.copy(screenshot, os.environ[SCREENSHOT_COPY])
        shutil.copy(output, Path(os.environ[SCREENSHOT_COPY]).with_suffix(".html"))
