"""The prebuilt llama.cpp server (xllamacpp's wheel, through the launcher) against llama-server
built from source, both real, on the tiny model: the same prompts answered by both with the same
token counts and llama.cpp's `timings`, provenance that tells them apart (a baseline of one is
`incomparable` with a run of the other, exit 8), and the source build forced by
GPUBENCH_LLAMA_SERVER_BUILD=1 through a whole benchmark run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.pytest_process import LEAN

from pytest_gpubench.core.status import EXIT_INCOMPARABLE, EXIT_UNMEASURED
from pytest_gpubench.engines import Request
from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.engines.llamacpp_prebuilt import (
    BUILD_ENV,
    is_installed,
    launcher_command,
    package_dir,
    prebuilt_engine_version,
)
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.ledger.schema import records_of
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.results.baseline import cell_provenance, provenance_changes, run_descriptions
from pytest_gpubench.targets.local import LocalTarget

pytestmark = pytest.mark.engine

SHIPPED_PROMPTS = Path(__file__).resolve().parent.parent / "prompts.yaml"
CELL = "local:llamacpp:tiny"
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"


@pytest.fixture(scope="module")
def prebuilt() -> list[str]:
    """The launcher's argv; skipped where the wheel is not installed (`make engine`), failed on
    CI."""
    if not is_installed(package_dir()):
        message = "the prebuilt llama.cpp server is not installed: run `make engine`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return launcher_command()


def _server(command: str | list[str], model: Path, log_dir: Path) -> ManagedLlamaServer:
    return ManagedLlamaServer(
        LocalTarget(),
        cell_id=CELL,
        binary=command,
        model_path=str(model),
        alias="tiny",
        log_dir=str(log_dir),
        extra_args=("--threads", "1"),
    )


@pytest.fixture
def both(
    prebuilt: list[str], llama_server: Path, tiny_model: Path, tmp_path: Path
) -> Iterator[dict[str, ManagedLlamaServer]]:
    servers = {
        "prebuilt": _server(prebuilt, tiny_model, tmp_path / "prebuilt"),
        "built": _server(str(llama_server), tiny_model, tmp_path / "built"),
    }
    try:
        for server in servers.values():
            server.start()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def test_the_same_prompts_through_both_servers(both: dict[str, ManagedLlamaServer]) -> None:
    """Both answer each shipped prompt through the harness's own client, with the same prompt
    and completion token counts (the tiny model ignores its end token: max_tokens every time)
    and llama.cpp's `timings`; /props names each server's build, and the prebuilt one's is the
    `b0-unknown` that makes the harness record the package's version instead."""
    from pytest_gpubench.config.prompts import read_prompts

    prompts = read_prompts(SHIPPED_PROMPTS)
    answers: dict[str, dict[str, Any]] = {}
    builds: dict[str, Any] = {}
    for name, server in both.items():
        engine = LlamaCppEngine(server.base_url, "tiny")
        builds[name] = engine.describe(10.0)["engine_version"]
        for prompt_id in ("P-EASY", "P-MEDIUM", "P-HARD"):
            prompt = prompts[prompt_id]
            call = engine.chat(Request(prompt.prompt, prompt.max_tokens), 120.0)
            assert call.error is None, f"{name} {prompt_id}: {call.error}"
            assert call.engine_timings, f"{name} {prompt_id}: no timings"
            assert call.engine_timings["predicted_n"] == call.completion_tokens
            answers.setdefault(prompt_id, {})[name] = call
    for prompt_id, calls in answers.items():
        prebuilt_call, built_call = calls["prebuilt"], calls["built"]
        assert (
            prebuilt_call.completion_tokens
            == built_call.completion_tokens
            == (prompts[prompt_id].max_tokens)
        )
        assert prebuilt_call.prompt_tokens == built_call.prompt_tokens
    assert builds["prebuilt"] == "b0-unknown"
    assert builds["built"] != builds["prebuilt"] and builds["built"].startswith("b")


