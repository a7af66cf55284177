"""SshTarget against a real OpenSSH server on 127.0.0.1 (see ssh_fixtures.py)."""

from __future__ import annotations

import pickle
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.targets.ssh import SshTarget
from pytest_gpubench.targets.ssh.hostkeys import HostKeyError
from pytest_gpubench.targets.ssh.target import (
    SshCommandTimeout,
    SshProcess,
    _cpu_facts,
    _ports_in_use,
)
from pytest_gpubench.targets.stages import SetupStep, StageError

if TYPE_CHECKING:
    from support.ssh_fixtures import SshServer

pytest_plugins = ["support.ssh_fixtures"]


def connect(server: SshServer, **overrides: object) -> SshTarget:
    options: dict[str, object] = {
        "node_id": "pavilion",
        "host": server.host,
        "port": server.port,
        "user": server.user,
        "key_file": str(server.key_file),
        "known_hosts": str(server.known_hosts),
        "connect_timeout_s": 5.0,
        "command_timeout_s": 10.0,
    }
    options.update(overrides)
    return SshTarget(**options)  # type: ignore[arg-type]


@pytest.fixture
def target(sshd: SshServer) -> Iterator[SshTarget]:
    node = connect(sshd)
    yield node
    node.close()


@pytest.fixture
def remote_dir(sshd: SshServer, request: pytest.FixtureRequest) -> Path:
    """A directory the test user owns, unique to this test."""
    path: Path = sshd.remote_dir / request.node.name.replace("[", "_").replace("]", "_")
    path.mkdir()
    subprocess.run(["chown", f"{sshd.user}:{sshd.user}", str(path)], check=True)
    return path


@pytest.mark.sshd
def test_run_returns_status_and_output(target: SshTarget) -> None:
    result = target.run(["id", "-un"], timeout_s=5)
    assert result.ok
    assert result.stdout.strip() == "gpubench-test"
    failed = target.run(["sh", "-c", "echo oops >&2; exit 3"], timeout_s=5)
    assert failed.returncode == 3
    assert failed.stderr.strip() == "oops"


@pytest.mark.sshd
def test_shell_metacharacters_are_passed_literally(target: SshTarget, remote_dir: Path) -> None:
    marker = remote_dir / "pwned"
    hostile = [
        f"qwen; touch {marker}",
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"&& touch {marker}",
        f"| touch {marker}",
        'it\'s "quoted" \\ $HOME * ~',
        f"line\ntouch {marker}",
    ]
    result = target.run(["printf", "%s\\0", *hostile], timeout_s=5)
    assert result.ok, result.stderr
    assert result.stdout.split("\0")[:-1] == hostile
    started = target.start(
        ["printf", "%s", f"model; touch {marker}"], log_path=f"{remote_dir}/p.log"
    )
    time.sleep(0.3)
    assert (
        target.run(["cat", f"{remote_dir}/p.log"], timeout_s=5).stdout == f"model; touch {marker}"
    )
    started.stop()
    assert not marker.exists()


@pytest.mark.sshd
def test_command_timeout_raises_and_kills_the_command(target: SshTarget) -> None:
    started = time.monotonic()
    with pytest.raises(SshCommandTimeout) as raised:
        target.run(["sleep", "7.25"], timeout_s=0.5)
    assert time.monotonic() - started < 3
    assert isinstance(raised.value, subprocess.TimeoutExpired)
    assert isinstance(raised.value, GpubenchError)
    assert "pavilion" in str(raised.value) and "0.5 s" in str(raised.value)
    assert pickle.loads(pickle.dumps(raised.value)).stage == "benchmark"
    # The remote `timeout` ended the command too, not just the client's wait.
    assert target.run(["pgrep", "-f", "^sleep 7.25"], timeout_s=5).returncode == 1
    assert target.run(["true"], timeout_s=5).ok


