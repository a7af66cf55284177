"""The rented-GPU flow end to end, stage by stage (docs/remote-nodes.md "Stages", "Rentals never leak").

The node is the real sshd on 127.0.0.1 (ssh_fixtures.py) running the real llama-server. Two
things cannot run here and are stand-ins that follow the upstream's documented interface field by
field: the GPU marketplace API (provider_standin.py) and nvidia-smi (gpu_standins.py: two
NVIDIA H100 80GB HBM3, CSV as `--query-gpu ... --format=csv,noheader,nounits` prints it), put
first on the node's PATH by the session key's authorized_keys line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.gpu_standins import write_nvidia_smi
from support.provider_standin import ProviderStandIn
from support.pytest_process import start_pytest
from support.remote_cells import (
    TOKEN,
    TOKEN_ENV,
    ledger_of,
    managed_cell,
    marketplace,
    run_matrix,
    servers_of,
    ssh_target,
    write_project,
)

from pytest_gpubench.cli.main import main as gpubench_main
from pytest_gpubench.ledger.writer import read_ledger

pytestmark = [pytest.mark.engine, pytest.mark.sshd]

if TYPE_CHECKING:
    from support.ssh_fixtures import SshServer

pytest_plugins = ["support.ssh_fixtures"]

H100_OFFERS = [
    {"id": "o-h100", "provider": "vastai", "gpu_name": "H100", "vram_gb": 80,
     "price_per_hour": 2.5, "availability_confidence": 0.9},
    {"id": "o-4090", "provider": "vastai", "gpu_name": "RTX 4090", "vram_gb": 24,
     "price_per_hour": 0.4, "availability_confidence": 0.9},
]  # fmt: skip
EVERY_STAGE = [
    "inventory", "provision", "ssh_wait", "ssh_connect", "gpu_check", "engine_install",
    "model_pull", "vram_check", "engine_start", "benchmark", "collect", "cleanup",
]  # fmt: skip


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of the test's own: the rental journal lives there."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("GPUBENCH_CACHE_DIR", str(directory))
    return directory


@pytest.fixture
def gpu_session_key(sshd: SshServer, tmp_path: Path) -> str:
    """A session key whose logins find the stand-in nvidia-smi (two H100s) first on PATH."""
    standin_dir = sshd.remote_dir / f"gpu-{tmp_path.name}"
    write_nvidia_smi(standin_dir, gpus=2)
    key = tmp_path / "gpu_session_ed25519"
    public = sshd.new_key(key, "gpubench-rented-gpu")
    sshd.authorize(f'environment="PATH={standin_dir}:/usr/bin:/bin" {public}')
    return key.read_text(encoding="ascii")


@pytest.fixture
def market(
    sshd: SshServer, gpu_session_key: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ProviderStandIn]:
    with marketplace(sshd, gpu_session_key, H100_OFFERS, monkeypatch) as api:
        yield api


def rented(api: ProviderStandIn, install: tuple[Path, Path], **extra: Any) -> str:
    binary, gguf = install
    options: dict[str, Any] = {
        "kind": "provider", "api": api.url, "gpu_type": "H100", "provider": "vastai",
        "max_price": 3.0, "api_token_env": TOKEN_ENV, "provision_timeout_s": 10,
        "ssh_wait_timeout_s": 10, "connect_timeout_s": 5, "command_timeout_s": 20,
        "setup": [f"test -x {binary}"], "model_pull": [f"test -r {gguf}"],
        **extra,
    }  # fmt: skip
    return json.dumps(options)


def key_dirs() -> set[Path]:
    return set(Path("/tmp").glob("gpubench-provider-*"))


def stages_of(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["stage"], r["outcome"]) for r in records if r["type"] == "stage"]


def test_every_stage_of_a_rented_node_is_in_the_ledger(
    pytester: pytest.Pytester, market: ProviderStandIn, node_install: tuple[Path, Path]
) -> None:
    """Rent, wait, connect, check the GPU (nvidia-smi: H100 as rented), install, pull, check
    the model fits, start, benchmark, read the log back, give back: each stage's outcome."""
    before = key_dirs()
    result = run_matrix(
        pytester,
        {"rented": rented(market, node_install, gpu_count=2)},
        [managed_cell("rented", "tiny", node_install, phases=["warm"], runs=2)],
    )
    result.assert_outcomes(passed=2)
    records = ledger_of(pytester)
    assert stages_of(records) == [(stage, "ok") for stage in EVERY_STAGE]
    stages = {r["stage"]: r for r in records if r["type"] == "stage"}
    assert stages["engine_install"]["timeout_s"] == 1800.0  # setup_timeout_s
    assert stages["vram_check"]["cell_id"] == "rented:llamacpp:tiny"
    assert stages["gpu_check"]["cell_id"] is None and stages["gpu_check"]["node"] == "rented"
    assert all(r["elapsed_s"] >= 0 for r in stages.values())
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert cell["gpu_summary"] == "2 × NVIDIA H100 80GB HBM3 (81559 MiB)"
    assert market.done() == ["sess-1"] and key_dirs() <= before
    assert list((Path(os.environ["GPUBENCH_CACHE_DIR"]) / "rentals").glob("*.json")) == []