def test_a_flag_the_launcher_does_not_map_fails_the_cell_in_one_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, prebuilt: list[str]
) -> None:
    """The embedded default's cell with a llama-server flag the launcher does not map: the cell
    is not measured (exit 7, its cases shown UNMEASURED), and the reason is one line naming the
    flag and the way out."""
    _embedded_default_project(
        pytester,
        monkeypatch,
        "server_args: [--threads, '1', --lora, adapter.gguf], runs: 1, phases: [warm]",
    )
    result = _bench(pytester, "--allow-dirty", "-rs")
    assert result.ret == EXIT_UNMEASURED
    result.stdout.fnmatch_lines(
        [
            "UNMEASURED * cell local:llamacpp:tiny: server_args: --lora: not a llama-server flag the"
            " prebuilt llama.cpp server (xllamacpp) maps; to use it, run a built llama-server:"
            " set the cell's server_binary to one, or set GPUBENCH_LLAMA_SERVER_BUILD=1 *"
        ]
    )


def _embedded_default_project(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, keys: str
) -> None:
    """The shipped prompts and the embedded default's cell with these keys, in an environment
    that names no llama-server (none on PATH, none set, no source build asked for)."""
    pytester.makefile(
        ".yaml",
        prompts=SHIPPED_PROMPTS.read_text(),
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, {keys}}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    monkeypatch.delenv("GPUBENCH_LLAMA_SERVER", raising=False)
    monkeypatch.delenv(BUILD_ENV, raising=False)
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")  # no llama-server of its own


def _bench(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("--force-load", "-p", "no:cacheprovider", *LEAN, *args)


def _ledger_facts(pytester: pytest.Pytester) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    (ledger,) = sorted((pytester.path / "runs").glob("*.jsonl"), key=os.path.getmtime)[-1:]
    records = read_ledger(ledger)
    (cell,) = [r for r in records if r["type"] == "cell"]
    return cell, records


def test_a_baseline_of_the_built_server_is_incomparable_with_the_prebuilt_one(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    prebuilt: list[str],
    llama_server: Path,
    tiny_model: Path,
) -> None:
    """The embedded default's cell, measured twice on the shipped prompts: first with the
    source build forced (GPUBENCH_LLAMA_SERVER_BUILD=1: the cached build, nothing compiled here)
    and its baseline written, then with the prebuilt server chosen as on a fresh machine. The
    second run says the baseline is of another engine version and exits 8; it never compares the
    two servers' numbers silently."""
    _embedded_default_project(
        pytester, monkeypatch, "server_args: [--threads, '1'], runs: 5, phases: [warm]"
    )

    monkeypatch.setenv(BUILD_ENV, "1")
    built = _bench(pytester, "--baseline-update", "--allow-dirty")
    assert built.ret == 0, built.stdout.str()
    built_cell, built_records = _ledger_facts(pytester)
    assert built_cell["engine_version"].startswith("b")
    assert "engine_build_info" not in built_cell
    assert (pytester.path / "baselines" / "local_llamacpp_tiny.json").is_file()

    monkeypatch.delenv(BUILD_ENV)
    prebuilt_run = _bench(pytester, "--allow-dirty")
    prebuilt_cell, prebuilt_records = _ledger_facts(pytester)
    assert prebuilt_cell["engine_version"] == prebuilt_engine_version()
    assert prebuilt_cell["engine_build_info"] == "b0-unknown"
    assert prebuilt_run.ret == EXIT_INCOMPARABLE, prebuilt_run.stdout.str()
    prebuilt_run.stdout.fnmatch_lines(["*engine version*xllamacpp*"])

    built_calls = records_of(built_records, "call")
    prebuilt_calls = records_of(prebuilt_records, "call")
    assert len(built_calls) == len(prebuilt_calls) == 3 * 5
    for before, after in zip(built_calls, prebuilt_calls, strict=True):
        assert before["prompt_id"] == after["prompt_id"]
        assert before["error"] is None and after["error"] is None
        assert before["completion_tokens"] == after["completion_tokens"]
        assert before["engine_timings"] and after["engine_timings"]
    old = cell_provenance(*_meta_and(built_records), built_calls)
    new = cell_provenance(*_meta_and(prebuilt_records), prebuilt_calls)
    assert any(change.startswith("engine version b") for change in provenance_changes(old, new))


def _meta_and(records: list[dict[str, Any]]) -> tuple[Any, Any]:
    meta, cells = run_descriptions(records)
    return meta, cells[CELL]
