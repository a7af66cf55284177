"""The process on this machine that serves an endpoint: the socket listening on its port
(/proc/net/tcp and tcp6, state LISTEN) and the process holding that socket (a
/proc/<pid>/fd/* link to `socket:[inode]`), so that an engine the user started is read as the
harness's own managed engines are (measure/engine_wait.py), or why it cannot be.

Where it cannot be found the machine's CPU pressure stands in, and it counts the engine and the
client waiting for each other: on an idle 2-core machine half of the sessions against a
llama-server started by hand read `unsteady` (issue 43)."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

PROC = Path("/proc")
# /proc/net/tcp's state of a listening socket (include/net/tcp_states.h: TCP_LISTEN).
LISTEN = "0A"


@dataclass(frozen=True)
class EngineProcess:
    """What was found serving an endpoint: the process (`pid`, and its `comm`: the name a proxy
    in front of the engine shows under), or why none was (`missing`, one line)."""

    pid: int | None = None
    comm: str | None = None
    missing: str | None = None

    def facts(self) -> dict[str, object]:
        """As the cell record says it."""
        if self.pid is not None:
            return {"pid": self.pid, "comm": self.comm}
        return {"missing": self.missing}


def endpoint_process(base_url: str, proc: Path = PROC) -> EngineProcess:
    """The process on this machine listening on `base_url`'s port, where its host is this
    machine (a loopback address, `localhost`, or an address of one of this host's interfaces)."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return EngineProcess(missing=f"the endpoint {base_url} has no port to look for")
    if not is_this_machine(host):
        return EngineProcess(
            missing=f"the endpoint's host {host} is not this machine: the engine's own CPU wait "
            "cannot be read here"
        )
    inodes = listening_inodes(port, proc)
    if not inodes:
        return EngineProcess(
            missing=f"no socket in this network namespace listens on port {port} (an engine in a "
            "container or another namespace, reached through a forward): its own CPU wait "
            "cannot be read"
        )
    holders = socket_holders(inodes, proc)
    if not holders:
        return EngineProcess(
            missing=f"no process this user may read holds the socket listening on port {port} "
            "(another user's, or a container's): the engine's own CPU wait cannot be read"
        )
    if os.getpid() in holders:
        return EngineProcess(
            missing=f"port {port} is served by the harness's own process: its wait is the "
            "client's, not an engine's"
        )
    pid = topmost(holders, proc)
    return EngineProcess(pid=pid, comm=process_name(pid, proc))


def is_this_machine(host: str) -> bool:
    """Whether `host` names this machine: a loopback name or address, or an address that a
    socket here may bind to (one of this host's own)."""
    if host in ("localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    addresses = {str(info[4][0]) for info in infos}
    if not addresses:
        return False
    return all(_local_address(address) for address in addresses)


def _local_address(address: str) -> bool:
    try:
        parsed = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if parsed.is_loopback or parsed.is_unspecified:
        return True
    family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))  # only an address of this host's own binds
    except OSError:
        return False
    return True


def listening_inodes(port: int, proc: Path = PROC) -> set[int]:
    """The inodes of the sockets listening on `port` (any address, IPv4 or IPv6) in this
    process's network namespace."""
    inodes: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            try:
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                inode = int(fields[9])
            except (IndexError, ValueError):
                continue
            if local_port == port and inode != 0:
                inodes.add(inode)
    return inodes


def socket_holders(inodes: set[int], proc: Path = PROC) -> set[int]:
    """The processes with a file descriptor on one of the sockets `inodes` (a server that forks
    its workers shares its listening socket with them); processes this user may not read are
    passed over. This process is looked at first, and alone where it holds one."""
    links = {f"socket:[{inode}]" for inode in inodes}
    own = os.getpid()
    if _holds(proc / str(own), links):
        return {own}
    holders: set[int] = set()
    try:
        entries = list(proc.iterdir())
    except OSError:
        return holders
    for entry in entries:
        if entry.name.isdigit() and int(entry.name) != own and _holds(entry, links):
            holders.add(int(entry.name))
    return holders


def _holds(process: Path, links: set[str]) -> bool:
    try:
        descriptors = list((process / "fd").iterdir())
    except OSError:
        return False  # another user's, or ended while we looked
    for descriptor in descriptors:
        try:
            if os.readlink(descriptor) in links:
                return True
        except OSError:
            continue
    return False


def topmost(pids: set[int], proc: Path = PROC) -> int:
    """The holder none of the others descends from (the server that forked the rest); the
    lowest such pid where there are several."""

    def parent(pid: int) -> int | None:
        try:
            stat = (proc / str(pid) / "stat").read_text()
            return int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def has_holder_above(pid: int) -> bool:
        seen: set[int] = set()
        current = parent(pid)
        while current is not None and current > 1 and current not in seen:
            if current in pids:
                return True
            seen.add(current)
            current = parent(current)
        return False

    return min((pid for pid in pids if not has_holder_above(pid)), default=min(pids))


def process_name(pid: int, proc: Path = PROC) -> str | None:
    """The process's name as the kernel keeps it (/proc/<pid>/comm)."""
    try:
        return (proc / str(pid) / "comm").read_text().strip() or None
    except OSError:
        return None
