"""Run hygiene: the reproducibility guards, --probe, --smoke, meta contents and secret redaction."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.standins import FaultyOpenAIServer, OllamaStandin, serving

from pytest_gpubench.core.status import EXIT_UNMEASURED
from pytest_gpubench.ledger.writer import read_ledger

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}
  P-MEDIUM: {intent: longer, prompt: "Say hello twice.", max_tokens: 6}
"""
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"


def setup_bench(pytester: pytest.Pytester, url: str, extra: str = "", runs: int = 1) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes:\n  local: {kind: local}\ncells:\n"
        f"  - {{node: local, engine: ollama, model: 'qwen3.5:0.8b', endpoint: '{url}', runs: {runs}}}\n"
        + extra,
    )
    pytester.makepyfile(test_bench=TEST_FILE)


def git(path: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(path), "-c", "user.email=t@t", "-c", "user.name=t", *args],
        check=True, capture_output=True,
    )  # fmt: skip


def ledger_of(pytester: pytest.Pytester) -> list[dict[str, Any]]:
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    return read_ledger(ledger)


def test_dirty_tree_is_refused_unless_allowed(pytester: pytest.Pytester) -> None:
    with serving(OllamaStandin()) as url:
        setup_bench(pytester, url)
        git(pytester.path, "init", "-q")
        git(pytester.path, "add", "-A")
        git(pytester.path, "commit", "-qm", "bench")
        (pytester.path / "prompts.yaml").write_text(PROMPTS + "\n")
        refused = pytester.runpytest("--force-load")
        allowed = pytester.runpytest("--force-load", "--allow-dirty", "-m", "warm")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(
        [
            "ERROR: git tree * has uncommitted changes (prompts.yaml): commit them, or pass --gpubench-allow-dirty*"
        ]
    )
    allowed.assert_outcomes(passed=2)
    meta = ledger_of(pytester)[0]
    assert meta["git_dirty"] is True and meta["git_dirty_files"] == ["prompts.yaml"]
    assert isinstance(meta["git_sha"], str) and len(meta["git_sha"]) == 40


def test_python_bytecode_caches_do_not_make_the_tree_dirty(pytester: pytest.Pytester) -> None:
    """On a machine that writes bytecode (the default), importing the benchmarks and their conftest
    leaves `__pycache__/` beside them; in a repository that does not ignore it (a fresh `gpubench
    init` one), that is no change to what is measured. Written here by hand, so the test does not
    depend on whether this machine writes bytecode. A tracked file changed still counts."""
    with serving(OllamaStandin()) as url:
        setup_bench(pytester, url)
        git(pytester.path, "init", "-q")
        git(pytester.path, "add", "-A")
        git(pytester.path, "commit", "-qm", "bench")
        for cache in (pytester.path / "__pycache__", pytester.path / "sub" / "__pycache__"):
            cache.mkdir(parents=True)
            (cache / "conftest.cpython-311.pyc").write_bytes(b"\x00")
        (pytester.path / "stray.pyc").write_bytes(b"\x00")
        clean = pytester.runpytest("--force-load", "-m", "warm")
        (pytester.path / "prompts.yaml").write_text(PROMPTS + "\n")
        refused = pytester.runpytest("--force-load", "-m", "warm")
    clean.assert_outcomes(passed=2)
    meta = ledger_of(pytester)[0]
    assert meta["git_dirty"] is False and meta["git_dirty_files"] == []
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["ERROR: git tree * has uncommitted changes (prompts.yaml): *"])


