"""The regression gate against the real llama-server, made slower on purpose by a delaying proxy.

The proxy (tests/support/delay_proxy.py) sits in front of a llama-server serving the tiny model and holds
back the first content of each streamed reply. The baseline is measured through the proxy with no
delay, so its own overhead is in the baseline and in every comparison alike.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

import pytest
from support.delay_proxy import DelayProxy, EngineSpeed, FirstContentSplitter, delay_proxy
from support.tiny_server import tiny_llama_server

from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.ledger.writer import read_ledger

CELL = "local:llamacpp:tiny"
PROMPT_ID = "P-EASY"
PROMPT = "What is the capital of France?"
# Long enough that tokens/s spans a few milliseconds of decoding; with 8 tokens it spans under
# one, and the scheduling of each chunk's delivery alone moves it by 30 % from run to run.
MAX_TOKENS = 64
PROMPTS = (
    f'prompts:\n  {PROMPT_ID}: {{intent: short, prompt: "{PROMPT}", max_tokens: {MAX_TOKENS}}}\n'
)
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
# Warm calls per run: 100 span about 1.5 s. This machine's speed changes within fractions of a
# second (the median of llama-server's own decode time over 0.25 s windows spans 2x, over 4 s
# windows 20 %); the longer a run, the more of those changes its medians average over.
RUNS = 100
# Even so, whole runs still differ by up to 50 %, llama-server's own prompt_ms and predicted_ms with
# them (benchmarks_dev/false_alarms.py counts what that does to the gate). These tests are about the
# change the proxy makes, so a run is judged only when llama-server answered as fast as during the
# baseline run just before it, as the proxy timed it (time to first content and to the last byte,
# both within STEADY); otherwise the pair is measured again, up to ATTEMPTS times.
STEADY = 0.10
ATTEMPTS = 8


@dataclass(frozen=True)
class Scenario:
    name: str
    test_id: str
    # The first content is held back by this fraction of the baseline's warm TTFT p50.
    delay_fraction: float
    exit_status: int


SCENARIOS = (
    Scenario("no delay", "unchanged", 0.0, 0),
    Scenario("+5 %", "ttft-5-percent-slower", 0.05, 0),
    Scenario("+60 %", "ttft-60-percent-slower", 0.60, 6),
)


@pytest.fixture(scope="module")
def upstream(
    llama_server: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A real llama-server (one thread), started once for the module; its base URL."""
    log_dir = tmp_path_factory.mktemp("llama-server-log")
    with tiny_llama_server(llama_server, tiny_model, log_dir, CELL) as managed:
        yield managed.base_url


@pytest.fixture(scope="module")
def running_proxy(upstream: str) -> Iterator[DelayProxy]:
    with delay_proxy(upstream) as proxy:
        yield proxy


@pytest.fixture
def proxy(running_proxy: DelayProxy) -> DelayProxy:
    """The module's proxy, passing through with no delay at the start of each test."""
    running_proxy.delay_ms = 0.0
    return running_proxy


# -- the proxy itself ---------------------------------------------------------------------------


def chunk(event: bytes) -> bytes:
    """One chunk of HTTP/1.1 chunked transfer encoding, as llama-server writes each event."""
    return f"{len(event):x}\r\n".encode() + event + b"\r\n"


ROLE_EVENT = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
FIRST_CONTENT_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":" Paris"}}]}\n\n'
STREAM = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + chunk(ROLE_EVENT)
    + chunk(FIRST_CONTENT_EVENT)
    + chunk(b'data: {"choices":[{"index":0,"delta":{"content":" is"}}]}\n\n')
    + b"0\r\n\r\n"
)


@pytest.mark.parametrize("piece", [len(STREAM), 64, 7, 1])
def test_the_split_falls_at_the_start_of_the_first_content_line(piece: int) -> None:
    splitter = FirstContentSplitter()
    before, after, split = b"", b"", False
    for start in range(0, len(STREAM), piece):
        now, later = splitter.feed(STREAM[start : start + piece])
        if split:
            after += now
        else:
            before += now
        if later is not None:
            after, split = after + later, True
    after += splitter.flush()
    assert before + after == STREAM  # nothing lost, nothing reordered
    # The chunk's size line goes ahead; the event line, whose first byte the client stamps, waits.
    assert before.endswith(ROLE_EVENT + b"\r\n" + f"{len(FIRST_CONTENT_EVENT):x}\r\n".encode())
    assert after.startswith(FIRST_CONTENT_EVENT)


