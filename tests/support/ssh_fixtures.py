"""Fixtures for a real OpenSSH server on 127.0.0.1 that the SSH and provider tests log in to.

The server runs from a private sshd_config (`sshd -D -e -f`), with its own host key, an
authorized_keys file in a temporary directory, and logins only for the unprivileged
`gpubench-test` user (shell /bin/sh, so no login shell startup slows each command).
`scripts/setup-sshd.sh` installs openssh-server and creates the user; running sshd as another
user needs root, so these tests skip with the reason when not run as root.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TEST_USER = os.environ.get("GPUBENCH_SSH_TEST_USER", "gpubench-test")
SSHD = Path("/usr/sbin/sshd")
SETUP_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "setup-sshd.sh"
READY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class SshServer:
    host: str
    port: int
    user: str
    key_file: Path
    known_hosts: Path
    host_public_key: str
    authorized_keys: Path
    base_dir: Path
    remote_dir: Path
    log_path: Path

    def authorize(self, public_key: str) -> None:
        with self.authorized_keys.open("a", encoding="ascii") as keys:
            keys.write(public_key.strip() + "\n")

    def known_hosts_line(self) -> str:
        return f"[{self.host}]:{self.port} {self.host_public_key}\n"

    # Helpers reached through the fixture, so test modules need not import this module (it is
    # a plugin; importing it first would keep pytest from rewriting its asserts).
    @staticmethod
    def new_key(path: Path, comment: str) -> str:
        return generate_key(path, comment)

    @staticmethod
    def closed_port() -> int:
        return free_local_port()


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def generate_key(path: Path, comment: str) -> str:
    """Write a new ed25519 key pair at path (and path.pub); returns the public key line."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )
    return path.with_suffix(".pub").read_text(encoding="ascii").strip()


def _user_exists(name: str) -> bool:
    return subprocess.run(["id", "-u", name], capture_output=True, check=False).returncode == 0


def _ensure_installed() -> None:
    if SSHD.exists() and shutil.which("ssh-keygen") and _user_exists(TEST_USER):
        return
    setup = subprocess.run(
        ["bash", str(SETUP_SCRIPT)], capture_output=True, text=True, check=False, timeout=600
    )
    if setup.returncode != 0 or not SSHD.exists() or not _user_exists(TEST_USER):
        pytest.skip(
            f"OpenSSH server or user {TEST_USER} missing and {SETUP_SCRIPT.name} failed "
            f"(status {setup.returncode}): {setup.stderr.strip()[-300:]}"
        )


