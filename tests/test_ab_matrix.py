"""A/B cells in cells.yaml: a bad `reference:` or `min_runs:` is one line naming the file, the cell
and the key (and a usage error, exit 4, in a pytest run)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.core.errors import GpubenchError

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}
  P-MEDIUM: {intent: longer, prompt: "Say hello twice.", max_tokens: 8}
"""
HEAD = "nodes: {local: {kind: local}, box: {kind: ssh, host: 127.0.0.1, user: bench}}\ncells:\n"
MAIN = "  - {node: local, engine: llamacpp, model: tiny, name: main}\n"


def write(tmp_path: Path, cells: str) -> tuple[Path, Path]:
    cells_path, prompts_path = tmp_path / "cells.yaml", tmp_path / "prompts.yaml"
    cells_path.write_text(HEAD + textwrap.dedent(cells))
    prompts_path.write_text(PROMPTS)
    return cells_path, prompts_path


def test_a_candidate_names_its_reference_and_its_minimum(tmp_path: Path) -> None:
    cells = MAIN + (
        "  - {node: local, engine: llamacpp, model: tiny, name: pr,"
        " reference: 'local:llamacpp:tiny@main', min_runs: 3}\n"
    )
    matrix = read_matrix(*write(tmp_path, cells))
    main, candidate = matrix.cells
    assert main.reference is None
    assert candidate.reference == "local:llamacpp:tiny@main"
    assert candidate.spec.min_runs == 3


@pytest.mark.parametrize(
    ("cells", "expected"),
    [
        (
            "  - {node: local, engine: llamacpp, model: tiny, reference: 'local:llamacpp:nope'}\n",
            "cells.yaml: cells[1] (local:llamacpp:tiny): reference: 'local:llamacpp:nope' is not "
            "a cell of this file (cells: local:llamacpp:tiny@main, local:llamacpp:tiny)",
        ),
        (
            "  - {node: local, engine: llamacpp, model: tiny, name: pr,"
            " reference: 'local:llamacpp:tiny@pr'}\n",
            "cells[1] (local:llamacpp:tiny@pr): reference: a cell cannot be its own reference",
        ),
        (
            "  - {node: local, engine: llamacpp, model: tiny, name: pr,"
            " reference: 'local:llamacpp:tiny@main'}\n"
            "  - {node: local, engine: llamacpp, model: tiny, name: pr2,"
            " reference: 'local:llamacpp:tiny@pr'}\n",
            "cells[2] (local:llamacpp:tiny@pr2): reference: 'local:llamacpp:tiny@pr' has a "
            "reference of its own ('local:llamacpp:tiny@main'); chains are not supported",
        ),
        (
            "  - {node: box, engine: llamacpp, model: tiny, name: pr, endpoint: 'http://h:1',"
            " reference: 'local:llamacpp:tiny@main'}\n",
            "cells[1] (box:llamacpp:tiny@pr): reference: its reference "
            "'local:llamacpp:tiny@main' runs on node 'local', this cell on 'box'",
        ),
        (
            "  - {node: local, engine: llamacpp, model: tiny, name: pr, runs: 9,"
            " reference: 'local:llamacpp:tiny@main'}\n",
            "cells[1] (local:llamacpp:tiny@pr): runs: 9, but its reference "
            "'local:llamacpp:tiny@main' has 5",
        ),
        (
            "  - {node: local, engine: llamacpp, model: tiny, name: pr, phases: [cold],"
            " reference: 'local:llamacpp:tiny@main'}\n",
            "cells[1] (local:llamacpp:tiny@pr): reference: this cell has no warm phase to pair",
        ),
        (
            "  - {node: local, engine: llamacpp, model: tiny, name: pr, min_runs: 6,"
            " reference: 'local:llamacpp:tiny@main'}\n",
            "cells[1] (local:llamacpp:tiny@pr): min_runs: 6 is more than runs (5)",
        ),
        (
            # Sequential sampling applies to a cell judged against its baseline too (issue 22):
            # its minimum is still at most its runs.
            "  - {node: local, engine: llamacpp, model: tiny, name: pr, min_runs: 9}\n",
            "cells[1] (local:llamacpp:tiny@pr): min_runs: 9 is more than runs (5)",
        ),
    ],
    ids=[
        "unknown",
        "itself",
        "chain",
        "other-node",
        "runs",
        "no-warm",
        "min-over-runs",
        "min-alone",
    ],
)
def test_a_bad_reference_is_one_line_naming_file_cell_and_key(
    tmp_path: Path, cells: str, expected: str
) -> None:
    with pytest.raises(GpubenchError) as excinfo:
        read_matrix(*write(tmp_path, MAIN + cells))
    message = str(excinfo.value)
    assert expected in message
    assert "\n" not in message


def test_a_bad_reference_is_a_usage_error_without_a_traceback(
    tmp_path: Path, pytester: pytest.Pytester
) -> None:
    cells = "  - {node: local, engine: llamacpp, model: tiny, reference: 'local:llamacpp:x'}\n"
    write(pytester.path, cells)
    pytester.makepyfile("def test_generate(gpubench_case): pass")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*cells.yaml: cells[[]0[]] (local:llamacpp:tiny): reference:*"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