@pytest.mark.engine
def test_the_proxy_passes_control_calls_and_delays_only_the_first_content(
    proxy: DelayProxy, upstream: str
) -> None:
    direct, proxied = LlamaCppEngine(upstream, "tiny"), LlamaCppEngine(proxy.url, "tiny")
    assert proxied.health(5).ok
    assert proxied.describe(5)["engine_version"] == direct.describe(5)["engine_version"]
    assert proxy.engine_calls == []  # /health and /props are never held
    proxy.delay_ms = 50.0
    held = proxied.chat(PROMPT, MAX_TOKENS, 30)
    assert held.error is None and held.finish_reason == "length"
    assert held.completion_tokens == MAX_TOKENS == held.client_chunks
    assert held.first_delta_ms is not None and held.first_delta_ms >= 50.0
    (call,) = proxy.wait_until_idle()
    assert call.first_content_ms < 50.0 <= held.first_delta_ms  # the engine was not slowed down


@pytest.mark.engine
def test_the_proxy_adds_little_to_ttft(proxy: DelayProxy, upstream: str) -> None:
    """Its overhead is in the baseline and the comparisons alike, but it must not swamp TTFT."""
    direct, proxied = LlamaCppEngine(upstream, "tiny"), LlamaCppEngine(proxy.url, "tiny")
    direct_ms: list[float] = []
    proxied_ms: list[float] = []
    # Alternating, so that both see the same state of a noisy machine.
    for _ in range(60):
        for engine, samples in ((direct, direct_ms), (proxied, proxied_ms)):
            call = engine.chat(PROMPT, MAX_TOKENS, 30)
            assert call.error is None and call.first_delta_ms is not None, call.error
            samples.append(call.first_delta_ms)
    direct_p50, proxied_p50 = statistics.median(direct_ms), statistics.median(proxied_ms)
    print(f"TTFT p50 direct {direct_p50:.3f} ms, through the proxy {proxied_p50:.3f} ms")
    assert proxied_p50 - direct_p50 < direct_p50 / 3, (direct_p50, proxied_p50)


# -- the gate -----------------------------------------------------------------------------------


def bench_through(pytester: pytest.Pytester, url: str) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{url}', phases: [warm]}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)


