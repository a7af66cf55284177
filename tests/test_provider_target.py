"""ProviderTarget against the marketplace stand-in, which hands out the real sshd of ssh_fixtures."""

from __future__ import annotations

import _thread
import logging
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.provider_standin import ProviderStandIn, Scenario

from pytest_gpubench.config.nodes import LocalNode, ProviderNode, SshNode
from pytest_gpubench.targets import open_target
from pytest_gpubench.targets.local import LocalTarget
from pytest_gpubench.targets.protocol import Rental
from pytest_gpubench.targets.provider import ProviderTarget
from pytest_gpubench.targets.provider.api import Offer, choose_offers
from pytest_gpubench.targets.ssh import SshTarget
from pytest_gpubench.targets.stages import StageError

if TYPE_CHECKING:
    from support.ssh_fixtures import SshServer

pytest_plugins = ["support.ssh_fixtures"]

TOKEN = "tok-3f9c1a-secret"
TOKEN_ENV = "GPUBENCH_TEST_PROVIDER_TOKEN"

OFFERS: list[dict[str, Any]] = [
    # Cheapest, but unlikely to be there.
    {"id": "o-flaky", "provider": "vastai", "gpu_name": "RTX 4090", "vram_gb": 24,
     "price_per_hour": 0.20, "availability_confidence": 0.3},
    # Too little VRAM for the model.
    {"id": "o-small", "provider": "vastai", "gpu_name": "RTX 4090", "vram_gb": 12,
     "price_per_hour": 0.25, "availability_confidence": 0.9},
    {"id": "o-good", "provider": "vastai", "gpu_name": "RTX 4090", "vram_gb": 24,
     "price_per_hour": 0.40, "availability_confidence": 0.8},
    {"id": "o-next", "provider": "vastai", "gpu_name": "RTX 4090", "vram_gb": 24,
     "price_per_hour": 0.45},
    # Over budget.
    {"id": "o-dear", "provider": "vastai", "gpu_name": "RTX 4090", "vram_gb": 48,
     "price_per_hour": 0.90, "availability_confidence": 0.99},
]  # fmt: skip


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return TOKEN


@pytest.fixture
def remote_dir(sshd: SshServer, request: pytest.FixtureRequest) -> Path:
    path: Path = sshd.remote_dir / f"provider-{request.node.name}".replace("[", "_").replace(
        "]", ""
    )
    path.mkdir()
    subprocess.run(["chown", f"{sshd.user}:{sshd.user}", str(path)], check=True)
    return path


StandInFactory = Callable[..., ProviderStandIn]


@pytest.fixture
def standin(sshd: SshServer, session_key: str, token: str) -> Iterator[StandInFactory]:
    started: list[ProviderStandIn] = []

    def start(**overrides: Any) -> ProviderStandIn:
        options: dict[str, Any] = {
            "offers": OFFERS,
            "private_key": session_key,
            "ssh_host": sshd.host,
            "ssh_port": sshd.port,
            "ssh_user": sshd.user,
            "token": token,
        }
        options.update(overrides)
        server = ProviderStandIn(Scenario(**options)).__enter__()
        started.append(server)
        return server

    yield start
    for server in started:
        server.__exit__(None, None, None)


def provider_node(api: str, **overrides: Any) -> ProviderNode:
    options: dict[str, Any] = {
        "kind": "provider",
        "api": api,
        "gpu_type": "RTX 4090",
        "provider": "vastai",
        "max_price": 0.60,
        "min_vram_gb": 16,
        "api_token_env": TOKEN_ENV,
        "provision_timeout_s": 5,
        "ssh_wait_timeout_s": 5,
        "connect_timeout_s": 5,
        "command_timeout_s": 10,
    }
    options.update(overrides)
    return ProviderNode(**options)


def rented(api: str, closed: list[Rental] | None = None, **overrides: Any) -> ProviderTarget:
    """A provider target; what it reports once given back is appended to `closed`."""
    return ProviderTarget(
        "rented",
        provider_node(api, **overrides),
        on_rental_closed=(closed if closed is not None else []).append,
        poll_interval_s=0.05,
        watch_interval_s=0.1,
    )


