"""Managed Ollama on an SSH node (docs/cells.md "Managed engines"): `ollama serve` started by the
harness with the cell's environment on the node's loopback, the model pulled as its own stage
with its progress in the ledger, its size checked against free VRAM, cold by keep_alive 0
(confirmed through /api/ps), the version recorded, the server stopped at the end.

Ollama cannot run here (nothing can be downloaded, and it needs real weights): the node's
`ollama` is the stand-in executable of ollama_standin.py, which follows Ollama's CLI (`serve`,
`pull`, `list`, `--version`) and HTTP API field by field; nvidia-smi is gpu_standins.py's (two
H100s). Both are first on PATH for the node's logins (the key's authorized_keys line). The node
itself is the real sshd on 127.0.0.1 (ssh_fixtures.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.gpu_standins import write_nvidia_smi
from support.ollama_standin import OLLAMA_VERSION, write_ollama
from support.remote_cells import flow_mapping, ledger_of, run_matrix, ssh_node

pytestmark = pytest.mark.sshd

if TYPE_CHECKING:
    from support.ssh_fixtures import SshServer

pytest_plugins = ["support.ssh_fixtures"]


@pytest.fixture
def ollama_node(sshd: SshServer, tmp_path: Path) -> tuple[Path, Path]:
    """A login key whose PATH finds the stand-in ollama and nvidia-smi; the key, and the folder
    the cells keep their models in (OLLAMA_MODELS)."""
    tools = sshd.remote_dir / f"ollama-{tmp_path.name}"
    write_ollama(tools)
    write_nvidia_smi(tools, gpus=2)
    models = sshd.remote_dir / f"models-{tmp_path.name}"
    models.mkdir()
    subprocess.run(["chown", f"{sshd.user}:{sshd.user}", str(models)], check=True)
    key = tmp_path / "ollama_node_ed25519"
    public = sshd.new_key(key, "gpubench-ollama-node")
    sshd.authorize(f'environment="PATH={tools}:/usr/bin:/bin" {public}')
    return key, models


def ollama_cell(model: str, models: Path, **extra: Any) -> str:
    options: dict[str, Any] = {"node": "gpubox", "engine": "ollama", "model": model, **extra}
    env = {"OLLAMA_MODELS": str(models), "OLLAMA_KEEP_ALIVE": "5m", **extra.pop("env", {})}
    options.pop("env", None)
    return flow_mapping({**options, "launch_env": env})


def serving(user: str) -> list[str]:
    listing = subprocess.run(
        ["ps", "-u", user, "-o", "stat=,args="], capture_output=True, text=True, check=False
    )
    return [
        line for line in listing.stdout.splitlines()
        if "ollama serve" in line and not line.startswith("Z")
    ]  # fmt: skip


def test_managed_ollama_on_an_ssh_node_pulls_checks_measures_and_stops(
    pytester: pytest.Pytester, sshd: SshServer, ollama_node: tuple[Path, Path]
) -> None:
    key, models = ollama_node
    node = ssh_node(sshd, key_file=str(key), setup=["ollama --version"], gpu_type="H100")
    cells = [
        ollama_cell("qwen3:0.6b", models, runs=2),
        ollama_cell("llama3:70b", models, phases=["warm"], runs=1),
        ollama_cell("missing-model:1b", models, phases=["warm"], runs=1),
        ollama_cell(
            "slow:1b", models, phases=["warm"], runs=1, env={"OLLAMA_STANDIN_PULL_S": "20"}
        ),
        ollama_cell("qwen3:0.6b", models, name="restarted", cold="restart", runs=1),
    ]
    nodes = {"gpubox": node.replace("}", ", stage_timeouts: {model_pull: 2}}")}
    result = run_matrix(pytester, nodes, cells)
    result.assert_outcomes(passed=5, skipped=3)
    records = ledger_of(pytester)

    # cold: restart: `ollama serve` stopped and started again, the model pulled already.
    restarted = [r for r in records if r["type"] == "call" and r["cell_id"].endswith("@restarted")]
    assert [(c["phase"], c["cold_kind"]) for c in restarted] == [
        ("cold", "restart"),
        ("warm", None),
    ]
    assert restarted[0]["engine_timings"]["load_duration"] > 0
    records = [r for r in records if not str(r.get("cell_id")).endswith("@restarted")]
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert cell["cell_id"] == "gpubox:ollama:qwen3:0.6b" and cell["managed"] is True
    assert cell["engine_version"] == OLLAMA_VERSION
    calls = [r for r in records if r["type"] == "call"]
    assert [c["phase"] for c in calls] == ["cold", "warm", "warm"]
    assert all(c["error"] is None and c["completion_tokens"] == 8 for c in calls)
    assert calls[0]["cold_kind"] == "unload"
    assert calls[0]["engine_timings"]["load_duration"] > 0  # it had to load: truly cold
    assert calls[1]["engine_timings"]["load_duration"] == 0

    stages = [r for r in records if r["type"] == "stage"]
    good = [(r["stage"], r["outcome"]) for r in stages if r["cell_id"] == cell["cell_id"]]
    assert good == [
        ("engine_start", "ok"), ("model_pull", "ok"), ("vram_check", "ok"),
        ("benchmark", "ok"), ("collect", "ok"),
    ]  # fmt: skip
    (pull,) = [r for r in stages if r["stage"] == "model_pull" and r["cell_id"] == cell["cell_id"]]
    assert pull["details"]["statuses"] == [
        "pulling manifest", "pulling", "verifying sha256 digest", "writing manifest", "success",
    ]  # fmt: skip
    assert pull["details"]["bytes"] == 1_000_000 and pull["details"]["layers"] == 1
    node_stages = [(r["stage"], r["outcome"]) for r in stages if r["cell_id"] is None]
    assert node_stages == [
        ("ssh_connect", "ok"), ("gpu_check", "ok"), ("engine_install", "ok"), ("cleanup", "ok"),
    ]  # fmt: skip

    skipped = {r["cell_id"]: r for r in records if r["type"] == "skipped"}
    big = skipped["gpubox:ollama:llama3:70b"]
    assert big["stage"] == "vram_check"
    assert (
        "the model needs 158.32 GiB (/api/tags), but the node's GPUs have 156.88 GiB"
        in (big["reason"])
    )
    missing = skipped["gpubox:ollama:missing-model:1b"]
    assert missing["stage"] == "model_pull"
    assert "pull model manifest: file does not exist" in missing["reason"]
    slow = skipped["gpubox:ollama:slow:1b"]
    assert slow["stage"] == "model_pull" and "did not finish within 2 s" in slow["reason"]
    outcomes = {(r["cell_id"], r["stage"]): r["outcome"] for r in stages}
    assert outcomes[("gpubox:ollama:slow:1b", "model_pull")] == "timeout"
    assert outcomes[("gpubox:ollama:missing-model:1b", "model_pull")] == "failed"

    # OLLAMA_MODELS reached the server: the pulled models are kept where the cell said.
    pulled = json.loads((models / "standin-manifests.json").read_text())
    assert "qwen3:0.6b" in pulled and "llama3:70b" in pulled
    assert serving(sshd.user) == []
    logs = (pytester.path / "runs" / "logs").glob("gpubox-ollama-*qwen3*.log")
    (engine_log,) = [log for log in logs if "restarted" not in log.name]
    assert "Listening on 127.0.0.1:" in engine_log.read_text()