def test_loaded_machine_is_refused_unless_forced(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpubench_load_threshold = -1\n")
    with serving(OllamaStandin()) as url:
        setup_bench(pytester, url)
        refused = pytester.runpytest()
        forced = pytester.runpytest("--force-load", "-m", "warm")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(
        ["ERROR: 1-minute load average is *, above -1: *--gpubench-force-load"]
    )
    assert not list((pytester.path / "runs").glob("*.jsonl")) or forced.ret == 0
    forced.assert_outcomes(passed=2)


def test_for_publication_fails_when_a_cell_is_unhealthy(pytester: pytest.Pytester) -> None:
    with serving(OllamaStandin()) as url:
        setup_bench(
            pytester,
            url,
            "  - {node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:9', runs: 1}\n",
        )
        normal = pytester.runpytest("--force-load", "-m", "warm")
        publication = pytester.runpytest("--force-load", "-m", "warm", "--for-publication")
    normal.assert_outcomes(passed=2, skipped=2)
    # The unreachable cell is required: nothing unmeasured passes (tests/test_unmeasured.py).
    assert normal.ret == EXIT_UNMEASURED
    publication.assert_outcomes(passed=2, errors=2)
    assert publication.ret == pytest.ExitCode.TESTS_FAILED
    publication.stdout.fnmatch_lines(["*--for-publication: local:openai:m is unavailable*"])


def test_probe_prints_a_table_and_measures_nothing(pytester: pytest.Pytester) -> None:
    with serving(OllamaStandin()) as url:
        setup_bench(
            pytester,
            url,
            "  - {node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:9'}\n",
        )
        result = pytester.runpytest("--probe")
        strict = pytester.runpytest("--probe", "--for-publication")
    assert result.ret == EXIT_UNMEASURED  # a required cell is unhealthy
    result.stdout.fnmatch_lines(
        [
            "*gpubench probe*",
            "cell*engine version*model digest*status*",
            "local:ollama:qwen3.5:0.8b*0.12.3*2ae6f6dd*ok*",
            "local:openai:m*-*-*health check failed*",
        ]
    )
    assert not (pytester.path / "runs").exists() or not list(
        (pytester.path / "runs").glob("*.jsonl")
    )
    assert strict.ret == EXIT_UNMEASURED


def test_smoke_measures_one_call(pytester: pytest.Pytester) -> None:
    with serving(OllamaStandin()) as url:
        setup_bench(pytester, url, runs=5)
        result = pytester.runpytest("--force-load", "--smoke")
    result.assert_outcomes(passed=1)
    calls = [r for r in ledger_of(pytester) if r["type"] == "call"]
    assert [(c["prompt_id"], c["phase"], c["run_idx"]) for c in calls] == [("P-EASY", "warm", 0)]


def test_meta_record_contents(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_NOTE", "nightly")
    pytester.makeini("[pytest]\ngpubench_env = BENCH_NOTE\n")
    with serving(OllamaStandin()) as url:
        setup_bench(pytester, url)
        pytester.runpytest("--force-load", "-m", "warm", "-p", "no:randomly")
    meta = ledger_of(pytester)[0]
    for key in ("git_sha", "git_dirty", "harness_version", "started_at_utc", "host",
                "load_avg_start", "python_version", "pytest_version", "plugin_version",
                "command_line", "cells_planned"):  # fmt: skip
        assert key in meta, key
    assert meta["env"]["BENCH_NOTE"] == "nightly"
    assert "--force-load" in meta["command_line"]
    end = ledger_of(pytester)[-1]
    assert end["type"] == "end" and isinstance(end["load_avg_end"], float)


def test_cells_yaml_settings_env_is_recorded_too(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`settings: env:` in cells.yaml names variables for meta, like the gpubench_env ini key."""
    monkeypatch.setenv("BENCH_GPU_CLOCK", "locked")
    monkeypatch.setenv("BENCH_SECRET_TOKEN", "t0p-s3cret-value")
    with serving(OllamaStandin()) as url:
        setup_bench(pytester, url)
        cells = (pytester.path / "cells.yaml").read_text()
        (pytester.path / "cells.yaml").write_text(
            "settings: {env: [BENCH_GPU_CLOCK, BENCH_SECRET_TOKEN]}\n" + cells
        )
        pytester.runpytest("--force-load", "-m", "warm")
    env = ledger_of(pytester)[0]["env"]
    assert env["BENCH_GPU_CLOCK"] == "locked"
    assert env["BENCH_SECRET_TOKEN"] == "[REDACTED]"


def test_secrets_appear_nowhere(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The faulty server echoes the request's Authorization header back in an HTTP 500 body."""
    secret = "sk-test-4f9c2a7b1e"
    monkeypatch.setenv("BENCH_API_TOKEN", secret)
    pytester.makeini("[pytest]\ngpubench_env = BENCH_API_TOKEN\n")

    class EchoingServer(FaultyOpenAIServer):
        def post(self, handler, body):  # type: ignore[no-untyped-def]
            handler._json(500, {"error": f"bad key {handler.headers.get('Authorization')}"})

    with serving(EchoingServer()) as url:
        pytester.makefile(
            ".yaml",
            prompts=PROMPTS,
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', "
            "api_key_env: BENCH_API_TOKEN, phases: [warm], runs: 1}\n",
        )
        pytester.makepyfile(test_bench=TEST_FILE + "    assert False, gpubench_case.record\n")
        result = pytester.runpytest("--force-load", "-rA")
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    text = ledger.read_text()
    assert "Bearer [REDACTED]" in text  # the echoed error is kept, with the secret cut out
    assert json.loads(text.splitlines()[0])["env"]["BENCH_API_TOKEN"] == "[REDACTED]"
    assert secret not in text
    assert secret not in result.stdout.str() + result.stderr.str()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_guards_refuse_before_any_call_under_xdist(pytester: pytest.Pytester, workers: str) -> None:
    pytest.importorskip("xdist")
    server = OllamaStandin()
    with serving(server) as url:
        setup_bench(pytester, url)
        git(pytester.path, "init", "-q")
        git(pytester.path, "add", "-A")
        git(pytester.path, "commit", "-qm", "bench")
        (pytester.path / "prompts.yaml").write_text(PROMPTS + "\n")
        result = pytester.runpytest("--force-load", "-n", workers, "-p", "xdist")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stdout.fnmatch_lines(["ERROR: git tree * has uncommitted changes (prompts.yaml)*"])
    assert not [r for r in server.requests if r[1] == "/api/chat"]  # nothing was measured
