"""Opening one SSH connection: key authentication, host-key checks, one clear error each."""

from __future__ import annotations

from pathlib import Path

import paramiko

from pytest_gpubench.targets.ssh.hostkeys import (
    HostKeyError,
    UnknownHostKey,
    host_key_policy,
    refusal,
)
from pytest_gpubench.targets.stages import StageError

# Seconds between keepalive messages on an idle connection.
KEEPALIVE_S = 15


def open_client(
    node_id: str,
    host: str,
    port: int,
    user: str,
    *,
    key_file: str | None,
    known_hosts: Path,
    trust_new_host: bool,
    timeout_s: float,
) -> paramiko.SSHClient:
    """A connected client; raises StageError (HostKeyError for a refused host key)."""
    where = f"{user}@{host}:{port}"

    def fail(message: str) -> StageError:
        return StageError("ssh_connect", f"node {node_id}: {where}: {message}")

    def refuse(message: str) -> HostKeyError:
        return HostKeyError(f"node {node_id}: {where}: {message}")

    if key_file is not None and not Path(key_file).is_file():
        raise fail(f"key_file {key_file} does not exist")
    client = paramiko.SSHClient()
    if known_hosts.is_file():
        try:
            client.load_host_keys(str(known_hosts))
        except (OSError, paramiko.SSHException) as exc:
            raise fail(f"cannot read known_hosts {known_hosts}: {exc}") from None
    client.set_missing_host_key_policy(host_key_policy(known_hosts, trust_new_host=trust_new_host))
    try:
        client.connect(
            host,
            port,
            username=user,
            key_filename=key_file,
            timeout=timeout_s,
            banner_timeout=timeout_s,
            auth_timeout=timeout_s,
            channel_timeout=timeout_s,
            allow_agent=True,
            # Without a key_file: the agent, then ~/.ssh/id_*, as ssh itself would.
            look_for_keys=key_file is None,
        )
    except (paramiko.BadHostKeyException, UnknownHostKey) as exc:
        client.close()
        raise refuse(refusal(exc, host, port, known_hosts)) from None
    except paramiko.PasswordRequiredException:
        client.close()
        raise fail(
            f"key_file {key_file} is encrypted; load it into ssh-agent and leave key_file unset"
        ) from None
    except paramiko.AuthenticationException:
        client.close()
        by = f"key_file {key_file}" if key_file else "the agent and ~/.ssh keys"
        raise fail(f"authentication failed with {by}") from None
    except (paramiko.SSHException, OSError, EOFError) as exc:
        client.close()
        raise fail(f"cannot connect: {str(exc) or type(exc).__name__}") from None
    transport = client.get_transport()
    if transport is not None:
        # Notices a dead connection while a long command is quiet.
        transport.set_keepalive(KEEPALIVE_S)
    return client
