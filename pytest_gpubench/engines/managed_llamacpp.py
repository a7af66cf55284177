"""Managed llama.cpp: the llama-server argv, its binary and GGUF on this machine or a node."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from pytest_gpubench.config.cell import TINY_MODEL, Cell
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.files import file_sha256
from pytest_gpubench.engines.launch_plan import LaunchPlan, node_file_digest
from pytest_gpubench.targets import Target, on_this_machine

log = logging.getLogger(__name__)


def llama_server_launch(
    binary: str | Sequence[str],
    extra_args: Sequence[str] = (),
    *,
    parallel: int = 1,
    metrics: bool = False,
) -> list[str]:
    """The launch template of a llama-server serving `{model_path}` as `{model}`, with
    `parallel` slots (the cell's `parallel`) and /metrics where a load case scrapes it.
    `binary` is its path, or the argv before its flags (the prebuilt server's launcher)."""
    return [
        *([binary] if isinstance(binary, str) else binary),
        "--model", "{model_path}",
        "--alias", "{model}",
        "--host", "{host}",
        "--port", "{port}",
        "--parallel", str(parallel),
        "--no-webui",
        *(["--metrics"] if metrics else []),
        *extra_args,
    ]  # fmt: skip


EMBEDDINGS_FLAGS = ("--embedding", "--embeddings")
RERANK_FLAGS = ("--rerank", "--reranking")


def _pooling(argv: Sequence[str]) -> str | None:
    """The pooling a llama-server argv asks for (`--pooling X`), or None."""
    words = list(argv)
    for index, word in enumerate(words[:-1]):
        if word == "--pooling":
            return words[index + 1]
    return None


def kind_args(kinds: Sequence[str], server_args: Sequence[str]) -> list[str]:
    """The flags a managed llama-server needs for the request kinds of its cell's prompts, where
    server_args does not set them already (a cell's `launch:` is used as written):
    - every prompt an embedding: `--embeddings --pooling mean` (a generative model's GGUF names no
      pooling, and /v1/embeddings needs one: the mean of its token vectors);
    - every prompt a rerank: `--embeddings --pooling rank` (what llama-server's `--rerank` sets,
      and a flag the prebuilt server's launcher maps);
    - a prompt of kind tools: `--jinja` (the default of recent servers, written for older ones).
    A cell that mixes embeddings or reranks with other kinds gets neither: llama-server's help
    keeps --embeddings for dedicated embedding models, so a generating prompt is not measured on
    such a server by default; those cases are skipped (kind_missing), and a cell whose
    server_args ask for it measures them all."""
    args: list[str] = []
    chosen = set(EMBEDDINGS_FLAGS + RERANK_FLAGS) & set(server_args)
    if set(kinds) in ({"embedding"}, {"rerank"}) and not chosen:
        args.append("--embeddings")
        if _pooling(server_args) is None:
            args += ["--pooling", "mean" if set(kinds) == {"embedding"} else "rank"]
    if "tools" in kinds and not {"--jinja", "--no-jinja"} & set(server_args):
        args.append("--jinja")
    return args


def kind_missing(kind: str, argv: Sequence[str]) -> str | None:
    """Why a llama-server started with `argv` cannot serve a request of `kind`, or None."""
    rerank = bool(set(RERANK_FLAGS) & set(argv)) or _pooling(argv) == "rank"
    embeddings = bool(set(EMBEDDINGS_FLAGS + RERANK_FLAGS) & set(argv))
    if kind == "embedding" and (not embeddings or rerank):
        return (
            "llama-server serves embeddings only when started with --embeddings (and a pooling "
            "other than rank), which its help keeps for embedding models: give embedding prompts "
            "a cell of their own (its prompts: key), or set the flags in its server_args"
        )
    if kind == "rerank" and not rerank:
        return (
            "llama-server ranks documents only when started with --rerank (or --embeddings "
            "--pooling rank): give rerank prompts a cell of their own (its prompts: key), or set "
            "the flags in its server_args"
        )
    if kind == "image" and not {"-mm", "--mmproj"} & set(argv):
        return (
            "llama-server reads images only with a multimodal projector: set --mmproj (the "
            "model's projector GGUF) in the cell's server_args"
        )
    if kind == "tools" and "--no-jinja" in argv:
        return "llama-server started with --no-jinja takes no tools (--jinja)"
    return None


def llamacpp_plan(cell: Cell, target: Target, log_dir: Path) -> LaunchPlan:
    """On this machine the server is chosen (engines/llamacpp_choice.py: one named, the
    prebuilt one, or the source build), installed or built where needed, and the model is the
    cell's GGUF (or the tiny model); on a remote node both are paths there, put in place by the
    node's setup. A cell's `launch:` replaces the argv (its `{model_path}` is still the cell's
    model_path)."""
    spec = cell.spec
    command: Sequence[str] = [spec.server_binary or ""]
    engine_version: str | None = None
    # Paths of this (the submit) host that a remote node sees too (a shared filesystem).
    shared: dict[str, str] = {}
    local = on_this_machine(target)
    # The draft model and LoRA adapter's flags, after the cell's own server_args.
    added = [*draft_args(cell, local=local), *lora_args(cell, local=local)]
    if local:
        model_path = str(_local_model(cell))
        if spec.launch is None:
            command, engine_version = _local_server(cell, added)
    else:
        model_path = spec.model_path or ""
        if not model_path:
            model_path = _shared_path(cell, target, "model_path", _submit_host_model(cell))
            shared["model_path"] = model_path
        if spec.launch is None and not spec.server_binary:
            binary = _shared_path(cell, target, "server_binary", _submit_host_binary())
            shared["server_binary"] = binary
            command = [binary]
    digest = node_file_digest(cell, target, model_path)
    if digest is None:
        raise GpubenchError(
            f"cell {cell.cell_id}: model_path: cannot read {model_path} on the node"
        )
    digest += added_digests(cell, target, added)
    # /metrics always: the engine's counters are read around every warm call (issue 35).
    launch = spec.launch or llama_server_launch(
        command,
        [*spec.server_args, *added, *kind_args(cell.kinds, spec.server_args)],
        parallel=spec.parallel or 1,
        metrics=True,
    )
    return LaunchPlan(
        launch=tuple(launch),
        health_path="/health",
        program="llama-server",
        values={"model": spec.model, "model_path": model_path},
        model_digest=digest,
        shared_paths=shared,
        engine_version=engine_version,
        kind_missing=partial(kind_missing, argv=tuple(launch)),
    )


def added_digests(cell: Cell, target: Target, added: Sequence[str]) -> str:
    """The draft model's and the LoRA adapter's digests, after the model's in the cell's
    model_digest (`sha256:<model>+draft:sha256:<draft>+lora:sha256:<adapter>`): another draft
    model or adapter is another setup, and a baseline measured with the old one is not compared
    with it."""
    found = ""
    words = {"--model-draft": ("draft", "draft_model"), "--lora": ("lora", "lora")}
    for at, flag in enumerate(added):
        if flag not in words:
            continue
        word, key = words[flag]
        path = added[at + 1]
        digest = node_file_digest(cell, target, path)
        if digest is None:
            raise GpubenchError(f"cell {cell.cell_id}: {key}: cannot read {path} on the node")
        found += f"+{word}:{digest}"
    return found


def draft_args(cell: Cell, *, local: bool) -> list[str]:
    """llama-server's flags for the cell's draft model (speculative decoding): the model
    (`tiny`: the generated tiny model, drafting for itself), the draft-model speculation and the
    most tokens drafted at a time. A remote node's path is the node's."""
    spec = cell.spec
    if spec.draft_model is None:
        return []
    path = spec.draft_model
    if spec.draft_model == TINY_MODEL and local:
        from pytest_gpubench.engines.tinymodel import ensure_tiny_model

        path = str(ensure_tiny_model())
    elif local and not Path(path).expanduser().is_file():
        raise GpubenchError(f"cell {cell.cell_id}: draft_model: {path} does not exist")
    elif local:
        path = str(Path(path).expanduser())
    args = ["--model-draft", path, "--spec-type", "draft-simple"]
    if spec.draft_max is not None:
        args += ["--spec-draft-n-max", str(spec.draft_max)]
    return args


def lora_args(cell: Cell, *, local: bool) -> list[str]:
    """llama-server's flags for the cell's LoRA adapters: one applied to every request, or
    several (`lora: {name: adapter}`) loaded in their order without being applied
    (`--lora-init-without-apply`), each request naming its own by id in its `lora` field. An
    adapter is a GGUF path (a remote node's own), or `tiny-lora-<seed>`, generated for the tiny
    model here."""
    lora = cell.spec.lora
    if lora is None or isinstance(lora, list):
        return []
    if isinstance(lora, str):
        return ["--lora", _adapter_path(cell, "lora", lora, local=local)]
    args = [
        arg
        for name, adapter in lora.items()
        for arg in ("--lora", _adapter_path(cell, f"lora.{name}", adapter, local=local))
    ]
    return [*args, "--lora-init-without-apply"]


def _adapter_path(cell: Cell, key: str, adapter: str, *, local: bool) -> str:
    from pytest_gpubench.engines.tinymodel import ensure_tiny_lora, tiny_lora_seed

    seed = tiny_lora_seed(adapter)
    if seed is not None and local:
        return str(ensure_tiny_lora(seed))
    path = Path(adapter).expanduser()
    if local and not path.is_file():
        raise GpubenchError(f"cell {cell.cell_id}: {key}: {adapter} does not exist")
    return str(path) if local else adapter


def _local_server(cell: Cell, added: Sequence[str] = ()) -> tuple[list[str], str | None]:
    """The argv before the flags of the server this machine runs for the cell
    (engines/llamacpp_choice.py), installed or built where needed, and the engine version to
    record where the server's own does not tell it apart (the prebuilt one's). The prebuilt
    server's launcher maps llama-server's flags: one it does not map fails here, as one line."""
    from pytest_gpubench.engines.llamacpp_choice import ensure_llama_server_choice

    choice = ensure_llama_server_choice(cell.spec.server_binary)
    if choice.maps_flags:
        from pytest_gpubench.engines.llamacpp_launcher import (
            LauncherFlagError,
            parse_server_args,
        )

        try:
            parse_server_args(cell.spec.server_args)
        except LauncherFlagError as exc:
            raise GpubenchError(f"cell {cell.cell_id}: server_args: {exc}") from None
        if added:
            key = "draft_model" if cell.spec.draft_model is not None else "lora"
            raise GpubenchError(
                f"cell {cell.cell_id}: {key}: the prebuilt llama-server takes no draft model or "
                "LoRA adapter; name a llama-server build (server_binary, $GPUBENCH_LLAMA_SERVER)"
            )
    return list(choice.command), choice.engine_version


def _submit_host_binary() -> Path | None:
    """The llama-server this host would run (found, never built here for another node)."""
    from pytest_gpubench.engines.llamacpp_build import find_llama_server

    try:
        return find_llama_server(None)
    except GpubenchError:
        return None


def _submit_host_model(cell: Cell) -> Path | None:
    """The GGUF this host would serve: the generated tiny model for `model: tiny`."""
    if cell.spec.model != TINY_MODEL:
        return None
    from pytest_gpubench.engines.tinymodel import ensure_tiny_model

    return ensure_tiny_model()


def _shared_path(cell: Cell, target: Target, key: str, local: Path | None) -> str:
    """A key the cell left out on a remote node: the submit host's file, where the node sees
    the same file at the same path (a shared filesystem, the common case on a cluster: checked
    by sha256); otherwise one line saying why it is needed."""
    need = (
        f"cell {cell.cell_id}: {key}: not set, and a managed llamacpp cell on a remote node "
        f"needs it (a path on the node; install it with setup)"
    )
    if local is None or not local.is_file():
        raise GpubenchError(f"{need}; this host has none to share")
    path = str(local.resolve())
    seen = node_file_digest(cell, target, path)
    if seen != f"sha256:{file_sha256(local)}":
        how = "does not see it" if seen is None else "holds another file there"
        raise GpubenchError(f"{need}; this host's {path} is not shared: the node {how}")
    log.warning(
        "cell %s: %s not set: using this host's %s, which the node sees too (same sha256)",
        cell.cell_id,
        key,
        path,
    )
    return path


def _local_model(cell: Cell) -> Path:
    spec = cell.spec
    if spec.model_path:
        model = Path(spec.model_path).expanduser()
        if not model.is_file():
            raise GpubenchError(f"cell {cell.cell_id}: model_path: {model} does not exist")
        return model
    if spec.model == TINY_MODEL:
        from pytest_gpubench.engines.tinymodel import ensure_tiny_model

        return ensure_tiny_model()
    raise GpubenchError(
        f"cell {cell.cell_id}: model_path: a managed llamacpp cell needs a GGUF "
        f"file (or model: {TINY_MODEL} for the generated tiny model)"
    )
