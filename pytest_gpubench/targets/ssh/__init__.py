"""SSH nodes: the target (target.py), its port forwards, host-key policies and remote scripts."""

from pytest_gpubench.targets.ssh.target import SshTarget

__all__ = ["SshTarget"]