Keys = dict[str, Any]
STAGE_FAILURES: list[tuple[str, Keys, Keys, Keys, str, str]] = [
    # (stage, node keys, cell keys, scenario changes, outcome, words in the reason)
    ("inventory", {"max_price": 0.1}, {}, {}, "failed", "no offer for gpu_type 'H100'"),
    ("provision", {"provision_timeout_s": 1}, {}, {"statuses": ["provisioning"]}, "timeout",
     "not running after 1 s"),
    ("provision", {}, {}, {"statuses": ["failed"], "error": "GPU fell off the bus"}, "failed",
     "session sess-1 failed: GPU fell off the bus"),
    ("ssh_wait", {"ssh_wait_timeout_s": 1}, {}, {"ssh_port": "closed"}, "timeout",
     "did not answer SSH within 1 s"),
    ("ssh_connect", {"stage_timeouts": {"ssh_connect": 2}}, {}, {"private_key": "unknown"},
     "failed", "gpubench-test@127.0.0.1"),
    ("gpu_check", {"gpu_type": "RTX 4090"}, {}, {}, "failed",
     "gpu_type is 'RTX 4090', but nvidia-smi reports NVIDIA H100 80GB HBM3"),
    ("gpu_check", {"gpu_count": 4}, {}, {}, "failed", "gpu_count is 4, but nvidia-smi reports 2"),
    ("engine_install", {"setup": ["sleep 30"], "stage_timeouts": {"engine_install": 1}}, {}, {},
     "timeout", "did not finish within 1 s"),
    ("engine_install", {"setup": ["echo no compiler >&2; exit 7"]}, {}, {}, "failed",
     "exited with status 7: no compiler"),
    ("model_pull", {"model_pull": ["echo no such model >&2; exit 3"]}, {}, {}, "failed",
     "exited with status 3: no such model"),
    ("model_pull", {"model_pull": ["sleep 30"], "stage_timeouts": {"model_pull": 1}}, {}, {},
     "timeout", "did not finish within 1 s"),
    ("vram_check", {}, {"vram_gb": 400}, {}, "failed",
     "the model needs 400.00 GiB (vram_gb), but the node's GPUs have 156.88 GiB"),
    ("engine_start", {}, {"launch": ["sleep", "60"], "ready_timeout_s": 1}, {}, "timeout",
     "not healthy at /health after 1 s"),
    ("engine_start", {}, {"launch": ["false"]}, {}, "failed", "exited while starting"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("stage", "node_keys", "cell_keys", "scenario", "outcome", "reason"),
    STAGE_FAILURES,
    ids=[f"{failure[0]}-{failure[4]}" + ("-count" if "gpu_count" in failure[1] else "")
         for failure in STAGE_FAILURES],
)  # fmt: skip
def test_a_stage_that_fails_or_times_out_is_recorded_and_the_rental_given_back(
    pytester: pytest.Pytester,
    market: ProviderStandIn,
    node_install: tuple[Path, Path],
    sshd: SshServer,
    tmp_path: Path,
    stage: str,
    node_keys: Keys,
    cell_keys: Keys,
    scenario: Keys,
    outcome: str,
    reason: str,
) -> None:
    for key, wanted in scenario.items():
        value = wanted
        if wanted == "closed":
            value = sshd.closed_port()
        elif wanted == "unknown":  # a key this node's sshd does not know
            sshd.new_key(tmp_path / "unknown_ed25519", "unknown")
            value = (tmp_path / "unknown_ed25519").read_text()
        setattr(market.scenario, key, value)
    before = key_dirs()
    result = run_matrix(
        pytester,
        {"rented": rented(market, node_install, **node_keys)},
        [managed_cell("rented", "tiny", node_install, phases=["warm"], runs=1, **cell_keys)],
    )
    result.assert_outcomes(skipped=1)
    records = ledger_of(pytester)
    (skipped,) = [r for r in records if r["type"] == "skipped"]
    assert skipped["stage"] == stage and reason in skipped["reason"]
    stages = stages_of(records)
    assert (stage, outcome) in stages
    assert stages[-1] == ("cleanup", "ok")
    # The stages up to the one that failed, then cleanup; an engine that failed to start has its
    # log read back first (it says why).
    upto = EVERY_STAGE[: EVERY_STAGE.index(stage) + 1]
    read_back = ["collect"] if stage == "engine_start" else []
    assert [name for name, _ in stages] == upto + read_back + ["cleanup"]
    assert key_dirs() <= before
    assert servers_of(sshd.user) == []
    if stage == "inventory":  # nothing was rented, so there is nothing to give back
        assert market.created() == [] and records[-1]["nodes"] == []
        return
    assert market.done() == ["sess-1"]
    (node,) = records[-1]["nodes"]
    assert node["session_done"] is True and node["cost"] > 0


def test_a_node_budget_cuts_the_stage_that_runs_past_it(
    pytester: pytest.Pytester, market: ProviderStandIn, node_install: tuple[Path, Path]
) -> None:
    """budget_s is the whole node's: model_pull gets what engine_install left of it."""
    result = run_matrix(
        pytester,
        {"rented": rented(market, node_install, budget_s=4, setup=["sleep 1"],
                          model_pull=["sleep 30"])},
        [managed_cell("rented", "tiny", node_install, phases=["warm"], runs=1)],
    )  # fmt: skip
    result.assert_outcomes(skipped=1)
    records = ledger_of(pytester)
    stages = {r["stage"]: r for r in records if r["type"] == "stage"}
    assert stages["engine_install"]["outcome"] == "ok"
    assert stages["model_pull"]["outcome"] == "timeout"
    assert stages["model_pull"]["timeout_s"] < 4 and stages["model_pull"]["elapsed_s"] < 10
    assert market.done() == ["sess-1"]


def kill_mid_run(pytester: pytest.Pytester, market: ProviderStandIn) -> None:
    """Start a long run on the rented node and kill -9 pytest once it measures."""
    process = start_pytest(pytester)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            ledgers = list((pytester.path / "runs").glob("*.jsonl"))
            if ledgers and ledgers[0].read_text().count('"type":"call"') >= 2:
                break
            time.sleep(0.05)
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=30)
    assert market.created() == ["sess-1"] and market.done() == []