def _wait_for_banner(port: int, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited with {process.returncode}: {log_path.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as probe:
                if probe.recv(4).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"sshd did not answer on port {port}: {log_path.read_text()}")


@pytest.fixture(scope="session")
def sshd() -> Iterator[SshServer]:
    if os.geteuid() != 0:
        pytest.skip(
            "the SSH tests run their own sshd, which logs users in only when started as root; "
            f"run them as root after `bash {SETUP_SCRIPT.name}`"
        )
    _ensure_installed()
    # Not pytest's tmp_path: that sits in a 0700 directory the test user cannot enter, and sshd
    # reads authorized_keys as that user.
    base = Path(tempfile.mkdtemp(prefix="gpubench-sshd-"))
    base.chmod(0o755)
    process: subprocess.Popen[bytes] | None = None
    try:
        host_public = generate_key(base / "host_ed25519", "gpubench-test-host")
        client_public = generate_key(base / "client_ed25519", "gpubench-test-client")
        authorized_keys = base / "authorized_keys"
        authorized_keys.write_text(client_public + "\n", encoding="ascii")
        authorized_keys.chmod(0o644)
        remote_dir = base / "remote"
        remote_dir.mkdir()
        shutil.chown(remote_dir, user=TEST_USER, group=TEST_USER)
        port = free_local_port()
        config = base / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"Port {port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {base / 'host_ed25519'}",
                    f"PidFile {base / 'sshd.pid'}",
                    f"AuthorizedKeysFile {authorized_keys}",
                    "StrictModes no",
                    "UsePAM no",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin no",
                    f"AllowUsers {TEST_USER}",
                    # Local forwards reach a node's engine; remote ones carry client tasks back
                    # to the coordinator (`clients: {coordinator: tunnel}`).
                    "AllowTcpForwarding yes",
                    # A key's authorized_keys line may set PATH (environment="PATH=..."): the
                    # telemetry tests put a stand-in nvidia-smi first on the node's PATH.
                    "PermitUserEnvironment PATH",
                    "MaxSessions 100",
                    "MaxStartups 100",
                    "UseDNS no",
                    "PrintMotd no",
                    "LogLevel VERBOSE",
                    "",
                ]
            ),
            encoding="ascii",
        )
        # sshd's privilege separation directory; /run is a tmpfs, so it can vanish on reboot.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        log_path = base / "sshd.log"
        with log_path.open("wb") as sshd_log:
            process = subprocess.Popen(
                [str(SSHD), "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=sshd_log,
                stderr=subprocess.STDOUT,
            )
        _wait_for_banner(port, process, log_path)
        server = SshServer(
            host="127.0.0.1",
            port=port,
            user=TEST_USER,
            key_file=base / "client_ed25519",
            known_hosts=base / "known_hosts",
            host_public_key=" ".join(host_public.split()[:2]),
            authorized_keys=authorized_keys,
            base_dir=base,
            remote_dir=remote_dir,
            log_path=log_path,
        )
        server.known_hosts.write_text(server.known_hosts_line(), encoding="ascii")
        yield server
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def session_key(sshd: SshServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The private key a provider stand-in hands out; its public half may log in to the sshd."""
    path = tmp_path_factory.mktemp("provider-key") / "session_ed25519"
    sshd.authorize(generate_key(path, "gpubench-provider-session"))
    return path.read_text(encoding="ascii")


@pytest.fixture(scope="module")
def node_install(sshd: SshServer, llama_server: Path, tiny_model: Path) -> tuple[Path, Path]:
    """llama-server and the tiny model as the node's own install: copies the test user may run.

    (Root's cache, where `make engine` put them, is closed to that user.)
    """
    install = sshd.remote_dir / "install"
    install.mkdir(exist_ok=True)
    binary = Path(shutil.copy2(llama_server, install / "llama-server"))
    model = Path(shutil.copy2(tiny_model, install / "tiny.gguf"))
    subprocess.run(["chown", "-R", f"{sshd.user}:{sshd.user}", str(install)], check=True)
    return binary, model


# What the node's Python needs to run a load client task: the top-level modules and packages
# it imports from site-packages, as paths, found by importing here what a task runs
# (pytest_gpubench itself is copied whole). Paths, not names: a name looked up again on this
# process's sys.path once found another `httpx` than the one a task loads.
_CLIENT_IMPORTS = """
import sys
import pytest_gpubench.run.load.client_task, pytest_gpubench.run.load.driver
import pytest_gpubench.engines, pytest_gpubench.measure.load_client
tops = set()
for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None) or ""
    if "site-packages/" in path:
        base, rest = path.split("site-packages/", 1)
        tops.add(base + "site-packages/" + rest.split("/")[0])
print("\\n".join(sorted(tops)))
"""
# Where this interpreter finds a top-level module (the path to copy), printed.
_FIND = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.find_spec(sys.argv[1])
if spec is not None and spec.origin:
    origin = Path(spec.origin)
    print(origin.parent if origin.name == "__init__.py" else origin)
"""


@pytest.fixture(scope="module")
def node_python(sshd: SshServer) -> str:
    """A Python with pytest-gpubench installed as the node's own: a venv of the system's
    python3 in the test user's folder, with this checkout's package and the libraries a load
    client task imports copied into it (this interpreter's are in root's home, closed to that
    user). Skips where the system python3 is another minor version than this one (the copied
    compiled libraries would not load)."""
    system = Path("/usr/bin/python3")
    version = subprocess.run(
        [str(system), "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if version.stdout.strip() != str(tuple(sys.version_info[:2])):
        pytest.skip(f"{system} is not Python {sys.version_info[0]}.{sys.version_info[1]}")
    venv = sshd.remote_dir / "client-venv"
    if not venv.exists():
        subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True)
        (site,) = venv.glob("lib/python3*/site-packages")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        listed = subprocess.run(
            [sys.executable, "-c", _CLIENT_IMPORTS], capture_output=True, text=True, check=True,
            env=env,
        ).stdout.split("\n")  # fmt: skip
        import pytest_gpubench

        package = Path(pytest_gpubench.__file__).parent
        shutil.copytree(package, site / "pytest_gpubench", ignore=_IGNORE)
        for top in filter(None, listed):
            if not Path(top).name.startswith(
                ("_distutils_hack", "__editable__", "pytest_gpubench")
            ):
                _copy_path(Path(top), site)
        # Whatever still fails to import as the node's session runs it (as the node's user,
        # python -I: no PYTHONPATH or other hint from this process), copied from where this
        # interpreter finds it, until the task's imports load.
        chown = ["chown", "-R", f"{sshd.user}:{sshd.user}", str(venv)]
        for _ in range(20):
            subprocess.run(chown, check=True)
            tried = subprocess.run(
                [shutil.which("runuser") or "/usr/sbin/runuser", "-u", sshd.user, "--", str(venv / "bin" / "python"), "-I", "-c",
                 _TASK_IMPORTS],
                capture_output=True, text=True, check=False, env={"PATH": "/usr/bin:/bin"},
                cwd=str(venv),
            )  # fmt: skip
            missing = re.search(r"No module named '([\w.]+)'", tried.stderr)
            if tried.returncode == 0 or missing is None:
                break
            found = subprocess.run(
                [sys.executable, "-c", _FIND, missing.group(1).split(".")[0]],
                capture_output=True, text=True, check=False, env=env,
            ).stdout.strip()  # fmt: skip
            if not found:
                break  # not this interpreter's either: the test will say what is missing
            _copy_path(Path(found), site)
        subprocess.run(chown, check=True)
    return str(venv / "bin" / "python")


# What a client task imports as it runs, not only as it starts.
_TASK_IMPORTS = (
    "import pytest_gpubench.run.load.client_task, pytest_gpubench.run.load.driver, "
    "pytest_gpubench.engines, pytest_gpubench.measure.load_client"
)


_IGNORE = shutil.ignore_patterns("__pycache__")


def _copy_path(source: Path, site: Path) -> None:
    """A top-level module or package (its path) copied into `site`, over what was there."""
    target = site / source.name
    if target.is_dir():
        shutil.rmtree(target)
    if source.is_dir():
        shutil.copytree(source, target, ignore=_IGNORE)
    else:
        shutil.copy2(source, target)
