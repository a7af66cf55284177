"""Bad cells.yaml / prompts.yaml: one clear line naming the file, cell and key; exit status 4."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.matrix import PluginNode, load_matrix

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}
  P-MEDIUM: {intent: longer, prompt: "Say hello twice.", max_tokens: 8}
"""


def write(tmp_path: Path, cells: str, prompts: str = PROMPTS) -> tuple[Path, Path]:
    cells_path, prompts_path = tmp_path / "cells.yaml", tmp_path / "prompts.yaml"
    cells_path.write_text(textwrap.dedent(cells))
    prompts_path.write_text(textwrap.dedent(prompts))
    return cells_path, prompts_path


GOOD = """\
settings: {runs: 3, thresholds: {ttft_p50: 0.5}}
nodes:
  local: {kind: local}
  box: {kind: ssh, host: 127.0.0.1, user: bench}
cells:
  - {node: local, engine: llamacpp, model: tiny}
  - {node: box, engine: ollama, model: "qwen3.5:0.8b", endpoint: "http://127.0.0.1:11434",
     runs: 7, thresholds: {total_p50: 0.1}, prompts: [P-EASY]}
"""


def test_valid_matrix_applies_defaults_and_per_cell_overrides(tmp_path: Path) -> None:
    matrix = load_matrix(*write(tmp_path, GOOD))
    tiny, ollama = matrix.cells
    assert tiny.cell_id == "local:llamacpp:tiny" and tiny.managed and tiny.runs == 3
    assert tiny.prompt_ids == ("P-EASY", "P-MEDIUM")
    assert ollama.cell_id == "box:ollama:qwen3.5:0.8b" and not ollama.managed
    assert ollama.runs == 7 and ollama.prompt_ids == ("P-EASY",)
    assert ollama.thresholds.ttft_p50 == 0.5 and ollama.thresholds.total_p50 == 0.1


@pytest.mark.parametrize(
    ("cells", "expected"),
    [
        (
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: llamacpp, model: tiny, colour: red}\n",
            "cells.yaml: cells[0] (local:llamacpp:tiny).colour: unknown key",
        ),
        (
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: llamacpp, model: tiny}\n"
            "  - {node: local, engine: llamacpp, model: tiny}\n",
            "cells.yaml: cells[1] (local:llamacpp:tiny): duplicate cell id, already defined at cells[0]",
        ),
        (
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: openai, model: m, endpoint: 'not a url'}\n",
            "cells.yaml: cells[0] (local:openai:m).endpoint: Input should be a valid URL",
        ),
        (
            "nodes: {local: {kind: local}}\ncells:\n  - {node: gpu1, engine: llamacpp, model: tiny}\n",
            "cells.yaml: cells[0] (gpu1:llamacpp:tiny): node: 'gpu1' is not defined under nodes",
        ),
        (
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: ollama, model: m}\n",
            "cells.yaml: cells[0] (local:ollama:m): endpoint: required for engine 'ollama'",
        ),
        (
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: tgi, model: m}\n",
            "cells.yaml: cells[0] (local:tgi:m).engine: unknown engine kind 'tgi' (known: "
            "llamacpp, ollama, openai; a plugin adds more with pytest_gpubench_engine_kinds)",
        ),
        (
            "nodes: {rack: {kind: k8s, namespace: gpu}}\ncells: []\n",
            "cells.yaml: nodes.rack.kind: unknown node kind 'k8s' (known: local, ssh, provider;",
        ),
        (
            "nodes: {local: {kind: local, gpus: 2}}\ncells: []\n",
            "cells.yaml: nodes.local.gpus: unknown key",
        ),
        (
            "nodes: {box: local}\ncells: []\n",
            "cells.yaml: nodes.box: a node is a mapping with a 'kind' key",
        ),
        (
            "nodes: {box: {kind: ssh, host: h}}\ncells: []\n",
            "cells.yaml: nodes.box.user: required key is missing",
        ),
        (
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: llamacpp, model: tiny, prompts: [P-NOPE]}\n",
            "cells.yaml: cells[0] (local:llamacpp:tiny): prompts: 'P-NOPE' is not defined",
        ),
        ("nodes: {local: {kind: local}\ncells: [\n", "cells.yaml: line"),
    ],
    ids=[
        "unknown-key",
        "duplicate",
        "bad-url",
        "unknown-node",
        "unmanageable",
        "bad-engine",
        "bad-node-kind",
        "node-named-like-a-kind",
        "node-not-a-mapping",
        "missing-key",
        "unknown-prompt",
        "malformed",
    ],
)
def test_bad_cells_file_names_file_cell_and_key(tmp_path: Path, cells: str, expected: str) -> None:
    with pytest.raises(GpubenchError) as excinfo:
        load_matrix(*write(tmp_path, cells))
    assert expected in str(excinfo.value)


def test_non_positive_max_tokens_names_prompt_and_key(tmp_path: Path) -> None:
    prompts = "prompts:\n  P-EASY: {intent: x, prompt: hi, max_tokens: 0}\n"
    with pytest.raises(GpubenchError, match=r"prompts\.yaml: prompts\.P-EASY\.max_tokens: "):
        load_matrix(*write(tmp_path, GOOD, prompts))


def test_bad_input_is_a_usage_error_with_one_line_and_no_traceback(
    pytester: pytest.Pytester,
) -> None:
    pytester.makefile(".yaml", prompts=PROMPTS)
    pytester.makefile(
        ".yaml",
        cells="nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: llamacpp, model: tiny, runz: 3}\n",
    )
    pytester.makepyfile("def test_generate(gpubench_case): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: *cells.yaml: cells[[]0[]] (local:llamacpp:tiny).runz: unknown key*"]
    )
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_named_cells_file_that_is_missing_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--gpubench-cells", "nope.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: *nope.yaml: file not found"])


def test_plain_tests_run_untouched_without_a_matrix(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    assert not (pytester.path / "runs").exists()


def test_kinds_that_plugins_add_are_accepted(tmp_path: Path) -> None:
    cells = (
        "nodes: {rack: {kind: k8s, namespace: gpu, replicas: 2}}\n"
        "cells:\n  - {node: rack, engine: tgi, model: m, endpoint: 'http://10.0.0.1:80'}\n"
    )
    matrix = load_matrix(*write(tmp_path, cells), engine_kinds=["tgi"], node_kinds=["k8s"])
    (cell,) = matrix.cells
    assert cell.spec.engine == "tgi"
    assert isinstance(cell.node, PluginNode) and cell.node.kind == "k8s"
    assert cell.node.options == {"namespace": "gpu", "replicas": 2}


def test_a_plugin_engine_kind_still_needs_an_endpoint(tmp_path: Path) -> None:
    cells = "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: tgi, model: m}\n"
    with pytest.raises(GpubenchError, match=r"\(local:tgi:m\): endpoint: required for engine"):
        load_matrix(*write(tmp_path, cells), engine_kinds=["tgi"])