def write_long_run(
    pytester: pytest.Pytester, market: ProviderStandIn, install: tuple[Path, Path]
) -> None:
    """The files of a run of 400 calls on the rented node (one that is killed long before)."""
    cell = managed_cell("rented", "tiny", install, phases=["warm"], runs=400)
    write_project(pytester, {"rented": rented(market, install)}, [cell])


def test_a_rental_left_by_a_killed_run_is_given_back_by_the_next_run(
    pytester: pytest.Pytester,
    market: ProviderStandIn,
    node_install: tuple[Path, Path],
    sshd: SshServer,
) -> None:
    """kill -9 mid-run leaves the session rented, written in the journal; the next run for the
    same marketplace gives it back first and records what it cost."""
    write_long_run(pytester, market, node_install)
    kill_mid_run(pytester, market)
    (entry,) = (Path(os.environ["GPUBENCH_CACHE_DIR"]) / "rentals").glob("*.json")
    facts = json.loads(entry.read_text())
    assert facts["session_id"] == "sess-1" and facts["api"] == market.url
    assert Path(facts["key_dir"], "session_key").exists()  # the killed run's key, left behind
    assert TOKEN not in entry.read_text() and "PRIVATE KEY" not in entry.read_text()
    for ledger in (pytester.path / "runs").glob("*.jsonl"):
        ledger.rename(ledger.with_suffix(".killed"))

    result = run_matrix(
        pytester,
        {"rented": rented(market, node_install)},
        [managed_cell("rented", "tiny", node_install, phases=["warm"], runs=1)],
    )
    result.assert_outcomes(passed=1)
    assert market.done() == ["sess-1", "sess-2"]
    result.stdout.fnmatch_lines(
        ["rented node rented: left rented by a killed run, given back now: H100 at 2.5/h for "
         "* s, cost *; session sess-1 marked done"]
    )  # fmt: skip
    nodes = {node["session_id"]: node for node in ledger_of(pytester)[-1]["nodes"]}
    leaked = nodes["sess-1"]
    assert leaked["leaked"] is True and leaked["session_done"] is True
    assert leaked["elapsed_s"] > 0 and leaked["cost"] == pytest.approx(
        leaked["elapsed_s"] / 3600 * 2.5, abs=1e-6
    )
    assert nodes["sess-2"].get("leaked") is None
    assert list(entry.parent.glob("*.json")) == []
    assert not Path(facts["key_dir"]).exists()  # deleted with the session it logged in to
    # The killed run's llama-server was stopped as stale when the next one started.
    assert servers_of(sshd.user) == []


