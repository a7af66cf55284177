"""Where engines run: the `Target` protocol that local, SSH and rented nodes implement."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class BackgroundProcess(Protocol):
    """A long-running process on a node (a managed engine server)."""

    def alive(self) -> bool: ...

    def stop(self, timeout_s: float = 10.0) -> None: ...

    def log_tail(self, max_bytes: int = 4000) -> str: ...


class Target(Protocol):
    """A machine that engines run on, seen from the machine that runs pytest."""

    node_id: str

    def run(self, argv: Sequence[str], *, timeout_s: float) -> CommandResult:
        """Run a command to completion; arguments are never interpreted by a shell."""
        ...

    def start(self, argv: Sequence[str], *, log_path: str) -> BackgroundProcess:
        """Start a background process whose output goes to log_path on the node."""
        ...

    def free_port(self) -> int:
        """A TCP port that is free on the node's loopback interface."""
        ...

    def reach(self, host: str, port: int) -> tuple[str, int]:
        """An address on this machine that reaches host:port as the node sees it."""
        ...

    def read_file(self, path: str, *, timeout_s: float) -> bytes: ...

    def gpu_inventory(self) -> list[dict[str, str]]:
        """One entry per GPU from nvidia-smi; an empty list means the node has no GPU."""
        ...

    def describe(self) -> dict[str, Any]:
        """Facts about the node for the ledger's cell record (host, CPU model, price, ...)."""
        ...

    def close(self) -> None: ...


GPU_QUERY_FIELDS = (
    "name",
    "memory.total",
    "driver_version",
    "pci.bus_id",
    "compute_cap",
    "power.limit",
    "clocks.max.sm",
)


def nvidia_smi_argv() -> list[str]:
    return [
        "nvidia-smi",
        f"--query-gpu={','.join(GPU_QUERY_FIELDS)}",
        "--format=csv,noheader,nounits",
    ]


def parse_nvidia_smi(output: str) -> list[dict[str, str]]:
    """Parse `nvidia-smi --query-gpu=... --format=csv,noheader` output into one dict per GPU."""
    gpus = []
    for line in output.splitlines():
        if not line.strip():
            continue
        values = [value.strip() for value in line.split(",")]
        gpus.append(dict(zip(GPU_QUERY_FIELDS, values, strict=False)))
    return gpus


def gpu_inventory_of(target: Target, timeout_s: float = 20.0) -> list[dict[str, str]]:
    """Ask a node's nvidia-smi; a node without one (or without a GPU) has an empty inventory."""
    try:
        result = target.run(nvidia_smi_argv(), timeout_s=timeout_s)
    except FileNotFoundError:
        return []
    if not result.ok:
        return []
    return parse_nvidia_smi(result.stdout)


def gpu_summary(gpus: list[dict[str, str]]) -> str:
    """One line for people: `1 × NVIDIA H100 80GB HBM3 (81559 MiB)`, or `no GPU`."""
    if not gpus:
        return "no GPU"
    names: dict[str, int] = {}
    for gpu in gpus:
        memory = gpu.get("memory.total")
        name = str(gpu.get("name") or "GPU")
        label = f"{name} ({memory} MiB)" if memory else name
        names[label] = names.get(label, 0) + 1
    return ", ".join(f"{count} × {label}" for label, count in sorted(names.items()))


# INTERIM (replaced by the targets redraw): the factory with its final signature.
TargetHook = Callable[..., "Target | None"]


def open_target(
    node_id: str,
    node: Any,
    *,
    plugin_hook: TargetHook | None = None,
    on_rental_closed: Callable[[dict[str, Any]], None],
) -> Target:
    from pytest_gpubench.matrix import PluginNode
    from pytest_gpubench.targets.factory import open_target as open_builtin
    from pytest_gpubench.targets.stages import StageError

    if isinstance(node, PluginNode):
        target = plugin_hook(node_id=node_id, node=node) if plugin_hook is not None else None
        if target is None:
            raise StageError("provision", f"node {node_id}: no plugin opened its kind {node.kind}")
        return target
    try:
        opened = open_builtin(node_id, node)
    except Exception as exc:
        released = getattr(exc, "released_target", None)
        if released is not None:
            _report_rental(node_id, released, on_rental_closed)
        raise
    if hasattr(opened, "done_marked"):
        close = opened.close

        def close_and_report() -> None:
            try:
                close()
            finally:
                _report_rental(node_id, opened, on_rental_closed)

        opened.close = close_and_report  # type: ignore[method-assign]
    return opened


def _report_rental(node_id: str, target: Any, report: Callable[[dict[str, Any]], None]) -> None:
    facts = target.describe()
    if facts.get("session_id") is None:
        return
    report(
        {
            "node": node_id,
            "kind": "provider",
            "session_id": facts.get("session_id"),
            "offer_id": facts.get("offer_id"),
            "gpu_name": facts.get("gpu_name"),
            "price_per_hour": facts.get("price_per_hour"),
            "elapsed_s": facts.get("elapsed_s"),
            "cost": facts.get("cost"),
            "session_done": target.done_marked,
        }
    )
