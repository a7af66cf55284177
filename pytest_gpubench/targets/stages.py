"""The stages of bringing up a remote node and benchmarking on it; a failure names its stage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pytest_gpubench.errors import GpubenchError

Stage = Literal[
    "provision",
    "ssh_wait",
    "ssh_connect",
    "engine_install",
    "model_pull",
    "queue",
    "benchmark",
    "results",
]


class StageError(GpubenchError):
    """A remote node failed in one stage; `stage` says which, the message says why."""

    def __init__(self, stage: Stage, message: str) -> None:
        super().__init__(f"[{stage}] {message}")
        self.stage: Stage = stage
        self.message = message

    def __reduce__(self) -> tuple[type[StageError], tuple[Stage, str]]:
        # xdist and multiprocessing pickle exceptions; the default would call __init__ with the
        # formatted text as the only argument.
        return type(self), (self.stage, self.message)


@dataclass(frozen=True)
class SetupStep:
    """One shell command of a node's setup (install the engine, pull a model), run with sh -c."""

    stage: Stage
    command: str

    def label(self) -> str:
        """How errors name the step: its program only, since arguments may carry tokens."""
        words = self.command.split()
        return words[0] if words else "(empty)"


def setup_steps(engine_install: Sequence[str], model_pull: Sequence[str]) -> list[SetupStep]:
    """A node's `setup` and `model_pull` commands, in that order, each under its own stage."""
    return [SetupStep("engine_install", command) for command in engine_install] + [
        SetupStep("model_pull", command) for command in model_pull
    ]
