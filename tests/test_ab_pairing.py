"""A/B pairing order: a candidate's and its reference's warm calls interleaved (A B A B …), the
order within each pair drawn per pair, the same again from the same seed."""

from __future__ import annotations

import textwrap
from pathlib import Path

from pytest_gpubench.config.cases import Case, build_cases, build_test_cases, seed_of_run
from pytest_gpubench.config.matrix import Matrix, read_matrix

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}
  P-MEDIUM: {intent: longer, prompt: "Say hello twice.", max_tokens: 8}
"""
CELLS = """\
settings: {runs: 12}
nodes: {local: {kind: local}}
cells:
  - {node: local, engine: llamacpp, model: tiny, name: main}
  - {node: local, engine: llamacpp, model: other}
  - {node: local, engine: llamacpp, model: tiny, name: pr, reference: 'local:llamacpp:tiny@main'}
"""
MAIN, OTHER, PR = "local:llamacpp:tiny@main", "local:llamacpp:other", "local:llamacpp:tiny@pr"


def matrix(tmp_path: Path) -> Matrix:
    (tmp_path / "cells.yaml").write_text(textwrap.dedent(CELLS))
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    return read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")


def warm_pairs(cases: list[Case], prompt_id: str) -> list[list[Case]]:
    """The group's warm calls of one prompt, in run order, two by two."""
    warm = [
        c for c in cases if c.phase == "warm" and c.prompt_id == prompt_id and c.cell_id != OTHER
    ]
    return [warm[index : index + 2] for index in range(0, len(warm), 2)]


def test_warm_calls_alternate_between_candidate_and_reference(tmp_path: Path) -> None:
    cases = build_cases(matrix(tmp_path), seed=7)
    order = [(c.cell_id, c.phase, c.prompt_id) for c in cases]
    group = [c for c in cases if c.cell_id in (MAIN, PR)]
    # The group runs as one block (the other cell after it), each pair's two calls side by side.
    assert [c.cell_id for c in cases[len(group) :]] == [OTHER] * (len(cases) - len(group))
    for prompt_id in ("P-EASY", "P-MEDIUM"):
        pairs = warm_pairs(cases, prompt_id)
        assert len(pairs) == 12
        for run_idx, pair in enumerate(pairs):
            assert {c.cell_id for c in pair} == {MAIN, PR}
            assert {c.run_idx for c in pair} == {run_idx}
            assert [c.pair_order for c in pair] == [0, 1]
            assert {c.pair_reference for c in pair} == {MAIN}
    # The group's cold calls come before its warm ones.
    phases = [phase for cell_id, phase, _ in order if cell_id != OTHER]
    assert phases == sorted(phases)


def test_the_order_within_each_pair_is_drawn_per_pair(tmp_path: Path) -> None:
    firsts = [
        pair[0].cell_id for pair in warm_pairs(build_cases(matrix(tmp_path), seed=7), "P-EASY")
    ]
    # Neither side always goes first: 12 pairs with one order would be a 1 in 2048 draw.
    assert firsts.count(PR) not in (0, len(firsts))


def test_the_same_seed_gives_the_same_order_and_another_seed_another(tmp_path: Path) -> None:
    grid = matrix(tmp_path)

    def firsts(seed: int) -> list[str]:
        pairs = warm_pairs(build_cases(grid, seed=seed), "P-EASY")
        return [pair[0].cell_id for pair in pairs]

    assert firsts(7) == firsts(7)
    assert firsts(7) != firsts(8) or firsts(7) != firsts(9)
    # Without a seed given, the run id decides it, alike in every process of the session.
    assert seed_of_run("run-a") == seed_of_run("run-a") != seed_of_run("run-b")


def test_a_tests_own_cases_are_interleaved_too(tmp_path: Path) -> None:
    cases = build_test_cases(matrix(tmp_path), "test_own", phases=["warm"], runs=4, seed=3)
    group = [c for c in cases if c.cell_id != OTHER]
    assert len(group) == 8
    for index in range(0, 8, 2):
        assert {c.cell_id for c in group[index : index + 2]} == {MAIN, PR}
