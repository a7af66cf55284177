"""The cases: every (cell, prompt, phase, run_idx) a benchmark test is parametrized over, and
every (cell, test, phase, run_idx) of a test that measures requests of its own."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import total_ordering
from typing import Any

from pytest_gpubench.config.cell import PHASES, Cell
from pytest_gpubench.config.matrix import Matrix

COLD_RUNS = 1
# The phase of a load case: many requests at once (load_profile.py), after the cold and warm ones.
LOAD_PHASE = "load"
# A test's own cases sort after the cell's prompts (the field is only an order).
TEST_PROMPT_INDEX = 1 << 16


@total_ordering
@dataclass(frozen=True)
class Case:
    # Field order is the run order: a node's cells together (so that a rented node can be given
    # back after its last case), a cell's cases together, its cold cases first; an A/B group's
    # cells (a reference and its candidates) together as one, their calls interleaved.
    node_index: int
    cell_index: int
    phase_index: int
    prompt_index: int
    run_idx: int
    cell_id: str
    prompt_id: str
    phase: str
    # A test that measures its own requests (gpubench_engine.chat): its name, which is also the
    # case's prompt_id (the gate, the baselines and the reports key on that). None for the
    # prompts of prompts.yaml.
    test_id: str | None = None
    # A load case (phase `load`): its load point (`c4`, `r5`, `sweep`); run_idx is its index.
    load_point: str | None = None
    # A cell that chooses LoRA adapters per request: the adapter this case's calls name (its
    # prompt_id is then `<prompt>@<adapter>`, the id it is judged under).
    adapter: str | None = None
    # A cell of an A/B group: the group's reference cell id and index (its cases run as one
    # cell's), and for a warm case its place among the group's calls of the same prompt and
    # run_idx (0 first), drawn per pair from the seed. Only the run order: not in equality, so a
    # case rebuilt from its id (xdist) is the same case.
    pair_reference: str | None = field(default=None, compare=False)
    pair_group: int | None = field(default=None, compare=False)
    pair_order: int | None = field(default=None, compare=False)

    def _run_order(self) -> tuple[Any, ...]:
        group = self.cell_index if self.pair_group is None else self.pair_group
        return (
            self.node_index,
            group,
            self.phase_index,
            self.prompt_index,
            self.run_idx,
            self.pair_order or 0,
            self.cell_index,
            self.cell_id,
            self.prompt_id,
            self.phase,
            self.test_id or "",
            self.load_point or "",
        )

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Case):
            return NotImplemented
        return self._run_order() < other._run_order()

    @property
    def source_prompt_id(self) -> str:
        """The prompts.yaml id of the case's prompt (its prompt_id less its adapter)."""
        if self.adapter is None:
            return self.prompt_id
        return self.prompt_id[: -len(self.adapter) - 1]

    @property
    def case_id(self) -> str:
        if self.load_point is not None:
            return f"{self.cell_id}-{self.prompt_id}-{LOAD_PHASE}-{self.load_point}"
        return f"{self.cell_id}-{self.prompt_id}-{self.phase}-{self.run_idx}"


def seed_of_run(run_id: str) -> int:
    """The A/B order's seed when none is given: drawn from the run id, which every xdist worker
    shares, so that all of them order the cases alike."""
    return int(hashlib.sha256(run_id.encode()).hexdigest()[:8], 16)


def ab_groups(matrix: Matrix) -> dict[str, list[Cell]]:
    """{reference cell id: the reference and its candidates, in the matrix's order}."""
    groups: dict[str, list[Cell]] = {}
    for cell in matrix.cells:
        if cell.reference is not None:
            groups.setdefault(cell.reference, [matrix.cell(cell.reference)]).append(cell)
    return {ref: sorted(cells, key=lambda cell: cell.index) for ref, cells in groups.items()}


def pair_order(
    seed: int, reference: str, prompt_id: str, run_idx: int, cells: Sequence[str]
) -> list[str]:
    """The order in which an A/B group's cells make their call of one (prompt, run_idx): drawn
    from the seed for each two pairs, the second of them in the reverse order (A B, B A; B A,
    A B; …). The same in every process and session with that seed. Counterbalanced: a call
    made second in its pair finds the machine warmer (measured here: about 5 % faster), and a
    side that went second more often by chance would look faster for it."""
    order = list(cells)
    random.Random(f"{seed}:{reference}:{prompt_id}:{run_idx // 2}").shuffle(order)
    return order[::-1] if run_idx % 2 else order


