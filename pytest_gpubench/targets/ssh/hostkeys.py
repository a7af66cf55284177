"""Host-key policies of SSH nodes: refuse unknown or changed keys, or trust a new host once."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import paramiko

from pytest_gpubench.targets.stages import StageError

log = logging.getLogger(__name__)


class HostKeyError(StageError):
    """The host's key is unknown or has changed: never retried, never trusted silently."""

    def __init__(self, message: str) -> None:
        super().__init__("ssh_connect", message)

    def __reduce__(self) -> Any:
        return type(self), (self.message,)


class UnknownHostKey(paramiko.SSHException):
    """A key the policy refused, with the key types known_hosts has for the host (if any)."""

    def __init__(self, hostname: str, key: paramiko.PKey, known_types: Sequence[str]) -> None:
        super().__init__(hostname)
        self.hostname = hostname
        self.key = key
        self.known_types = tuple(known_types)


class RefuseUnknownHost(paramiko.MissingHostKeyPolicy):
    """Like paramiko's RejectPolicy, but raises a type that says which key was refused."""

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        known = client.get_host_keys().lookup(hostname)
        raise UnknownHostKey(hostname, key, list(known.keys()) if known else [])


class TrustNewHost(paramiko.MissingHostKeyPolicy):
    """Record a host seen for the first time; a host already known under any key is refused.

    The line is appended rather than rewriting the file (paramiko's AutoAddPolicy rewrites it),
    so the user's comments, hashed names and @cert-authority lines survive. A host that has a
    known key of another type is refused: that is what a replaced host looks like too.
    """

    def __init__(self, known_hosts: Path) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        known = client.get_host_keys().lookup(hostname)
        if known:
            raise UnknownHostKey(hostname, key, list(known.keys()))
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(self.known_hosts, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(descriptor, "a", encoding="ascii") as known_hosts:
            known_hosts.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        log.warning(
            "trusting new host %s (%s %s), recorded in %s",
            hostname,
            key.get_name(),
            key.fingerprint,
            self.known_hosts,
        )


def host_key_policy(known_hosts: Path, *, trust_new_host: bool) -> paramiko.MissingHostKeyPolicy:
    return TrustNewHost(known_hosts) if trust_new_host else RefuseUnknownHost()


def refusal(
    exc: paramiko.BadHostKeyException | UnknownHostKey, host: str, port: int, known_hosts: Path
) -> str:
    """Why the connection was refused and what the user can do about it."""
    if isinstance(exc, paramiko.BadHostKeyException):
        # known_hosts names a host on another port than 22 `[host]:port`.
        known_name = host if port == 22 else f"[{host}]:{port}"
        return (
            f"host key has CHANGED: the server offers {exc.key.get_name()} "
            f"{exc.key.fingerprint}, known_hosts {known_hosts} has "
            f"{exc.expected_key.fingerprint}. Refusing to connect: this is what a "
            "man-in-the-middle looks like. If the host was reinstalled, check the new "
            f"fingerprint and remove the old line (ssh-keygen -R '{known_name}' "
            f"-f {known_hosts})."
        )
    if exc.known_types:
        return (
            f"host key has CHANGED: the server offers {exc.key.get_name()} "
            f"{exc.key.fingerprint}, known_hosts {known_hosts} knows this host only "
            f"by {', '.join(exc.known_types)}. Refusing to connect (also with "
            "trust_new_host)."
        )
    return (
        f"unknown host: {exc.hostname} is not in known_hosts {known_hosts} (the "
        f"server offers {exc.key.get_name()} {exc.key.fingerprint}). Check the "
        "fingerprint and add the host (ssh-keyscan -p "
        f"{port} {host} >> {known_hosts}), or set trust_new_host: true "
        "on the node to record it on first use."
    )
