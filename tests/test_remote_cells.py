"""Cells on remote nodes, end to end through the plugin (docs/cells.md, docs/remote-nodes.md).

SSH nodes are a real OpenSSH server on 127.0.0.1 (ssh_fixtures.py) running the real
llama-server with the project's tiny model. No GPU marketplace can be reached from here, so
rented nodes go through a stand-in of the marketplace API in docs/remote-nodes.md (provider_standin.py: inventory, sessions,
status polls, done, field by field) that hands out that same sshd.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.provider_standin import ProviderStandIn
from support.remote_cells import (
    TOKEN,
    TOKEN_ENV,
    ledger_of,
    managed_cell,
    marketplace,
    run_matrix,
    servers_of,
    ssh_node,
)

pytestmark = [pytest.mark.engine, pytest.mark.sshd]

if TYPE_CHECKING:
    from support.ssh_fixtures import SshServer

pytest_plugins = ["support.ssh_fixtures"]

OFFERS = [
    {"id": "o-cheap", "provider": "vastai", "gpu_name": "RTX 4090", "vram_gb": 24,
     "price_per_hour": 0.40, "availability_confidence": 0.9},
    {"id": "o-dear", "provider": "vastai", "gpu_name": "RTX 4090", "vram_gb": 24,
     "price_per_hour": 0.55},
]  # fmt: skip


@pytest.fixture
def provider_api(
    sshd: SshServer, session_key: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ProviderStandIn]:
    with marketplace(sshd, session_key, OFFERS, monkeypatch) as api:
        yield api


def provider_node(api: ProviderStandIn, gpu_type: str = "RTX 4090", ssh_wait_s: float = 10) -> str:
    return (
        f"{{kind: provider, api: '{api.url}', gpu_type: '{gpu_type}', provider: vastai, "
        f"max_price: 0.60, min_vram_gb: 16, api_token_env: {TOKEN_ENV}, "
        f"provision_timeout_s: 10, ssh_wait_timeout_s: {ssh_wait_s}, connect_timeout_s: 5, "
        "command_timeout_s: 20}"
    )


def _connections(sshd: SshServer) -> int:
    return sshd.log_path.read_text(errors="replace").count("Connection from")


def test_managed_cell_on_an_ssh_node(
    pytester: pytest.Pytester, sshd: SshServer, node_install: tuple[Path, Path], tmp_path: Path
) -> None:
    """A cell on the SSH host: the node's llama-server started over SSH, reached through the
    forward, restarted for the cold case; a model name full of shell syntax executes nothing."""
    markers = [tmp_path / "quoted", tmp_path / "chained", tmp_path / "substituted"]
    model = (
        f"tiny';touch {markers[0]};'$(touch {markers[2]})`touch {markers[2]}`;touch {markers[1]}"
    )
    nodes = {"gpubox": ssh_node(sshd, model_pull=[f"test -r {node_install[1]}"])}
    result = run_matrix(pytester, nodes, [managed_cell("gpubox", model, node_install, runs=2)])
    result.assert_outcomes(passed=3)

    records = ledger_of(pytester)
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert cell["node_kind"] == "ssh" and cell["model"] == model
    assert cell["node_info"]["host"] == sshd.host
    digest = hashlib.sha256(node_install[1].read_bytes()).hexdigest()
    assert cell["model_digest"] == f"sha256:{digest}"
    assert cell["gpus"] == [] and cell["gpu_summary"] == "no GPU"
    calls = [r for r in records if r["type"] == "call"]
    assert [c["phase"] for c in calls] == ["cold", "warm", "warm"]
    assert all(c["error"] is None and c["completion_tokens"] == 8 for c in calls)
    # Through the SSH forward 8 tiny-model tokens may arrive in one read: then TTFT honestly
    # equals the total, and the call says it was coalesced (no decode rate).
    assert all(0 < c["first_delta_ms"] <= c["total_duration_ms"] for c in calls)
    assert all(c["coalesced"] for c in calls if c["first_delta_ms"] == c["total_duration_ms"])
    assert calls[0]["cold_kind"] == "restart" and calls[0]["engine_timings"]["cache_n"] == 0
    assert [m for m in markers if m.exists()] == []
    assert servers_of(sshd.user) == []  # stopped on the node when the session ended
    # The node's engine log, read back with cat: one start and one restart (the cold case).
    (engine_log,) = (pytester.path / "runs" / "logs").glob("gpubox-llama-server-*.log")
    assert engine_log.read_text().count("listening on") >= 2


def test_rented_node_runs_its_cell_and_is_given_back(
    pytester: pytest.Pytester, provider_api: ProviderStandIn, node_install: tuple[Path, Path]
) -> None:
    """Rent the cheapest eligible offer, benchmark on it, mark the session done; the cell record
    carries the price and the end record the cost of the whole rental."""
    result = run_matrix(
        pytester,
        {"rented": provider_node(provider_api)},
        [managed_cell("rented", "tiny", node_install, phases=["warm"], runs=2)],
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["rented node rented: RTX 4090 at 0.4/h for * s, cost *; session sess-1 marked done"]
    )
    assert provider_api.created() == ["sess-1"] and provider_api.done() == ["sess-1"]
    (create,) = provider_api.requests("POST", "/api/v1/sessions")
    assert create.body["offer_id"] == "o-cheap"

    records = ledger_of(pytester)
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert cell["node_kind"] == "provider"
    assert cell["node_info"]["price_per_hour"] == 0.40
    assert cell["node_info"]["session_id"] == "sess-1"
    calls = [r for r in records if r["type"] == "call"]
    assert len(calls) == 2 and all(c["completion_tokens"] == 8 for c in calls)
    (node,) = records[-1]["nodes"]
    assert node["node"] == "rented" and node["session_done"] is True
    assert node["elapsed_s"] > 0 and node["cost"] == pytest.approx(
        node["elapsed_s"] / 3600 * 0.40, abs=1e-6
    )
    ledger_text = "\n".join(map(str, records))
    assert TOKEN not in ledger_text and "PRIVATE KEY" not in ledger_text
    # The rented machine's engine log outlives it.
    (engine_log,) = (pytester.path / "runs" / "logs").glob("rented-llama-server-*.log")
    assert "listening on" in engine_log.read_text()
    assert TOKEN not in result.stdout.str()


def test_nodes_run_side_by_side_under_xdist_and_the_rental_cost_reaches_the_ledger(
    pytester: pytest.Pytester,
    provider_api: ProviderStandIn,
    node_install: tuple[Path, Path],
    llama_server: Path,
) -> None:
    """With -n 2 each node gets a worker of its own; the worker that gave the rented node back
    sends its cost to the controller, which alone writes the ledger."""
    pytest.importorskip("xdist")
    cells = [
        managed_cell("rented", "tiny", node_install, phases=["warm"], runs=2),
        "{node: local, engine: llamacpp, model: tiny, phases: [warm], runs: 2, "
        f"server_binary: '{llama_server}', server_args: [--threads, '1']}}",
    ]
    nodes = {"local": "{kind: local}", "rented": provider_node(provider_api)}
    result = run_matrix(pytester, nodes, cells, "-n", "2", "-p", "xdist")
    result.assert_outcomes(passed=4)
    records = ledger_of(pytester)
    calls = [r for r in records if r["type"] == "call"]
    workers = {c["node"]: {d["worker"] for d in calls if d["node"] == c["node"]} for c in calls}
    assert len(workers["rented"]) == len(workers["local"]) == 1
    assert workers["rented"] != workers["local"]
    (node,) = records[-1]["nodes"]
    assert node["node"] == "rented" and node["session_done"] is True and node["cost"] > 0
    assert provider_api.done() == ["sess-1"]


def test_failed_nodes_are_skipped_with_their_stage_and_the_others_go_on(
    pytester: pytest.Pytester,
    sshd: SshServer,
    provider_api: ProviderStandIn,
    node_install: tuple[Path, Path],
    llama_server: Path,
    tmp_path: Path,
) -> None:
    """No offer for the rented node (stage provision), a changed host key on an SSH node (stage
    ssh_connect, both of its cells, one attempt): each is skipped with its reason while the
    local cell is measured."""
    wrong_hosts = tmp_path / "known_hosts"
    other_key = sshd.new_key(tmp_path / "impostor", "impostor")
    wrong_hosts.write_text(f"[{sshd.host}]:{sshd.port} {' '.join(other_key.split()[:2])}\n")
    nodes = {
        "local": "{kind: local}",
        "nogpu": provider_node(provider_api, gpu_type="H100"),
        "spoofed": ssh_node(sshd, known_hosts=str(wrong_hosts)),
    }
    cells = [
        managed_cell("nogpu", "tiny", node_install, phases=["warm"], runs=1),
        managed_cell("spoofed", "tiny", node_install, phases=["warm"], runs=1),
        managed_cell("spoofed", "tiny-2", node_install, phases=["warm"], runs=1),
        "{node: local, engine: llamacpp, model: tiny, phases: [warm], runs: 2, "
        f"server_binary: '{llama_server}', server_args: [--threads, '1']}}",
    ]
    connections_before = _connections(sshd)
    result = run_matrix(pytester, nodes, cells)
    result.assert_outcomes(passed=2, skipped=3)
    assert _connections(sshd) - connections_before == 1

    records = ledger_of(pytester)
    calls = [r for r in records if r["type"] == "call"]
    assert {c["cell_id"] for c in calls} == {"local:llamacpp:tiny"}
    skipped = {r["cell_id"]: r for r in records if r["type"] == "skipped"}
    assert skipped["nogpu:llamacpp:tiny"]["stage"] == "inventory"
    assert "no offer for" in skipped["nogpu:llamacpp:tiny"]["reason"]
    for cell_id in ("spoofed:llamacpp:tiny", "spoofed:llamacpp:tiny-2"):
        assert skipped[cell_id]["stage"] == "ssh_connect"
        assert skipped[cell_id]["node"] == "spoofed"
        assert "host key" in skipped[cell_id]["reason"].lower()
    assert provider_api.created() == []  # nothing rented, so nothing left to give back
    inventory = provider_api.requests("GET", "/api/v1/inventory")
    assert len(inventory) == 1  # the failed node was asked once, not once per case
    assert records[-1]["type"] == "end" and records[-1]["nodes"] == []


def test_a_rental_that_fails_after_its_session_began_is_still_accounted_for(
    pytester: pytest.Pytester,
    sshd: SshServer,
    provider_api: ProviderStandIn,
    node_install: tuple[Path, Path],
) -> None:
    """SSH never comes up (stage ssh_wait): the session is given back, and the time it was held
    still shows in the end record and the terminal."""
    provider_api.scenario.ssh_port = sshd.closed_port()
    result = run_matrix(
        pytester,
        {"rented": provider_node(provider_api, ssh_wait_s=1)},
        [managed_cell("rented", "tiny", node_install, phases=["warm"], runs=1)],
    )
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["rented node rented: RTX 4090 at 0.4/h for * s, *marked done"])
    records = ledger_of(pytester)
    (skipped,) = [r for r in records if r["type"] == "skipped"]
    assert skipped["stage"] == "ssh_wait"
    (node,) = records[-1]["nodes"]
    assert node["session_id"] == "sess-1" and node["session_done"] is True
    assert node["elapsed_s"] >= 1.0 and node["cost"] > 0
    assert provider_api.done() == ["sess-1"]


def test_probe_reports_what_a_rented_node_cost(
    pytester: pytest.Pytester, provider_api: ProviderStandIn, node_install: tuple[Path, Path]
) -> None:
    """--probe rents the node to health-check it; it says so, and gives it back."""
    result = run_matrix(
        pytester,
        {"rented": provider_node(provider_api)},
        [managed_cell("rented", "tiny", node_install, phases=["warm"], runs=1)],
        "--probe",
    )
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "rented:llamacpp:tiny*sha256:*ok",
            "rented node rented: RTX 4090 at 0.4/h for * s, cost *; session sess-1 marked done",
        ]
    )
    assert provider_api.done() == ["sess-1"]


def test_a_rented_node_is_given_back_after_its_last_case_not_at_the_end(
    pytester: pytest.Pytester,
    provider_api: ProviderStandIn,
    node_install: tuple[Path, Path],
    llama_server: Path,
) -> None:
    """cells.yaml interleaves the nodes; the rented node's cells still run together, on one
    rental, and it is marked done before the local cell starts measuring."""
    local_cell = (
        "{node: local, engine: llamacpp, model: tiny, phases: [warm], runs: 2, "
        f"server_binary: '{llama_server}', server_args: [--threads, '1']}}"
    )
    cells = [
        managed_cell("rented", "tiny", node_install, phases=["warm"], runs=1),
        local_cell,
        managed_cell("rented", "tiny-b", node_install, phases=["warm"], runs=1),
    ]
    nodes = {"rented": provider_node(provider_api), "local": "{kind: local}"}
    result = run_matrix(pytester, nodes, cells)
    result.assert_outcomes(passed=4)
    calls = [r for r in ledger_of(pytester) if r["type"] == "call"]
    assert [c["node"] for c in calls] == ["rented", "rented", "local", "local"]
    assert provider_api.created() == ["sess-1"]
    (done,) = provider_api.requests("POST", "/api/v1/sessions/sess-1/done")
    first_local = datetime.fromisoformat(calls[2]["started_at_utc"]).timestamp()
    assert done.at < first_local


def test_a_node_is_rented_once_even_when_another_plugin_interleaves_the_cases(
    pytester: pytest.Pytester,
    provider_api: ProviderStandIn,
    node_install: tuple[Path, Path],
    llama_server: Path,
) -> None:
    """A plugin that reorders after ours (as --ff does) alternates the nodes' cases: the rented
    node must stay rented until its last case, not be given back and rented again."""
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(items):
            rented = [i for i in items if "rented:" in i.nodeid]
            local = [i for i in items if "local:" in i.nodeid]
            items[:] = [i for pair in zip(rented, local) for i in pair]
        """
    )
    local_cell = (
        "{node: local, engine: llamacpp, model: tiny, phases: [warm], runs: 2, "
        f"server_binary: '{llama_server}', server_args: [--threads, '1']}}"
    )
    result = run_matrix(
        pytester,
        {"rented": provider_node(provider_api), "local": "{kind: local}"},
        [managed_cell("rented", "tiny", node_install, phases=["warm"], runs=2), local_cell],
    )
    result.assert_outcomes(passed=4)
    calls = [r for r in ledger_of(pytester) if r["type"] == "call"]
    assert [c["node"] for c in calls] == ["rented", "local", "rented", "local"]
    assert provider_api.created() == ["sess-1"] and provider_api.done() == ["sess-1"]
    (node,) = ledger_of(pytester)[-1]["nodes"]
    assert node["session_id"] == "sess-1"