@pytest.mark.sshd
def test_unknown_host_refused_unless_trusted(sshd: SshServer, tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("[127.0.0.1]:1 ssh-ed25519 " + sshd.host_public_key.split()[1] + "\n")
    with pytest.raises(HostKeyError) as refused:
        connect(sshd, known_hosts=str(known_hosts))
    message = str(refused.value)
    assert refused.value.stage == "ssh_connect"
    assert "unknown host" in message and "pavilion" in message
    assert "127.0.0.1" in message and str(known_hosts) in message

    trusted = connect(sshd, known_hosts=str(known_hosts), trust_new_host=True)
    assert trusted.run(["true"], timeout_s=5).ok
    trusted.close()
    assert sshd.known_hosts_line() in known_hosts.read_text()
    # Recorded on first use, the host is now known without the option.
    connect(sshd, known_hosts=str(known_hosts)).close()


@pytest.mark.sshd
def test_missing_known_hosts_file_is_an_unknown_host(sshd: SshServer, tmp_path: Path) -> None:
    with pytest.raises(StageError, match="unknown host"):
        connect(sshd, known_hosts=str(tmp_path / "absent"))


@pytest.mark.sshd
def test_changed_host_key_refused_even_when_trusting_new_hosts(
    sshd: SshServer, tmp_path: Path
) -> None:
    impostor = sshd.new_key(tmp_path / "other_host", "other")
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {impostor}\n")
    for trust in (False, True):
        with pytest.raises(HostKeyError) as refused:
            connect(sshd, known_hosts=str(known_hosts), trust_new_host=trust)
        message = str(refused.value)
        assert "CHANGED" in message and "pavilion" in message
        assert "127.0.0.1" in message and str(known_hosts) in message
        assert f"ssh-keygen -R '[127.0.0.1]:{sshd.port}'" in message
    assert known_hosts.read_text() == f"[127.0.0.1]:{sshd.port} {impostor}\n"


@pytest.mark.sshd
def test_host_known_by_another_key_type_is_not_trusted_as_new(
    sshd: SshServer, tmp_path: Path
) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(tmp_path / "ecdsa")], check=True
    )
    other_type = " ".join((tmp_path / "ecdsa.pub").read_text().split()[:2])
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {other_type}\n")
    with pytest.raises(HostKeyError, match="CHANGED"):
        connect(sshd, known_hosts=str(known_hosts), trust_new_host=True)


@pytest.mark.sshd
def test_wrong_key_and_closed_port_are_ssh_connect_errors(sshd: SshServer, tmp_path: Path) -> None:
    sshd.new_key(tmp_path / "stranger", "stranger")
    with pytest.raises(StageError, match="authentication failed") as refused:
        connect(sshd, key_file=str(tmp_path / "stranger"))
    assert refused.value.stage == "ssh_connect"
    with pytest.raises(StageError, match="cannot connect"):
        connect(sshd, port=sshd.closed_port())


@pytest.mark.sshd
def test_background_process_does_not_hold_the_channel(target: SshTarget, remote_dir: Path) -> None:
    started = time.monotonic()
    process = target.start(["sleep", "300"], log_path=f"{remote_dir}/logs/sleep.log")
    assert time.monotonic() - started < 3
    assert process.alive()
    assert target.run(["echo", "still usable"], timeout_s=5).stdout == "still usable\n"
    process.stop(timeout_s=5)
    assert not process.alive()
    assert not SshProcess(target, process.pid, process.log_path).alive()


