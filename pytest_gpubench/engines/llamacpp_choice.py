"""Which llama.cpp server a managed cell on this machine runs, and why: a llama-server someone
named, the prebuilt server (xllamacpp's wheel, through the launcher) where this machine runs it,
or the one built from source (forced, or where the wheel cannot run)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pytest_gpubench.engines.llamacpp_build import (
    BINARY_ENV,
    BINARY_NAME,
    LLAMA_CPP_PYTHON_VERSION,
    Progress,
    build_llama_server,
    cached_binary_path,
    named_binary,
)
from pytest_gpubench.engines.llamacpp_prebuilt import (
    BUILD_ENV,
    XLLAMACPP_VERSION,
    MachineFacts,
    build_forced,
    install_prebuilt,
    installed_version,
    launcher_command,
    prebuilt_engine_version,
    prebuilt_reason,
    prebuilt_refusal,
)

Kind = Literal["named", "prebuilt", "built"]


@dataclass(frozen=True)
class LlamaServerChoice:
    """The server a managed llama.cpp cell runs: the argv before its flags (a binary, or the
    launcher), what kind it is and why it was chosen, and the engine version to record where
    the server's own is not enough (the prebuilt one answers `b0-unknown`)."""

    kind: Kind
    reason: str
    command: tuple[str, ...] = ()
    engine_version: str | None = None

    @property
    def maps_flags(self) -> bool:
        """True where the cell's server_args go through the launcher's map (engines/
        llamacpp_launcher.py), which refuses a flag it does not know."""
        return self.kind == "prebuilt"

    def describe(self) -> str:
        """One line: what runs and why (gpubench install-server prints it)."""
        if self.kind == "prebuilt":
            return f"llama.cpp server: prebuilt {prebuilt_engine_version()}: {self.reason}"
        if self.kind == "built":
            return (
                f"llama.cpp server: llama-server built from source (llama-cpp-python "
                f"{LLAMA_CPP_PYTHON_VERSION}): {self.reason}"
            )
        return f"llama.cpp server: {self.command[0]}: {self.reason}"


def choose_llama_server(
    explicit: str | None,
    *,
    environ: Mapping[str, str] | None = None,
    machine: MachineFacts | None = None,
) -> LlamaServerChoice:
    """The choice, without installing or building anything (the command of a server still to
    be installed or built is left empty). In order: the cell's `server_binary`,
    `$GPUBENCH_LLAMA_SERVER`, `$GPUBENCH_LLAMA_SERVER_BUILD` (the source build), a llama-server
    on PATH, the prebuilt server where this machine runs its wheel, the source build."""
    env = os.environ if environ is None else environ
    if explicit:
        binary = named_binary(explicit, "server_binary")
        return LlamaServerChoice("named", "the cell's server_binary", (str(binary),))
    from_env = env.get(BINARY_ENV, "").strip()
    if from_env:
        binary = named_binary(from_env, BINARY_ENV)
        return LlamaServerChoice("named", f"${BINARY_ENV}", (str(binary),))
    forced = build_forced(env)
    if forced is not None:
        return _built(f"{forced} forces the source build")
    on_path = shutil.which(BINARY_NAME)
    if on_path:
        return LlamaServerChoice("named", f"{BINARY_NAME} on PATH", (on_path,))
    facts = machine or MachineFacts.of_this_machine()
    refusal = prebuilt_refusal(facts)
    if refusal is not None:
        return _built(refusal)
    return LlamaServerChoice(
        "prebuilt",
        f"{prebuilt_reason(facts)}; {BUILD_ENV}=1 builds llama-server from source instead",
        tuple(launcher_command()),
        prebuilt_engine_version(),
    )


def _built(reason: str) -> LlamaServerChoice:
    cached = cached_binary_path()
    command = (str(cached),) if cached.is_file() else ()
    return LlamaServerChoice("built", reason, command)


def ensure_llama_server_choice(
    explicit: str | None = None, *, progress: Progress | None = None, check: bool = False
) -> LlamaServerChoice:
    """The choice with its server in place (ensure_installed)."""
    return ensure_installed(choose_llama_server(explicit), progress=progress, check=check)


def ensure_installed(
    choice: LlamaServerChoice, *, progress: Progress | None = None, check: bool = False
) -> LlamaServerChoice:
    """The choice with its server in place: the prebuilt wheel installed into the cache (and,
    with `check`, started once), or llama-server built (a cached build that answers is reused);
    a named one as it is."""
    if choice.kind == "prebuilt":
        directory = install_prebuilt(progress=progress, check=check)
        version = installed_version(directory) or XLLAMACPP_VERSION
        return dataclasses.replace(choice, engine_version=prebuilt_engine_version(version))
    if choice.kind == "built":
        binary: Path = build_llama_server(progress=progress)
        return LlamaServerChoice("built", choice.reason, (str(binary),))
    return choice
