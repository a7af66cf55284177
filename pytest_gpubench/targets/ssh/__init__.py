"""SSH nodes: the target (target.py), how it connects, its port forwards, host keys, scripts."""

from pytest_gpubench.targets.ssh.target import SshTarget

__all__ = ["SshTarget"]