def assert_given_back(target: ProviderTarget, api: ProviderStandIn) -> None:
    """docs/remote-nodes.md: every session created was marked done, and the temporary key is gone."""
    assert api.created(), "expected a session to have been created"
    assert sorted(set(api.done())) == sorted(api.created())
    assert target.key_path is not None and not target.key_path.exists()
    assert target.key_dir is not None and not target.key_dir.exists()


@pytest.mark.sshd
def test_happy_path(standin: StandInFactory, remote_dir: Path) -> None:
    api = standin()
    target = rented(
        api.url,
        setup=[f"echo engine > {remote_dir}/engine"],
        model_pull=[f"echo model > {remote_dir}/model"],
    )
    target.open()
    try:
        assert target.offer is not None and target.offer.id == "o-good"
        assert target.run(["id", "-un"], timeout_s=5).stdout.strip() == "gpubench-test"
        assert (remote_dir / "model").read_text() == "model\n"
        assert target.key_path is not None
        assert stat.S_IMODE(target.key_path.stat().st_mode) == 0o600
        assert target.gpu_inventory() == []
        facts = target.describe()
        assert facts["price_per_hour"] == 0.40
        assert facts["session_id"] == "sess-1" and facts["offer_id"] == "o-good"
        assert facts["cost"] >= 0 and facts["elapsed_s"] > 0
        assert facts["host"] == "127.0.0.1" and (facts["cpu_count"] or 0) >= 1
        assert TOKEN not in repr(facts) and "PRIVATE KEY" not in repr(facts)
    finally:
        target.close()
    assert_given_back(target, api)
    target.close()
    assert api.done() == ["sess-1"], "close() is idempotent"
    # The bill stops with the session: cost = elapsed hours x price, frozen at close().
    frozen = target.describe()
    time.sleep(0.01)
    assert target.describe() == frozen
    assert frozen["cost"] == round(target.elapsed_s() / 3600 * 0.40, 6)

    (inventory,) = api.requests("GET", "/api/v1/inventory")
    assert inventory.query == {"gpu_type": ["RTX 4090"], "provider": ["vastai"], "min_vram": ["16"]}
    (create,) = api.requests("POST", "/api/v1/sessions")
    assert create.body == {
        "consumer_id": "pytest-gpubench",
        "offer_id": "o-good",
        "workload_type": "inference-benchmark",
        "reservation_hours": 1.0,
    }
    assert {seen.authorization for seen in api.seen} == {f"Bearer {TOKEN}"}


@pytest.mark.sshd
def test_no_offers(standin: StandInFactory) -> None:
    api = standin()
    target = rented(api.url, max_price=0.10)
    with pytest.raises(StageError) as failed:
        target.open()
    # The inventory query and the choice of an offer are a stage of their own.
    assert failed.value.stage == "inventory"
    assert "no offer" in str(failed.value) and "RTX 4090" in str(failed.value)
    assert "rented" in str(failed.value)
    assert api.created() == [] and api.done() == []
    assert target.key_path is None


@pytest.mark.sshd
def test_session_failed(standin: StandInFactory) -> None:
    api = standin(statuses=["provisioning", "failed"], error="GPU fell off the bus")
    target = rented(api.url)
    with pytest.raises(StageError) as failed:
        target.open()
    assert failed.value.stage == "provision"
    assert "GPU fell off the bus" in str(failed.value) and "sess-1" in str(failed.value)
    assert_given_back(target, api)


@pytest.mark.sshd
def test_provision_timeout(standin: StandInFactory) -> None:
    api = standin(statuses=["pending"])
    target = rented(api.url, provision_timeout_s=0.3)
    with pytest.raises(StageError, match=r"not running after 0\.3 s") as failed:
        target.open()
    assert failed.value.stage == "provision"
    assert_given_back(target, api)