def _paired(matrix: Matrix, cases: list[Case], seed: int) -> list[Case]:
    """The cases of A/B groups' cells with their group and, warm, their place in each pair."""
    groups = ab_groups(matrix)
    if not groups:
        return cases
    group_of = {cell.cell_id: ref for ref, cells in groups.items() for cell in cells}
    paired: list[Case] = []
    for case in cases:
        reference = group_of.get(case.cell_id)
        if reference is None:
            paired.append(case)
            continue
        members = [
            cell.cell_id
            for cell in groups[reference]
            if case.phase != "warm" or _measures(cell, case)
        ]
        order = (
            pair_order(seed, reference, case.prompt_id, case.run_idx, members).index(case.cell_id)
            if case.phase == "warm" and case.load_point is None
            else None
        )
        group_index = min(cell.index for cell in groups[reference])
        paired.append(
            replace(case, pair_reference=reference, pair_group=group_index, pair_order=order)
        )
    return paired


def _measures(cell: Cell, case: Case) -> bool:
    """Whether the cell has a warm call of the case's prompt and run_idx."""
    if case.test_id is not None:
        return True
    return case.source_prompt_id in cell.prompt_ids


def build_cases(matrix: Matrix, runs_override: int | None = None, *, seed: int = 0) -> list[Case]:
    """All cases in a deterministic order (xdist needs the same order on every worker); an A/B
    group's warm calls interleaved, each pair in the order `seed` draws for it."""
    node_order = _node_order(matrix)
    cases = [
        case
        for cell in matrix.cells
        for case in _cell_cases(
            cell,
            node_order,
            phases=cell.spec.phases,
            # A timed cell's warm phase is one case per prompt, which calls for duration_s.
            warm_runs=1 if cell.spec.duration_s else (runs_override or cell.runs),
            prompts=[
                (index, judged, adapter)
                for index, (judged, _, adapter) in enumerate(cell.case_prompts())
            ],
        )
    ]
    cases += [case for cell in matrix.cells for case in _load_cases(cell, node_order)]
    return sorted(set(_paired(matrix, cases, seed)))


def _load_cases(cell: Cell, node_order: list[str]) -> list[Case]:
    """A cell's load cases: per prompt its load sends, per load point, in the profile's order."""
    if cell.load is None:
        return []
    return [
        _case(cell, node_order, LOAD_PHASE, prompt_index, prompt_id, point_index, load_point=point)
        for prompt_index, prompt_id in enumerate(cell.load.prompt_ids(cell.prompt_ids))
        for point_index, point in enumerate(cell.load.points)
    ]


def build_test_cases(
    matrix: Matrix,
    test_id: str,
    *,
    cells: Sequence[str] | None = None,
    phases: Sequence[str] | None = None,
    runs: int | None = None,
    runs_override: int | None = None,
    seed: int = 0,
) -> list[Case]:
    """The cases of a test with requests of its own: per cell (all, or `cells`), per phase (the
    cell's, or `phases`), 1 cold run or the warm runs (--gpubench-runs, else `runs`, else the
    cell's). Ordered as build_cases orders its own."""
    node_order = _node_order(matrix)
    cases = [
        case
        for cell in matrix.cells
        if cells is None or cell.cell_id in cells
        for case in _cell_cases(
            cell,
            node_order,
            phases=phases if phases is not None else cell.spec.phases,
            warm_runs=runs_override or runs or cell.runs,
            prompts=[(TEST_PROMPT_INDEX, test_id, None)],
            test_id=test_id,
        )
    ]
    return sorted(set(_paired(matrix, cases, seed)))


def _case(
    cell: Cell,
    node_order: list[str],
    phase: str,
    prompt_index: int,
    prompt_id: str,
    run_idx: int,
    test_id: str | None = None,
    *,
    load_point: str | None = None,
    adapter: str | None = None,
) -> Case:
    """A case of the cell, placed in the session's order (its node's, its phase's)."""
    return Case(
        node_index=node_order.index(cell.spec.node),
        cell_index=cell.index,
        phase_index=len(PHASES) if phase == LOAD_PHASE else PHASES.index(phase),
        prompt_index=prompt_index,
        run_idx=run_idx,
        cell_id=cell.cell_id,
        prompt_id=prompt_id,
        phase=phase,
        test_id=test_id,
        load_point=load_point,
        adapter=adapter,
    )


