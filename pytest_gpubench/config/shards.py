"""Spreading a matrix over N runs (a Slurm job array): which node groups shard i of N runs."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NotRequired, TypedDict

from pytest_gpubench.core.errors import GpubenchError

if TYPE_CHECKING:
    from pytest_gpubench.config.cell import Cell
    from pytest_gpubench.config.matrix import Matrix

SHARD_PATTERN = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class Shard:
    """Shard `index` (from 0, as SLURM_ARRAY_TASK_ID with --array=0-N-1) of `count`."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str, *, source: str = "--gpubench-shard") -> Shard:
        match = SHARD_PATTERN.match(text)
        if match is None:
            raise GpubenchError(f"{source}: {text!r} is not i/N (e.g. 0/4: the first of four)")
        index, count = int(match.group(1)), int(match.group(2))
        if count < 1 or index >= count:
            raise GpubenchError(f"{source}: {text!r}: i/N needs 0 <= i < N")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def node_groups(cells: Sequence[Cell]) -> dict[str, list[str]]:
    """Each node's cell ids, in the matrix's order: a node's cells always run together (one
    SSH connection, one rented machine, one machine measured at a time)."""
    groups: dict[str, list[str]] = {}
    for cell in cells:
        groups.setdefault(cell.spec.node, []).append(cell.cell_id)
    return groups


def assign_nodes(groups: dict[str, list[str]], count: int) -> dict[str, int]:
    """Each node's shard: the largest groups first, each to the shard with the fewest cells
    so far (the lowest index on a tie). The same matrix gives the same split on every task."""
    load = [0] * count
    shard_of: dict[str, int] = {}
    for node_id in sorted(groups, key=lambda node: (-len(groups[node]), node)):
        chosen = min(range(count), key=lambda index: (load[index], index))
        shard_of[node_id] = chosen
        load[chosen] += len(groups[node_id])
    return shard_of


def shard_matrix(matrix: Matrix, shard: Shard) -> Matrix:
    """The matrix with only the shard's cells."""
    shard_of = assign_nodes(node_groups(matrix.cells), shard.count)
    cells = tuple(cell for cell in matrix.cells if shard_of[cell.spec.node] == shard.index)
    return dataclasses.replace(matrix, cells=cells)


class ShardFacts(TypedDict):
    """The meta record's `shard`: which shard, and every cell of the matrix (so that merging the
    shards can tell a missing one); a merged ledger's adds the shards merged and missing."""

    index: NotRequired[int]
    count: int
    matrix_cells: list[str]
    merged: NotRequired[list[int]]
    missing: NotRequired[list[int]]


def shard_facts(shard: Shard, matrix_cells: Sequence[str]) -> ShardFacts:
    """What the meta record says of a sharded run."""
    return {"index": shard.index, "count": shard.count, "matrix_cells": list(matrix_cells)}
