"""The rules a cell of cells.yaml follows beyond its keys' types: an A/B pair comparable call for
call, endpoint keys only where the harness does not launch the engine, request keys the engine
can send, a load profile the engine can serve. Each broken rule is one line naming the cell."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from pytest_gpubench.config.cell import Cell, CellSpec
from pytest_gpubench.config.engine_kinds import BUILT_IN, engine_kind
from pytest_gpubench.config.load_profile import TUNNEL, LoadProfile
from pytest_gpubench.config.nodes import AnyNode
from pytest_gpubench.config.prompts import Prompt, RequestShape
from pytest_gpubench.core.errors import GpubenchError

# Engines the harness knows how to launch itself when a cell has no endpoint.
MANAGED_ENGINE_KINDS = tuple(name for name, kind in BUILT_IN.items() if kind.managed)


def check_references(cells_path: Path, cells: Sequence[Cell]) -> None:
    """An A/B candidate's `reference:` names another cell, on the same node, that is measured
    the same way (warm, the same runs, the candidate's prompts) and is no candidate itself."""
    by_id = {cell.cell_id: cell for cell in cells}
    for cell in cells:
        spec = cell.spec
        where = f"{cells_path}: cells[{cell.index}] ({cell.cell_id})"
        if spec.reference is None:
            if spec.min_runs is not None and spec.min_runs > cell.runs:
                raise GpubenchError(
                    f"{where}: min_runs: {spec.min_runs} is more than runs ({cell.runs})"
                )
            continue
        reference = by_id.get(spec.reference)
        if reference is None:
            raise GpubenchError(
                f"{where}: reference: '{spec.reference}' is not a cell of this file "
                f"(cells: {', '.join(by_id)})"
            )
        if reference is cell:
            raise GpubenchError(f"{where}: reference: a cell cannot be its own reference")
        if reference.reference is not None:
            raise GpubenchError(
                f"{where}: reference: '{reference.cell_id}' has a reference of its own "
                f"('{reference.reference}'); chains are not supported: name "
                f"'{reference.reference}' here"
            )
        _check_pair(where, cell, reference)


def _check_pair(where: str, cell: Cell, reference: Cell) -> None:
    """What makes an A/B pair's calls comparable one for one, each broken rule in one line."""
    ref = f"its reference '{reference.cell_id}'"
    if reference.spec.node != cell.spec.node:
        raise GpubenchError(
            f"{where}: reference: {ref} runs on node '{reference.spec.node}', this cell on "
            f"'{cell.spec.node}'; an A/B pair shares one node, so that the machine's drift "
            "hits both sides"
        )
    for side, other in ((cell, "this cell"), (reference, ref)):
        if "warm" not in side.spec.phases:
            raise GpubenchError(f"{where}: reference: {other} has no warm phase to pair")
        if side.spec.duration_s is not None:
            raise GpubenchError(
                f"{where}: reference: {other} has a timed warm phase (duration_s); an A/B pair "
                "counts its calls in runs"
            )
        if side.spec.skip or side.spec.optional:
            key = "skip" if side.spec.skip else "optional"
            raise GpubenchError(
                f"{where}: reference: {other} is {key}: an A/B verdict needs both sides measured"
            )
    if reference.runs != cell.runs:
        raise GpubenchError(
            f"{where}: runs: {cell.runs}, but {ref} has {reference.runs}; a pair measures both "
            "sides the same number of times"
        )
    for prompt_id in cell.prompt_ids:
        if prompt_id not in reference.prompt_ids:
            raise GpubenchError(f"{where}: prompts: '{prompt_id}' is not measured by {ref}")
    if cell.adapters != reference.adapters:
        raise GpubenchError(
            f"{where}: lora: this cell chooses the adapters [{', '.join(cell.adapters)}] per "
            f"request, {ref} [{', '.join(reference.adapters)}]; an A/B pair measures each "
            "adapter's prompts on both sides (the same names, in the same order)"
        )
    if cell.spec.min_runs is not None and cell.spec.min_runs > cell.runs:
        raise GpubenchError(
            f"{where}: min_runs: {cell.spec.min_runs} is more than runs ({cell.runs})"
        )


def check_endpoint_keys(where: str, spec: CellSpec) -> None:
    """One way to reach the engine: an endpoint, a port on the node, or a launch; and a managed
    engine of a kind the harness can start."""
    if spec.endpoint is not None:
        for key in ("port", "launch", "launch_env", "health_path", "ready_timeout_s", "cold"):
            if getattr(spec, key):
                raise GpubenchError(
                    f"{where}: {key}: only for an engine on the node (port:) or one the "
                    "harness launches; this cell has an endpoint"
                )
    if not spec.managed:
        for key in ("launch_env", "health_path", "ready_timeout_s", "cold"):
            if getattr(spec, key):
                raise GpubenchError(
                    f"{where}: {key}: only for a managed engine (give the cell a launch:)"
                )
        return
    kind = engine_kind(spec.engine)
    if not kind.managed:
        raise GpubenchError(
            f"{where}: endpoint: required for engine '{spec.engine}' "
            f"(the harness can only launch {', '.join(MANAGED_ENGINE_KINDS)} itself)"
        )
    if kind.launch_required is not None and spec.launch is None:
        raise GpubenchError(f"{where}: launch: {kind.launch_required}")


def check_request_keys(
    where: str,
    spec: CellSpec,
    prompts: dict[str, Prompt],
    prompt_ids: Sequence[str],
    prompts_path: Path,
) -> None:
    """Request keys the cell's engine cannot send, and TLS keys on a plain endpoint: one line."""
    unsupported = engine_kind(spec.engine).refused_request_keys
    sources: list[tuple[str, RequestShape | None]] = [(where, spec.request)]
    sources += [(f"{prompts_path}: prompts.{pid}", prompts[pid].request) for pid in prompt_ids]
    for source, shape in sources:
        for key in shape.model_dump(exclude_none=True) if shape is not None else {}:
            if key in unsupported:
                suffix = f" (cell {spec.cell_id})" if source != where else ""
                raise GpubenchError(f"{source}: request.{key}: {unsupported[key]}{suffix}")
    plain = spec.endpoint is None or spec.endpoint.scheme != "https"
    if plain and (spec.ca_file is not None or not spec.tls_verify):
        key = "ca_file" if spec.ca_file is not None else "tls_verify"
        raise GpubenchError(f"{where}: {key}: only applies to an https:// endpoint")


# The engine kinds a load case can drive: those that speak OpenAI's streamed chat completions.
LOAD_ENGINE_KINDS = tuple(name for name, kind in BUILT_IN.items() if kind.drives_load)


def check_draft(where: str, spec: CellSpec) -> None:
    """draft_model, draft_max and lora only on a managed llamacpp cell whose argv the plugin
    writes."""
    if spec.draft_model is None and spec.draft_max is not None:
        raise GpubenchError(f"{where}: draft_max: needs a draft_model")
    if isinstance(spec.lora, list) and not engine_kind(spec.engine).adapters_by_name:
        raise GpubenchError(
            f"{where}: lora: a list names the adapters an OpenAI-compatible server serves "
            "(engine: openai); a managed llamacpp cell names each adapter's file: "
            "lora: {name: path}"
        )
    if isinstance(spec.lora, list):
        return _managed_llamacpp_key(where, spec, "draft_model")
    for key in ("draft_model", "lora"):
        _managed_llamacpp_key(where, spec, key)


def _managed_llamacpp_key(where: str, spec: CellSpec, key: str) -> None:
    if getattr(spec, key) is None:
        return
    flag = "--model-draft" if key == "draft_model" else "--lora"
    kind = engine_kind(spec.engine)
    if key == "lora" and isinstance(spec.lora, dict) and kind.adapters_by_name:
        raise GpubenchError(
            f"{where}: lora: an openai cell lists the names the server serves its adapters "
            "under (lora: [name, ...]; vLLM's --lora-modules name=path, set where it is started)"
        )
    if not (spec.managed and kind.server_flags):
        raise GpubenchError(
            f"{where}: {key}: only a managed llamacpp cell (no endpoint) takes it; an external "
            f"server's is set where it is started ({flag})"
        )
    if spec.launch is not None:
        raise GpubenchError(
            f"{where}: {key}: the cell's launch: replaces the argv; put {flag} there"
        )


def check_load(
    where: str,
    spec: CellSpec,
    load: LoadProfile | None,
    prompts: dict[str, Prompt],
    prompts_path: Path,
    nodes: Mapping[str, AnyNode] | None = None,
) -> None:
    """A load profile that cannot run, and `parallel` where no managed server takes it: one line."""
    kind = engine_kind(spec.engine)
    if spec.parallel is not None and not (spec.managed and kind.server_flags):
        raise GpubenchError(
            f"{where}: parallel: only a managed llamacpp cell (no endpoint) takes it; an "
            "external server's slots are set where it is started"
        )
    if spec.parallel is not None and spec.launch is not None:
        raise GpubenchError(
            f"{where}: parallel: the cell's launch: replaces the argv; put --parallel there"
        )
    check_draft(where, spec)
    if load is None:
        return
    if not kind.drives_load:
        raise GpubenchError(
            f"{where}: load: engine '{spec.engine}' cannot be load-tested yet (load cases drive "
            f"{', '.join(LOAD_ENGINE_KINDS)})"
        )
    if not load.bounded:
        raise GpubenchError(
            f"{where}: load: needs duration_s or requests (or both) to bound each load point"
        )
    for prompt_id in load.prompts or ():
        if prompt_id not in prompts:
            raise GpubenchError(
                f"{where}: load.prompts: '{prompt_id}' is not defined in {prompts_path}"
            )
    if load.clients is not None:
        node = nodes.get(load.clients.node) if nodes is not None else None
        if node is None or not node.runs_client_tasks:
            raise GpubenchError(
                f"{where}: load.clients.node: '{load.clients.node}' is not an ssh node or a "
                "Slurm node of cells.yaml (kind: ssh, or kind: slurm)"
            )
        if node.no_client_tunnel is not None and load.clients.coordinator == TUNNEL:
            why = node.no_client_tunnel.format(node=load.clients.node)
            raise GpubenchError(
                f"{where}: load.clients.coordinator: tunnel is for an ssh node (a remote port "
                f"forward over its SSH connection); {why}"
            )
    sources = [key for key in ("prompts", "synthetic", "dataset", "trace") if getattr(load, key)]
    if len(sources) > 1:
        raise GpubenchError(
            f"{where}: load: give one of prompts, synthetic, dataset (got {', '.join(sources)})"
        )
    check_load_adapters(where, spec, load)


def check_load_adapters(where: str, spec: CellSpec, load: LoadProfile) -> None:
    """lora_choice and lora_weights on a cell that chooses adapters per request, weights for
    each of its adapters; no adapter per request in a multi-turn session yet."""
    adapters = [] if spec.lora is None or isinstance(spec.lora, str) else list(spec.lora)
    own = spec.load_setting
    asked = {"lora_choice", "lora_weights"} & (
        own.model_fields_set if isinstance(own, LoadProfile) else set()
    )
    if not adapters:
        if asked:
            raise GpubenchError(
                f"{where}: load.{sorted(asked)[0]}: the cell chooses no LoRA adapter per request "
                "(lora: a list of names, or name: path)"
            )
        return
    if load.turns is not None:
        raise GpubenchError(
            f"{where}: load.turns: a multi-turn session names no LoRA adapter per request yet; "
            "drop turns: or give the cell one adapter"
        )
    weights = load.lora_weights
    if weights is not None and set(weights) != set(adapters):
        unknown = sorted(set(weights) - set(adapters))
        missing = sorted(set(adapters) - set(weights))
        said = (
            f"'{unknown[0]}' is not an adapter of the cell"
            if unknown
            else (f"no weight for adapter '{missing[0]}'")
        )
        raise GpubenchError(f"{where}: load.lora_weights: {said} (adapters: {', '.join(adapters)})")