def run_bench(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # In-process: a subprocess would add 1.3 s of start-up between the two runs compared, and the
    # machine drifts meanwhile. The proxy's thread then shares the GIL with the client, but it
    # waits in select() and costs little (test_the_proxy_adds_little_to_ttft measures just that).
    return pytester.runpytest("--force-load", "-p", "no:cacheprovider", *args)


def gpubench_section(result: pytest.RunResult) -> str:
    """The plugin's terminal summary, for assertion messages."""
    text = result.stdout.str()
    return text[text.find("gpubench") :]


def verdict_row(result: pytest.RunResult) -> str:
    return next((line for line in result.outlines if line.startswith(CELL)), "no verdict row")


def baseline_ttft_p50(root: Path) -> float:
    stored = json.loads((root / "baselines" / "local_llamacpp_tiny.json").read_text())
    return float(stored["prompts"][PROMPT_ID]["warm"]["first_delta_ms"]["p50"])


def measured_run(
    pytester: pytest.Pytester, proxy: DelayProxy, *args: str
) -> tuple[pytest.RunResult, EngineSpeed]:
    """A benchmark run, and llama-server's own speed during it."""
    since = len(proxy.wait_until_idle())
    result = run_bench(pytester, "--gpubench-runs", str(RUNS), *args)
    calls = proxy.wait_until_idle()[since:]
    # A suspected regression is measured again at the session's end (its calls marked pass 2,
    # after a warm-up of their own): the engine's speed is the first pass's.
    again = sum(1 for r in read_ledger(newest_ledger(pytester)) if r.get("pass") == 2)
    first, later = calls[: RUNS + 1], calls[RUNS + 1 :]
    assert len(first) == RUNS + 1, gpubench_section(result)  # the measured calls and the warm-up
    assert len(later) == (again + 1 if again else 0), gpubench_section(result)
    return result, EngineSpeed.of(first)


def newest_ledger(pytester: pytest.Pytester) -> Path:
    return max((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)


def steady_run(
    pytester: pytest.Pytester, proxy: DelayProxy, scenario: Scenario, *args: str
) -> pytest.RunResult:
    """A baseline, then at once the scenario's run, measured again until the engine held still."""
    unsteady: list[str] = []
    for _ in range(ATTEMPTS):
        proxy.delay_ms = 0.0
        # A fresh baseline each attempt: the attempts that did not hold still must not become
        # its between-run history (the gate would then judge against their spread).
        (pytester.path / "baselines" / "local_llamacpp_tiny.json").unlink(missing_ok=True)
        update, at_baseline = measured_run(pytester, proxy, "--baseline-update")
        assert update.ret == 0, gpubench_section(update)
        update.stdout.fnmatch_lines([f"baseline written: {CELL} -> *local_llamacpp_tiny.json"])
        proxy.delay_ms = scenario.delay_fraction * baseline_ttft_p50(pytester.path)
        result, speed = measured_run(pytester, proxy, *args)
        # Shown when the test fails: what each run measured and what the gate made of it.
        print(f"{scenario.name}: engine {speed} against {at_baseline}; {verdict_row(result)}")
        if speed.within(at_baseline, STEADY):
            return result
        unsteady.append(f"{speed} against {at_baseline}")
    pytest.skip(
        f"{scenario.name} not judged: the machine did not hold still. llama-server's own time to "
        f"first content / last byte (p50), run against its baseline: {'; '.join(unsteady)}, "
        f"each more than {STEADY:.0%} apart"
    )


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda scenario: scenario.test_id)
@pytest.mark.engine
def test_gate_against_a_baseline_through_the_proxy(
    pytester: pytest.Pytester, proxy: DelayProxy, scenario: Scenario
) -> None:
    """Exit 6 and a named regression for TTFT +60 %; exit 0 for +5 % and for no change at all."""
    bench_through(pytester, proxy.url)
    junit = pytester.path / "junit.xml"
    result = steady_run(pytester, proxy, scenario, f"--junitxml={junit}")
    assert result.ret == scenario.exit_status, f"{scenario.name}: {gpubench_section(result)}"
    check_junit(junit, regressed=scenario.exit_status == 6)
    result.stdout.fnmatch_lines([f"{CELL}*{PROMPT_ID}*"])
    if scenario.exit_status == 6:
        result.stdout.fnmatch_lines(
            [
                f"{CELL}*{PROMPT_ID}*regression",
                f"REGRESSION: {CELL} {PROMPT_ID}: warm TTFT p50 +*(slower: *"
                "client or transport side: the engine's own timings held*",
                "gpubench: * regression(s) against *",
                "gpubench: exit status 6: benchmarks ran and at least one regressed",
            ]
        )


def check_junit(path: Path, *, regressed: bool) -> None:
    """CI sees what the gate saw: a failed test case naming the cell, prompt and metric for a
    regression, and each case's figures as properties."""
    root = ElementTree.parse(path).getroot()
    cases = root.findall(".//testcase")
    gate = [case for case in cases if case.get("classname") == "gpubench.gate"]
    measured = [case for case in cases if case.get("classname") != "gpubench.gate"]
    assert len(measured) == RUNS
    every = [{p.get("name"): p.get("value") for p in case.iter("property")} for case in measured]
    for properties in every:
        assert float(properties["first_delta_ms"]) > 0  # type: ignore[arg-type]
        assert float(properties["total_duration_ms"]) > 0  # type: ignore[arg-type]
        assert properties["completion_tokens"] == str(MAX_TOKENS)
        assert "engine.predicted_ms" in properties
        # A call whose content came in one read has no decode rate, and says so.
        assert "tokens_per_sec" in properties or properties["coalesced"] == "True"
    assert any("tokens_per_sec" in properties for properties in every)
    if not regressed:
        assert gate == []
        return
    names = [case.get("name") for case in gate]
    assert f"{CELL} {PROMPT_ID} warm_ttft_p50_ms" in names
    failure = gate[names.index(f"{CELL} {PROMPT_ID} warm_ttft_p50_ms")].find("failure")
    assert failure is not None
    assert failure.get("message", "").startswith(f"REGRESSION: {CELL} {PROMPT_ID}: warm TTFT p50 +")
    assert int(root.find("testsuite").get("failures")) >= 1  # type: ignore[union-attr, arg-type]
