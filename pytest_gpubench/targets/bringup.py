"""A node made ready for its cells, stage by stage: gpu_check, engine_install, model_pull; and a
cell's vram_check before its engine loads the model."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from pytest_gpubench.targets.gpu import NodeGpus, read_gpus
from pytest_gpubench.targets.protocol import Target
from pytest_gpubench.targets.stages import SetupStep, Stage, StageClock, StageError

if TYPE_CHECKING:
    from pytest_gpubench.config.nodes import ProviderNode, SshNode

DEFAULT_CHECK_TIMEOUT_S = 30.0
MIB = 1024 * 1024


class RunsSetup(Protocol):
    def run_setup(self, steps: Sequence[SetupStep], timeout_s: float) -> None: ...


class SetupTarget(Target, RunsSetup, Protocol):
    """A node that runs its setup commands: an ssh node, a rented one."""


def _plain_name(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def gpu_matches(gpu_type: str, name: str) -> bool:
    """`RTX 4090` matches `NVIDIA GeForce RTX 4090`; `H100` matches `NVIDIA H100 80GB HBM3`."""
    return _plain_name(gpu_type) in _plain_name(name)


def gpu_mismatch(
    node_id: str, gpus: NodeGpus, gpu_type: str | None, gpu_count: int | None
) -> str | None:
    """Why the node's GPUs are not the ones asked for, naming both; None when they are."""
    found = ", ".join(gpus.names) or "no GPU"
    if gpu_type is not None and (
        not gpus.names or not all(gpu_matches(gpu_type, name) for name in gpus.names)
    ):
        return f"node {node_id}: gpu_type is {gpu_type!r}, but nvidia-smi reports {found}"
    if gpu_count is not None and len(gpus.names) != gpu_count:
        return (
            f"node {node_id}: gpu_count is {gpu_count}, but nvidia-smi reports "
            f"{len(gpus.names)} ({found})"
        )
    return None


def check_gpus(
    target: Target,
    clock: StageClock,
    *,
    gpu_type: str | None,
    gpu_count: int | None,
    mode: Literal["auto", "required", "off"],
) -> None:
    """Stage gpu_check: nvidia-smi's GPU names and count against the node's gpu_type and
    gpu_count. `auto` passes a node without nvidia-smi (outcome `skipped`); `required` fails it."""
    if mode == "off" or (gpu_type is None and gpu_count is None):
        return
    with clock.stage("gpu_check", DEFAULT_CHECK_TIMEOUT_S) as limit:
        gpus = read_gpus(target, limit or DEFAULT_CHECK_TIMEOUT_S)
        if gpus is None:
            if mode == "required":
                raise StageError(
                    "gpu_check", f"node {clock.node_id}: nvidia-smi did not answer on the node"
                )
            clock.skip("gpu_check", "nvidia-smi did not answer: GPU not checked")
            return
        mismatch = gpu_mismatch(clock.node_id, gpus, gpu_type, gpu_count)
        if mismatch is not None:
            raise StageError("gpu_check", mismatch)


def run_setup_stages(
    node: RunsSetup,
    clock: StageClock,
    *,
    engine_install: Sequence[str],
    model_pull: Sequence[str],
    default_timeout_s: float,
) -> None:
    """Stages engine_install and model_pull: the node's commands, each stage within its own
    timeout (a stage_timeouts entry, else setup_timeout_s) and the node's budget."""
    stages: list[tuple[Stage, Sequence[str]]] = [
        ("engine_install", engine_install),
        ("model_pull", model_pull),
    ]
    for stage, commands in stages:
        if not commands:
            continue
        with clock.stage(stage, default_timeout_s) as limit:
            node.run_setup(
                [SetupStep(stage, command) for command in commands], limit or default_timeout_s
            )


def bring_up(target: SetupTarget, clock: StageClock, node: SshNode | ProviderNode) -> None:
    """The stages after the node is reached: gpu_check, then engine_install and model_pull,
    each from the node's keys."""
    check_gpus(target, clock, gpu_type=node.gpu_type, gpu_count=node.gpu_count, mode=node.gpu_check)
    run_setup_stages(
        target,
        clock,
        engine_install=node.setup,
        model_pull=node.model_pull,
        default_timeout_s=node.setup_timeout_s,
    )


def check_vram(
    target: Target,
    clock: StageClock,
    *,
    cell_id: str,
    model_bytes: float | None,
    where: str,
) -> None:
    """Stage vram_check: the model's size (`where` says where it came from) against the free
    memory nvidia-smi reports on the node's GPUs, before the engine loads it."""
    if model_bytes is None:
        return
    with clock.stage("vram_check", DEFAULT_CHECK_TIMEOUT_S, cell_id=cell_id) as limit:
        gpus = read_gpus(target, limit or DEFAULT_CHECK_TIMEOUT_S)
        if gpus is None:
            clock.skip("vram_check", "nvidia-smi did not answer: VRAM not checked", cell_id)
            return
        free_mib = sum(gpus.free_mib)
        if model_bytes / MIB > free_mib:
            raise StageError(
                "vram_check",
                f"cell {cell_id}: the model needs {model_bytes / 2**30:.2f} GiB ({where}), "
                f"but the node's GPUs have {free_mib / 1024:.2f} GiB free (nvidia-smi)",
            )