@pytest.mark.sshd
def test_ssh_never_ready(standin: StandInFactory, sshd: SshServer) -> None:
    api = standin(ssh_port=sshd.closed_port())
    target = rented(api.url, ssh_wait_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(StageError) as failed:
        target.open()
    assert time.monotonic() - started < 5
    assert failed.value.stage == "ssh_wait"
    assert "ssh_wait_timeout_s" in str(failed.value)
    assert_given_back(target, api)


@pytest.mark.sshd
def test_instance_stopped_mid_run_fails_fast(standin: StandInFactory) -> None:
    api = standin()
    target = rented(api.url)
    target.open()
    try:
        flip = threading.Timer(0.3, api.set_status, ("sess-1", "stopped", "host reclaimed"))
        flip.start()
        started = time.monotonic()
        with pytest.raises(StageError) as stopped:
            target.run(["sleep", "20"], timeout_s=30)
        assert time.monotonic() - started < 5
        flip.join()
        assert "stopped the instance" in str(stopped.value)
        assert "host reclaimed" in str(stopped.value)
        with pytest.raises(StageError, match="stopped the instance"):
            target.run(["true"], timeout_s=5)
    finally:
        target.close()
    assert_given_back(target, api)


@pytest.mark.sshd
def test_instance_stopped_while_provisioning(standin: StandInFactory) -> None:
    api = standin(statuses=["provisioning", "stopped"], error="out of capacity")
    target = rented(api.url)
    with pytest.raises(StageError, match="was stopped by the provider: out of capacity"):
        target.open()
    assert_given_back(target, api)


@pytest.mark.parametrize("where", ["on_create", "while_provisioning"])
@pytest.mark.sshd
def test_no_public_ip_moves_to_the_next_offer(standin: StandInFactory, where: str) -> None:
    message = "no public IPs available on this host"
    if where == "on_create":
        api = standin(create_errors={"o-good": (409, message)})
    else:
        api = standin(session_errors={"o-good": message})
    target = rented(api.url)
    target.open()
    try:
        assert target.offer is not None and target.offer.id == "o-next"
        assert target.run(["true"], timeout_s=5).ok
        assert target.describe()["price_per_hour"] == 0.45
    finally:
        target.close()
    offers_tried = [seen.body["offer_id"] for seen in api.requests("POST", "/api/v1/sessions")]
    assert offers_tried == ["o-good", "o-next"]
    assert_given_back(target, api)


@pytest.mark.sshd
def test_ctrl_c_while_provisioning_still_gives_back(standin: StandInFactory) -> None:
    api = standin(statuses=["provisioning"])
    target = rented(api.url, provision_timeout_s=30)
    interrupt = threading.Timer(0.3, _thread.interrupt_main)
    interrupt.start()
    with pytest.raises(KeyboardInterrupt):
        target.open()
    interrupt.join()
    assert_given_back(target, api)


@pytest.mark.sshd
def test_secrets_stay_out_of_errors_and_logs(
    standin: StandInFactory, session_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    # An API that echoes what it was sent back into its error text.
    api = standin(statuses=["provisioning", "failed"], error=f"bad auth {TOKEN} for {session_key}")
    target = rented(api.url)
    with caplog.at_level(logging.DEBUG), pytest.raises(StageError) as failed:
        target.open()
    message = str(failed.value)
    assert message.count("[REDACTED]") >= 2  # the token and the private key, each cut out
    everything = message + caplog.text
    assert TOKEN not in everything
    assert "PRIVATE KEY-----\n" not in everything and session_key.splitlines()[1] not in everything
    assert_given_back(target, api)


def test_missing_token_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(StageError, match=f"api_token_env: \\${TOKEN_ENV} is not set"):
        rented("http://127.0.0.1:9")


@pytest.mark.sshd
def test_wrong_token_fails_provision(standin: StandInFactory) -> None:
    api = standin(token="another")
    target = rented(api.url)
    with pytest.raises(StageError, match="HTTP 401") as failed:
        target.open()
    assert TOKEN not in str(failed.value)
    assert api.created() == []


@pytest.mark.sshd
def test_the_rental_is_reported_once_when_given_back(standin: StandInFactory) -> None:
    """on_rental_closed hears of each rental once: after close, or after a failed open."""
    api = standin()
    closed: list[Rental] = []
    target = rented(api.url, closed).open()
    try:
        assert closed == [], "nothing is reported while the node is held"
    finally:
        target.close()
    target.close()
    (facts,) = closed
    assert facts == {
        "node": "rented",
        "kind": "provider",
        "session_id": "sess-1",
        "offer_id": "o-good",
        "gpu_name": "RTX 4090",
        "price_per_hour": 0.40,
        "elapsed_s": round(target.elapsed_s(), 3),
        "cost": round(target.elapsed_s() / 3600 * 0.40, 6),
        "session_done": True,
    }

    failed_api = standin(statuses=["provisioning", "failed"], error="GPU fell off the bus")
    failed_closed: list[Rental] = []
    with pytest.raises(StageError):
        rented(failed_api.url, failed_closed).open()
    (failed_facts,) = failed_closed
    assert failed_facts["session_id"] == "sess-1" and failed_facts["session_done"] is True

    no_offer_api = standin()
    nothing: list[Rental] = []
    with pytest.raises(StageError, match="no offer"):
        rented(no_offer_api.url, nothing, max_price=0.10).open()
    assert nothing == [], "no session was created, so nothing was rented"


def test_choose_offers() -> None:
    offers = [offer for offer in map(Offer.from_api, OFFERS) if offer is not None]
    chosen = choose_offers(offers, max_price=0.60, min_vram_gb=16)
    assert [offer.id for offer in chosen] == ["o-good", "o-next"]
    no_minimum = choose_offers(offers, max_price=0.60, min_vram_gb=None)
    assert [offer.id for offer in no_minimum] == ["o-small", "o-good", "o-next"]
    assert choose_offers(offers, max_price=0.1, min_vram_gb=None) == []
    assert Offer.from_api({"id": 1}) is None
    assert Offer.from_api({"id": 1, "price_per_hour": "cheap"}) is None
    assert Offer.from_api("not an offer") is None
    assert Offer.from_api({"id": 7, "price_per_hour": 1}) == Offer(7, "", "", None, 1.0, None)


@pytest.mark.sshd
def test_factory_opens_each_kind(
    standin: StandInFactory, sshd: SshServer, remote_dir: Path
) -> None:
    closed: list[Rental] = []
    assert isinstance(
        open_target(
            "local", LocalNode(kind="local"), plugin_hook=None, on_rental_closed=closed.append
        ),
        LocalTarget,
    )

    ssh_node = SshNode(
        kind="ssh",
        host=sshd.host,
        port=sshd.port,
        user=sshd.user,
        key_file=str(sshd.key_file),
        known_hosts=str(sshd.known_hosts),
        setup=[f"touch {remote_dir}/installed"],
    )
    ssh_target = open_target("pavilion", ssh_node, plugin_hook=None, on_rental_closed=closed.append)
    try:
        assert isinstance(ssh_target, SshTarget)
        assert (remote_dir / "installed").exists()
    finally:
        ssh_target.close()
    failing = ssh_node.model_copy(update={"model_pull": ["exit 4"]})
    with pytest.raises(StageError) as failed:
        open_target("pavilion", failing, plugin_hook=None, on_rental_closed=closed.append)
    assert failed.value.stage == "model_pull"

    api = standin(statuses=["running"])
    provider_target = open_target(
        "rented", provider_node(api.url), plugin_hook=None, on_rental_closed=closed.append
    )
    try:
        assert isinstance(provider_target, ProviderTarget)
        assert provider_target.run(["true"], timeout_s=5).ok
    finally:
        provider_target.close()
    assert api.done() == ["sess-1"]
    assert [(facts["node"], facts["session_id"]) for facts in closed] == [("rented", "sess-1")]
