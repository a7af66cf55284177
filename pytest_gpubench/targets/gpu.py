"""A node's GPUs: the nvidia-smi query, its parser and the one-line summary for people."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_gpubench.targets import Target

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


def gpu_summary(gpus: Sequence[Mapping[str, Any]]) -> str:
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
