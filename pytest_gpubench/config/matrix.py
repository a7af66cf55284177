"""The cell matrix: cells.yaml read, its cells (config/cell.py) checked against its nodes
(config/nodes.py), the rules beyond their keys' types (config/cell_rules.py) and the frozen
prompts (config/prompts.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pytest_gpubench.config.cell import Cell, CellDefaults, CellSpec, Thresholds, cell_id_of
from pytest_gpubench.config.cell_rules import (
    check_endpoint_keys,
    check_load,
    check_references,
    check_request_keys,
)
from pytest_gpubench.config.datasets import dataset_sha256, sample_dataset
from pytest_gpubench.config.load_profile import LoadProfile, merged_profile
from pytest_gpubench.config.nodes import NODE_KINDS, AnyNode, LocalNode, Node
from pytest_gpubench.config.prompts import Prompt, RequestShape, read_prompt_file
from pytest_gpubench.config.traces import read_trace
from pytest_gpubench.config.yaml_file import one_line_errors, read_yaml_mapping
from pytest_gpubench.core.errors import GpubenchError, shown_key


class _CellsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    settings: CellDefaults = CellDefaults()
    # `local` (this machine) needs no entry: a local-only file may leave out `nodes:`.
    nodes: dict[str, Node] = {}
    cells: list[CellSpec]


@dataclass(frozen=True)
class Matrix:
    cells_path: Path
    prompts_path: Path
    settings: CellDefaults
    nodes: dict[str, AnyNode]
    cells: tuple[Cell, ...]
    prompts: dict[str, Prompt]
    # {dataset entry id: the ids of the prompts sampled from it}
    prompt_groups: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def cell(self, cell_id: str) -> Cell:
        for cell in self.cells:
            if cell.cell_id == cell_id:
                return cell
        raise KeyError(cell_id)


def read_matrix(
    cells_path: Path,
    prompts_path: Path,
    *,
    engine_kinds: Sequence[str] = (),
    node_kinds: Sequence[str] = (),
) -> Matrix:
    """Read both files and check everything that can be checked without touching the network.

    `engine_kinds` and `node_kinds` are the kinds plugins add (hookspecs.py).
    """
    raw = read_yaml_mapping(cells_path, "a mapping with 'nodes' and 'cells' keys")
    prompts, groups = read_prompt_file(prompts_path)
    if raw.get("cells") is None and "cells" in raw:
        raw = {**raw, "cells": []}  # `cells:` with nothing under it: said below, after the nodes
    if raw.get("nodes") is None and "nodes" in raw:
        raw = {**raw, "nodes": {}}  # `nodes:` with nothing under it: `local` only
    context = {"engine_kinds": tuple(engine_kinds), "node_kinds": tuple(node_kinds)}
    try:
        parsed = _CellsFile.model_validate(raw, context=context)
    except ValidationError as exc:
        raise one_line_errors(cells_path, exc, raw, _describe_location) from None
    if not parsed.cells:
        raise GpubenchError(
            f"{cells_path}: cells: no cells defined (add at least one "
            "{node, engine, model} under cells)"
        )

    nodes: dict[str, AnyNode] = dict(parsed.nodes)
    implicit = LocalNode.implicit_name
    if implicit not in nodes and any(spec.node == implicit for spec in parsed.cells):
        nodes[implicit] = LocalNode(kind="local")
    cells: list[Cell] = []
    seen: dict[str, int] = {}
    for index, spec in enumerate(parsed.cells):
        where = f"{cells_path}: cells[{index}] ({spec.cell_id})"
        if spec.cell_id in seen:
            hint = (
                ""
                if spec.name is not None
                else " (two cells with the same node, engine and model on different endpoints: "
                "give each a `name:`, which makes the id <node>:<engine>:<model>@<name>)"
            )
            raise GpubenchError(
                f"{where}: duplicate cell id, already defined at cells[{seen[spec.cell_id]}]{hint}"
            )
        seen[spec.cell_id] = index
        if spec.node not in nodes:
            known = ", ".join(sorted(nodes)) or "none"
            raise GpubenchError(
                f"{where}: node: '{spec.node}' is not defined under nodes (defined: {known})"
            )
        check_endpoint_keys(where, spec)
        prompt_ids = tuple(spec.prompts) if spec.prompts is not None else tuple(prompts)
        # A dataset entry's id stands for the prompts sampled from it.
        prompt_ids = tuple(p for pid in prompt_ids for p in groups.get(pid, (pid,)))
        for prompt_id in prompt_ids:
            if prompt_id not in prompts:
                raise GpubenchError(
                    f"{where}: prompts: '{prompt_id}' is not defined in {prompts_path}"
                )
        check_request_keys(where, spec, prompts, prompt_ids, prompts_path)
        load = merged_profile(parsed.settings.load, spec.load_setting)
        load = _resolved_load(where, load, cells_path.parent)
        check_load(where, spec, load, prompts, prompts_path, nodes)
        for prompt_id in load.prompt_ids(prompt_ids) if load is not None else ():
            kind = prompts[prompt_id].kind if prompt_id in prompts else "chat"
            if kind != "chat":
                raise GpubenchError(
                    f"{where}: load: prompt '{prompt_id}' is of kind {kind}; load cases send "
                    "chat requests only (docs/request-kinds.md)"
                )
        merged = parsed.settings.thresholds.model_dump(exclude_none=True)
        if spec.thresholds is not None:
            merged.update(spec.thresholds.model_dump(exclude_none=True))
        cells.append(
            Cell(
                spec=spec,
                node=nodes[spec.node],
                index=index,
                prompt_ids=prompt_ids,
                runs=spec.runs or parsed.settings.runs,
                timeout_s=spec.timeout_s or parsed.settings.timeout_s,
                thresholds=Thresholds(**merged),
                telemetry=parsed.settings.telemetry.model_copy(
                    update=spec.telemetry.model_dump(exclude_unset=True) if spec.telemetry else {}
                ),
                load=load,
                kinds=tuple(sorted({prompts[p].kind for p in prompt_ids})) or ("chat",),
            )
        )
    check_references(cells_path, cells)
    return Matrix(
        cells_path=cells_path,
        prompts_path=prompts_path,
        settings=parsed.settings,
        nodes=nodes,
        cells=tuple(cells),
        prompts=prompts,
        prompt_groups=groups,
    )


def _resolved_load(where: str, load: LoadProfile | None, base: Path) -> LoadProfile | None:
    """The profile with its files' paths made absolute against cells.yaml's folder, each read
    once here so that a bad file stops the run before it starts."""
    if load is None:
        return None
    if load.dataset is not None:
        dataset = load.dataset.resolved(base)
        sample_dataset(dataset, f"{where}: load.dataset")
        load = load.model_copy(update={"dataset": dataset})
    if load.trace is not None:
        trace = load.trace.resolved(base)
        read_trace(trace, f"{where}: load.trace")
        load = load.model_copy(update={"trace": trace})
    return load


def load_dataset_sha256(profile: LoadProfile, request: RequestShape) -> str:
    """What a dataset load case is frozen by: its sampled prompts in order, and the request
    keys that change what is measured."""
    assert profile.dataset is not None
    items = sample_dataset(profile.dataset, "load.dataset")
    changed = request.changed_keys()
    digest = dataset_sha256(items)
    if not changed:
        return digest
    canonical = json.dumps({"dataset": digest, "request": changed}, sort_keys=True).encode()
    return hashlib.sha256(canonical).hexdigest()


def _describe_location(loc: tuple[int | str, ...], raw: Any) -> str:
    """Turn a pydantic error location into `cells[1] (local:llamacpp:tiny) key 'foo'`."""
    parts: list[str] = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            if not parts:
                parts.append(f"[{item}]")  # a key that is a number, at the top level
                continue
            parts[-1] = f"{parts[-1]}[{item}]"
            if loc[:i] == ("cells",) and isinstance(raw, dict):
                cells = raw.get("cells")
                if isinstance(cells, list) and item < len(cells) and isinstance(cells[item], dict):
                    entry = cells[item]
                    name = cell_id_of(*(entry.get(k) for k in ("node", "engine", "model", "name")))
                    parts[-1] += f" ({name})"
        elif i == 2 and loc[0] == "nodes" and item in (*NODE_KINDS, "plugin"):
            continue  # pydantic's union tag after nodes.<name>, not a key the user wrote
        else:
            parts.append(shown_key(str(item)))
    return ".".join(parts)