def test_gpubench_rentals_release_gives_back_what_a_killed_run_left(
    pytester: pytest.Pytester,
    market: ProviderStandIn,
    node_install: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    write_long_run(pytester, market, node_install)
    kill_mid_run(pytester, market)
    capsys.readouterr()
    assert gpubench_main(["rentals"]) == 0
    listed = capsys.readouterr().out
    assert "session sess-1" in listed and "left by a killed run" in listed
    assert market.done() == []  # listing gives nothing back
    (entry,) = (Path(os.environ["GPUBENCH_CACHE_DIR"]) / "rentals").glob("*.json")
    key_dir = Path(json.loads(entry.read_text())["key_dir"])
    assert key_dir.exists()
    assert gpubench_main(["rentals", "--release"]) == 0
    assert not key_dir.exists()
    released = capsys.readouterr().out.strip()
    assert released.startswith("rented node rented: left rented by a killed run, given back now:")
    assert released.endswith("session sess-1 marked done")
    assert market.done() == ["sess-1"]
    assert gpubench_main(["rentals"]) == 0
    assert capsys.readouterr().out.startswith("no rentals in ")
    (killed,) = (pytester.path / "runs").glob("*.jsonl")
    assert sum(r["type"] == "call" for r in read_ledger(killed)) >= 2  # measured, kept
    # A real rented machine is destroyed once given back; this one is the test's own sshd, so
    # stop the killed run's server by hand.
    stop_servers_running(node_install[0])


def stop_servers_running(binary: Path) -> None:
    """Stop (by pid) the llama-servers started from this session's copy of the binary."""
    listing = subprocess.run(
        ["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=False
    )
    for line in listing.stdout.splitlines():
        pid, _, args = line.strip().partition(" ")
        if args.startswith(str(binary)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_every_stage_reaches_the_ledger_from_an_xdist_worker(
    pytester: pytest.Pytester,
    market: ProviderStandIn,
    node_install: tuple[Path, Path],
    llama_server: Path,
) -> None:
    """Under -n 2 the worker that ran the rented node sends its stages with its cases, and its
    collect and cleanup stages with the teardown of its last case."""
    pytest.importorskip("xdist")
    local = (
        "{node: local, engine: llamacpp, model: tiny, phases: [warm], runs: 1, "
        f"server_binary: '{llama_server}', server_args: [--threads, '1']}}"
    )
    result = run_matrix(
        pytester,
        {"rented": rented(market, node_install, gpu_count=2), "local": "{kind: local}"},
        [managed_cell("rented", "tiny", node_install, phases=["warm"], runs=1), local],
        "-n",
        "2",
        "-p",
        "xdist",
    )
    result.assert_outcomes(passed=2)
    records = ledger_of(pytester)
    assert stages_of(records) == [(stage, "ok") for stage in EVERY_STAGE]
    assert {r["worker"] for r in records if r["type"] == "stage"} <= {"gw0", "gw1"}
    assert market.done() == ["sess-1"]


def test_an_engine_on_a_rented_node_is_addressed_by_its_port_there(
    pytester: pytest.Pytester,
    market: ProviderStandIn,
    node_install: tuple[Path, Path],
    sshd: SshServer,
) -> None:
    """A rented node's address is not known in advance: `port: N` reaches the engine the node
    runs on its own loopback at N, through the rented node's SSH forward."""
    from pytest_gpubench.engines.managed import ManagedServer

    binary, gguf = node_install
    node = ssh_target(sshd, "by-hand")
    engine = ManagedServer(
        node,
        cell_id="by-hand",
        launch=[str(binary), "--model", "{model_path}", "--alias", "{model}", "--host", "{host}",
                "--port", "{port}", "--threads", "1"],
        log_dir=f"{node.work_dir}/by-hand",
        values={"model": "tiny", "model_path": str(gguf)},
        ready_timeout_s=60,
    )  # fmt: skip
    engine.start()
    try:
        cell = f"{{node: rented, engine: openai, model: tiny, port: {engine.port}, runs: 1, phases: [warm]}}"
        result = run_matrix(pytester, {"rented": rented(market, node_install)}, [cell])
        result.assert_outcomes(passed=1)
        records = ledger_of(pytester)
        (record,) = [r for r in records if r["type"] == "cell"]
        assert record["node_kind"] == "provider" and record["node_port"] == engine.port
        assert int(record["engine_url"].rsplit(":", 1)[1]) != engine.port  # the forward's own
        (call,) = [r for r in records if r["type"] == "call"]
        assert call["error"] is None and call["completion_tokens"] == 8
        assert market.done() == ["sess-1"] and engine.alive()
    finally:
        engine.stop()
        node.close()