@pytest.mark.sshd
def test_stop_escalates_to_kill(target: SshTarget, remote_dir: Path) -> None:
    process = target.start(
        ["sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"], log_path=f"{remote_dir}/t.log"
    )
    started = time.monotonic()
    process.stop(timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert not process.alive()


@pytest.mark.sshd
def test_a_server_left_by_an_earlier_run_is_stopped_before_the_next_start(
    sshd: SshServer, remote_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """pytest killed with -9 leaves the node's server running (and holding the GPU): the next
    start under the same pid file stops it first, and only if it runs the same program."""
    log_path = f"{remote_dir}/logs/server.log"
    earlier = connect(sshd)
    left = earlier.start(["sleep", "300"], log_path=log_path)
    owner = Path(f"{log_path}.pid.owner").read_text().strip()
    assert "sshd" in Path(f"/proc/{owner}/comm").read_text()  # the connection's sshd process
    earlier.disconnect()  # as if pytest died: nothing stopped it
    deadline = time.monotonic() + 10
    while Path(f"/proc/{owner}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    later = connect(sshd)
    try:
        assert SshProcess(later, left.pid, log_path).alive()
        # A pid file naming another program's process is not a reason to kill it.
        other_log = f"{remote_dir}/logs/other.log"
        Path(f"{other_log}.pid").write_text(f"{left.pid}\n")
        other = later.start(["tail", "-f", "/dev/null"], log_path=other_log)
        assert SshProcess(later, left.pid, log_path).alive()
        with caplog.at_level("WARNING", logger="pytest_gpubench.targets.ssh"):
            again = later.start(["sleep", "300"], log_path=log_path)
        assert not SshProcess(later, left.pid, log_path).alive()
        assert again.pid != left.pid and again.alive() and other.alive()
        assert f"stopped `sleep` (pid {left.pid}), left running by an earlier run" in caplog.text
    finally:
        later.close()


@pytest.mark.sshd
def test_a_server_whose_run_is_still_connected_is_left_alone(
    sshd: SshServer, remote_dir: Path
) -> None:
    """Two runs on one node with the same cell: the second must not kill the first's server."""
    log_path = f"{remote_dir}/logs/shared.log"
    first, second = connect(sshd), connect(sshd)
    try:
        running = first.start(["sleep", "300"], log_path=log_path)
        other = second.start(["sleep", "300"], log_path=log_path)
        assert running.alive() and other.alive() and other.pid != running.pid
    finally:
        first.close()
        second.close()


@pytest.mark.sshd
def test_start_of_a_missing_program_shows_in_the_log(target: SshTarget, remote_dir: Path) -> None:
    process = target.start(
        ["/nonexistent/llama-server", "--port", "1"], log_path=f"{remote_dir}/m.log"
    )
    deadline = time.monotonic() + 5
    while process.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process.alive()
    assert "nonexistent" in process.log_tail()


@pytest.mark.sshd
def test_server_reached_through_port_forward(target: SshTarget, remote_dir: Path) -> None:
    (remote_dir / "hello.txt").write_text("hello through ssh")
    port = target.free_port()
    server = target.start(
        [
            "python3",
            "-m",
            "http.server",
            "--bind",
            "127.0.0.1",
            "--directory",
            str(remote_dir),
            str(port),
        ],
        log_path=f"{remote_dir}/http.log",
    )
    host, local_port = target.reach("127.0.0.1", port)
    assert host == "127.0.0.1"
    assert target.reach("127.0.0.1", port) == (host, local_port)
    body = None
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                answer = client.get(f"http://{host}:{local_port}/hello.txt")
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            body = answer.text
            break
        assert body == "hello through ssh"
        # A second connection, while the first is kept alive, rides its own channel.
        with httpx.Client(timeout=2.0, trust_env=False) as other:
            assert other.get(f"http://{host}:{local_port}/hello.txt").status_code == 200
    assert '"GET /hello.txt HTTP/1.1" 200' in server.log_tail()
    server.stop()
    assert not server.alive()


def _drop(node: SshTarget) -> None:
    """Cut the connection under paramiko's feet, as a network blip would."""
    transport = node._client.get_transport()
    assert transport is not None
    transport.sock.close()
    deadline = time.monotonic() + 10
    while transport.is_active() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not transport.is_active()


@pytest.mark.sshd
def test_a_dropped_connection_is_opened_again_and_forwards_go_on(
    sshd: SshServer, remote_dir: Path
) -> None:
    (remote_dir / "hello.txt").write_text("hello again")
    node = connect(sshd)
    try:
        port = node.free_port()
        node.start(
            ["python3", "-m", "http.server", "--bind", "127.0.0.1", "--directory",
             str(remote_dir), str(port)],
            log_path=f"{remote_dir}/http.log",
        )  # fmt: skip
        host, local_port = node.reach("127.0.0.1", port)
        url = f"http://{host}:{local_port}/hello.txt"
        assert _get_when_up(url) == "hello again"
        _drop(node)
        assert node.run(["echo", "back"], timeout_s=5).stdout == "back\n"
        assert node.reconnects == 1
        # The forward keeps its local port: the engine's URL in the cell stays valid.
        assert node.reach("127.0.0.1", port) == (host, local_port)
        assert _get_when_up(url) == "hello again"
    finally:
        node.close()


@pytest.mark.sshd
def test_a_node_that_stays_unreachable_fails_fast_after_one_attempt(sshd: SshServer) -> None:
    node = connect(sshd, connect_timeout_s=2.0)
    try:
        node.port = sshd.closed_port()  # where the reconnect will knock: nobody listens
        _drop(node)
        with pytest.raises(StageError) as first:
            node.run(["true"], timeout_s=5)
        assert first.value.stage == "ssh_connect"
        started = time.monotonic()
        with pytest.raises(StageError, match="is closed"):
            node.run(["true"], timeout_s=5)
        assert time.monotonic() - started < 1.0
    finally:
        node.close()


def _get_when_up(url: str) -> str | None:
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                return client.get(url).text
            except httpx.HTTPError:
                time.sleep(0.05)
    return None


@pytest.mark.sshd
def test_direct_reach_without_forward(sshd: SshServer) -> None:
    node = connect(sshd, forward=False)
    try:
        assert node.reach("127.0.0.1", 8080) == (sshd.host, 8080)
        assert node.reach("10.0.0.7", 11434) == ("10.0.0.7", 11434)
    finally:
        node.close()


@pytest.mark.sshd
def test_read_file_via_cat(target: SshTarget, remote_dir: Path) -> None:
    # Every code point below 256 (NUL, CR, non-ASCII), written as UTF-8: run() decodes UTF-8.
    payload = bytes(range(256)).decode("latin-1") * 4
    (remote_dir / "result.txt").write_text(payload, encoding="utf-8", newline="")
    assert target.run(["cat", str(remote_dir / "result.txt")], timeout_s=5).stdout == payload
    missing = target.run(["cat", str(remote_dir / "absent.json")], timeout_s=5)
    assert not missing.ok
    assert "absent.json" in missing.stderr


@pytest.mark.sshd
def test_gpu_inventory_empty_and_describe(target: SshTarget) -> None:
    assert target.gpu_inventory() == []
    facts = target.describe()
    assert facts["host"] == "127.0.0.1"
    assert facts["user"] == "gpubench-test"
    assert (facts["cpu_count"] or 0) >= 1
    assert facts["hostname"]
    assert "key" not in " ".join(facts)


@pytest.mark.sshd
def test_run_setup_names_the_failing_stage(target: SshTarget, remote_dir: Path) -> None:
    target.run_setup(
        [
            SetupStep("engine_install", f"echo engine > {remote_dir}/engine"),
            SetupStep("model_pull", f"echo model > {remote_dir}/model"),
        ],
        timeout_s=5,
    )
    assert (remote_dir / "model").read_text() == "model\n"
    with pytest.raises(StageError) as failed:
        target.run_setup(
            [
                SetupStep("engine_install", "true"),
                SetupStep("model_pull", "echo no such model >&2; false"),
            ],
            timeout_s=5,
        )
    assert failed.value.stage == "model_pull"
    assert "step 2" in str(failed.value) and "no such model" in str(failed.value)
    with pytest.raises(StageError) as slow:
        target.run_setup([SetupStep("engine_install", "sleep 5")], timeout_s=0.3)
    assert slow.value.stage == "engine_install"
    assert "0.3 s" in str(slow.value)


@pytest.mark.sshd
def test_close_stops_processes_and_is_idempotent(sshd: SshServer, remote_dir: Path) -> None:
    node = connect(sshd)
    process = node.start(["sleep", "300"], log_path=f"{remote_dir}/c.log")
    node.close()
    node.close()
    other = connect(sshd)
    try:
        assert not SshProcess(other, process.pid, process.log_path).alive()
    finally:
        other.close()
    with pytest.raises(StageError, match="closed"):
        node.run(["true"], timeout_s=5)


def test_free_port_fallback_parses_proc_net_tcp() -> None:
    table = (
        "  sl  local_address rem_address   st\n"
        "   0: 0100007F:1F90 00000000:0000 0A\n"
        "   1: 00000000000000000000000001000000:2B67 00000000:0000 0A\n"
    )
    assert _ports_in_use(table) == {8080, 11111}


def test_cpu_facts() -> None:
    text = "processor\t: 0\nmodel name\t: Test CPU @ 3GHz\n\nprocessor\t: 1\nmodel name\t: Test CPU @ 3GHz\n"
    assert _cpu_facts(text) == ("Test CPU @ 3GHz", 2)
    assert _cpu_facts("") == (None, None)


@pytest.mark.engine
@pytest.mark.sshd
def test_managed_llama_server_runs_through_ssh(
    target: SshTarget, remote_dir: Path, llama_server: Path, tiny_model: Path
) -> None:
    """What the plugin does for a managed cell on an SSH node: free_port, start, reach, restart."""
    import shutil

    from pytest_gpubench.engines import Request
    from pytest_gpubench.engines.llamacpp import LlamaCppEngine
    from pytest_gpubench.engines.managed import ManagedLlamaServer

    # The test user cannot enter root's cache: give it copies of its own.
    remote_binary = remote_dir / "llama-server"
    shutil.copy2(llama_server, remote_binary)
    remote_model = remote_dir / "tiny.gguf"
    shutil.copy2(tiny_model, remote_model)
    server = ManagedLlamaServer(
        target,
        cell_id="pavilion:llamacpp:tiny",
        binary=str(remote_binary),
        model_path=str(remote_model),
        alias="tiny",
        log_dir=f"{remote_dir}/logs",
        ready_timeout_s=30,
    )
    try:
        first_url = server.start()
        assert first_url.startswith("http://127.0.0.1:")
        engine = LlamaCppEngine(first_url, "tiny", None, None)
        assert engine.health(5).ok
        call = engine.chat(Request("Say something.", 4), 30)
        assert call.error is None and call.completion_tokens
        second_url = server.restart()
        assert server.starts == 2 and server.alive()
        assert (
            LlamaCppEngine(second_url, "tiny", None, None).chat(Request("Again.", 4), 30).error
            is None
        )
    finally:
        server.stop()
    assert not server.alive()