def _node_order(matrix: Matrix) -> list[str]:
    return list(dict.fromkeys(cell.spec.node for cell in matrix.cells))


def _cell_cases(
    cell: Cell,
    node_order: list[str],
    *,
    phases: Sequence[str],
    warm_runs: int,
    prompts: Sequence[tuple[int, str, str | None]],
    test_id: str | None = None,
) -> list[Case]:
    """One cell's cases: per phase, per prompt (index, id, adapter), 1 cold run or
    `warm_runs`."""
    return [
        _case(cell, node_order, phase, prompt_index, prompt_id, run_idx, test_id, adapter=adapter)
        for phase in phases
        for prompt_index, prompt_id, adapter in prompts
        for run_idx in range(COLD_RUNS if phase == "cold" else warm_runs)
    ]


_CASE_TAIL = re.compile(r"(?P<head>.+)-(?P<phase>cold|warm)-(?P<run_idx>[0-9]+)")


def own_case_of_id(matrix: Matrix, param: str) -> Case | None:
    """The case of a test with requests of its own, from its parameter id as it appears in a
    node id (`<cell>-<test>-<phase>-<run_idx>`), or None. Under xdist the controller learns of
    the cases only from the workers' node ids, and a test's marker is read on the workers."""
    match = _CASE_TAIL.fullmatch(param)
    if match is None:
        return None
    head = match["head"]
    node_order = list(dict.fromkeys(cell.spec.node for cell in matrix.cells))
    # The longest cell id first: `m:openai:qwen3-0.6b-test_x` is not a test of `m:openai:qwen3`.
    for cell in sorted(matrix.cells, key=lambda cell: -len(escaped_id(cell.cell_id))):
        prefix = escaped_id(cell.cell_id) + "-"
        if not head.startswith(prefix) or len(head) == len(prefix):
            continue
        test_id = head[len(prefix) :]
        if test_id in matrix.prompts:
            return None  # a prompts.yaml case: build_cases knows it
        return Case(
            node_index=node_order.index(cell.spec.node),
            cell_index=cell.index,
            phase_index=PHASES.index(match["phase"]),
            prompt_index=TEST_PROMPT_INDEX,
            run_idx=int(match["run_idx"]),
            cell_id=cell.cell_id,
            prompt_id=test_id,
            phase=match["phase"],
            test_id=test_id,
        )
    return None


def request_sha256(
    messages: Sequence[Mapping[str, Any]],
    max_tokens: int,
    options: Mapping[str, Any],
    *,
    answer_schema: Mapping[str, Any] | None = None,
) -> str:
    """What a test's request is frozen by: the sha256 of its messages, max_tokens and request
    options as canonical JSON (keys sorted, no spaces, UTF-8), and the JSON Schema its answer is
    judged against where it has one (a request without one hashes as it always has)."""
    frozen: dict[str, object] = {
        "messages": list(messages), "max_tokens": max_tokens, "options": dict(options)
    }  # fmt: skip
    if answer_schema is not None:
        frozen["answer_schema"] = dict(answer_schema)
    canonical = json.dumps(
        frozen,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def smoke_case(cases: list[Case], skipped_cells: set[str]) -> Case | None:
    """The case --smoke runs: the first runnable cell's first prompt, one run, warm if it can."""
    runnable = [case for case in cases if case.cell_id not in skipped_cells] or cases
    if not runnable:
        return None
    first_cell = runnable[0].cell_id
    of_cell = [case for case in runnable if case.cell_id == first_cell]
    warm = [case for case in of_cell if case.phase == "warm"]
    return (warm or of_cell)[0]


def param_id(node_id: str) -> str:
    """The parameter id of a node id (`test_generate[<case id>]` -> `<case id>`)."""
    if "[" not in node_id:
        return ""
    return node_id.split("[", 1)[1].rsplit("]", 1)[0]


# pytest escapes non-ASCII and non-printable characters in parameter ids (_pytest.compat's
# ascii_escaped), so a node id names `modèle` as `mod\xe8le`.
_NON_PRINTABLE = {i: f"\\x{i:02x}" for i in range(128) if i not in range(32, 127)}
_NON_PRINTABLE.update({ord("\t"): "\\t", ord("\r"): "\\r", ord("\n"): "\\n"})


def escaped_id(case_id: str) -> str:
    """A case id as it appears inside a pytest node id."""
    return case_id.encode("unicode_escape").decode("ascii").translate(_NON_PRINTABLE)
