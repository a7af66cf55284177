"""A node's GPUs: the nvidia-smi query, its parser (the one reader of a node's GPUs: the
inventory in the ledger, the free memory of gpu_check and vram_check) and the one-line summary
for people."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pytest_gpubench.targets.protocol import Target

GPU_QUERY_FIELDS = (
    "name",
    "memory.total",
    "driver_version",
    "pci.bus_id",
    "compute_cap",
    "power.limit",
    "clocks.max.sm",
)
# What gpu_check and vram_check need: names and free memory, read just before they decide.
FREE_MEMORY_FIELDS = ("name", "memory.total", "memory.free")


def nvidia_smi_argv(fields: Sequence[str] = GPU_QUERY_FIELDS) -> list[str]:
    """nvidia-smi's documented query (`nvidia-smi --help-query-gpu`): one CSV line per GPU."""
    return ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]


def parse_nvidia_smi(output: str, fields: Sequence[str] = GPU_QUERY_FIELDS) -> list[dict[str, str]]:
    """Parse `nvidia-smi --query-gpu=... --format=csv,noheader` output into one dict per GPU;
    a line without one value per field (a message, not a GPU) is no GPU."""
    gpus = []
    for line in output.splitlines():
        values = [value.strip() for value in line.split(",")]
        if len(values) == len(fields):
            gpus.append(dict(zip(fields, values, strict=True)))
    return gpus


def query_gpus(
    target: Target, fields: Sequence[str] = GPU_QUERY_FIELDS, timeout_s: float = 20.0
) -> list[dict[str, str]] | None:
    """Ask a node's nvidia-smi for `fields` of each GPU, on any target (a local, SSH or rented
    node, a Slurm job's node); None when the node has no nvidia-smi that answers."""
    try:
        result = target.run(nvidia_smi_argv(fields), timeout_s=timeout_s)
    except FileNotFoundError:
        return None
    if not result.ok:
        return None
    return parse_nvidia_smi(result.stdout, fields)


def gpu_inventory_of(target: Target, timeout_s: float = 20.0) -> list[dict[str, str]]:
    """A node's GPUs for the ledger; a node without nvidia-smi (or a GPU) has an empty one."""
    return query_gpus(target, GPU_QUERY_FIELDS, timeout_s) or []


@dataclass(frozen=True)
class NodeGpus:
    """What nvidia-smi says of a node's GPUs: names and free memory in MiB."""

    names: tuple[str, ...]
    free_mib: tuple[float, ...]


def read_gpus(target: Target, timeout_s: float) -> NodeGpus | None:
    """The node's GPUs with their free memory now; None when it has no nvidia-smi that answers."""
    gpus = query_gpus(target, FREE_MEMORY_FIELDS, timeout_s)
    if gpus is None:
        return None
    return NodeGpus(
        tuple(gpu["name"] for gpu in gpus), tuple(_mib(gpu["memory.free"]) for gpu in gpus)
    )


def _mib(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0  # `[N/A]`: nothing known free


def gpu_summary(gpus: Sequence[Any]) -> str:
    """One line for people: `1 × NVIDIA H100 80GB HBM3 (81559 MiB)`, or `no GPU`. An entry is
    an inventory's dict or, in an older ledger or baseline, a GPU's name."""
    if not gpus:
        return "no GPU"
    names: dict[str, int] = {}
    for entry in gpus:
        gpu = entry if isinstance(entry, dict) else {"name": entry}
        memory = gpu.get("memory.total")
        name = str(gpu.get("name") or "GPU")
        label = f"{name} ({memory} MiB)" if memory else name
        names[label] = names.get(label, 0) + 1
    return ", ".join(f"{count} × {label}" for label, count in sorted(names.items()))
