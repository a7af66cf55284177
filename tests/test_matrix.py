"""Bad cells.yaml / prompts.yaml: one clear line naming the file, cell and key; exit status 4."""

from __future__ import annotations

import fnmatch
import textwrap
from pathlib import Path

import pytest

from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.config.nodes import LocalNode, PluginNode, SshNode
from pytest_gpubench.config.prompts import read_prompts
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.results.baseline import baseline_file_name

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
    matrix = read_matrix(*write(tmp_path, GOOD))
    tiny, ollama = matrix.cells
    assert tiny.cell_id == "local:llamacpp:tiny" and tiny.managed and tiny.runs == 3
    assert tiny.prompt_ids == ("P-EASY", "P-MEDIUM")
    assert ollama.cell_id == "box:ollama:qwen3.5:0.8b" and not ollama.managed
    assert ollama.runs == 7 and ollama.prompt_ids == ("P-EASY",)
    assert ollama.thresholds.ratio("ttft_p50") == 0.5
    assert ollama.thresholds.ratio("total_p50") == 0.1


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
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: openai, model: m}\n",
            "cells.yaml: cells[0] (local:openai:m): launch: a managed openai cell needs a launch "
            "template",
        ),
        (
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: tgi, model: m}\n",
            "cells.yaml: cells[0] (local:tgi:m).engine: unknown engine kind 'tgi' (known: "
            "llamacpp, ollama, openai; a plugin adds more with pytest_gpubench_engine_kinds)",
        ),
        (
            "nodes: {rack: {kind: k8s, namespace: gpu}}\ncells: []\n",
            "cells.yaml: nodes.rack.kind: unknown node kind 'k8s' (known: local, ssh, provider, slurm;",
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
        read_matrix(*write(tmp_path, cells))
    assert expected in str(excinfo.value)


@pytest.mark.parametrize(
    "nodes",
    ["", "nodes:\n", "nodes: {}\n", "nodes: {box: {kind: ssh, host: 127.0.0.1, user: bench}}\n"],
    ids=["no-nodes-key", "nodes-empty", "nodes-empty-mapping", "other-nodes-only"],
)
def test_local_needs_no_entry_under_nodes(tmp_path: Path, nodes: str) -> None:
    """A new user's local-only cells.yaml had to write `nodes: {local: {kind: local}}` (issue
    37): `local` is this machine wherever a cell names it and the file does not define it."""
    cells = nodes + "cells:\n  - {node: local, engine: llamacpp, model: tiny}\n"
    matrix = read_matrix(*write(tmp_path, cells))
    (cell,) = matrix.cells
    assert cell.cell_id == "local:llamacpp:tiny" and cell.node == LocalNode(kind="local")
    assert matrix.nodes["local"] == LocalNode(kind="local")


def test_a_node_named_local_of_another_kind_is_the_files_own(tmp_path: Path) -> None:
    cells = (
        "nodes: {local: {kind: ssh, host: 127.0.0.1, user: bench}}\n"
        "cells:\n  - {node: local, engine: ollama, model: m, endpoint: 'http://127.0.0.1:9'}\n"
    )
    (cell,) = read_matrix(*write(tmp_path, cells)).cells
    assert isinstance(cell.node, SshNode)


def test_a_node_other_than_local_still_needs_its_entry(tmp_path: Path) -> None:
    cells = "cells:\n  - {node: gpu1, engine: llamacpp, model: tiny}\n"
    with pytest.raises(GpubenchError) as excinfo:
        read_matrix(*write(tmp_path, cells))
    assert str(excinfo.value) == (
        f"{tmp_path / 'cells.yaml'}: cells[0] (gpu1:llamacpp:tiny): node: 'gpu1' is not defined "
        "under nodes (defined: none)"
    )


def test_non_positive_max_tokens_names_prompt_and_key(tmp_path: Path) -> None:
    prompts = "prompts:\n  P-EASY: {intent: x, prompt: hi, max_tokens: 0}\n"
    with pytest.raises(GpubenchError, match=r"prompts\.yaml: prompts\.P-EASY\.max_tokens: "):
        read_matrix(*write(tmp_path, GOOD, prompts))


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
    matrix = read_matrix(*write(tmp_path, cells), engine_kinds=["tgi"], node_kinds=["k8s"])
    (cell,) = matrix.cells
    assert cell.spec.engine == "tgi"
    assert isinstance(cell.node, PluginNode) and cell.node.kind == "k8s"
    assert cell.node.options == {"namespace": "gpu", "replicas": 2}


def test_a_plugin_engine_kind_still_needs_an_endpoint(tmp_path: Path) -> None:
    cells = "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: tgi, model: m}\n"
    with pytest.raises(GpubenchError, match=r"\(local:tgi:m\): endpoint: required for engine"):
        read_matrix(*write(tmp_path, cells), engine_kinds=["tgi"])


# -- files that are not what they should be: one line naming the file, exit 4 -----------------

ONE_CELL = (
    "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: llamacpp, model: tiny}\n"
)


def run_with_files(
    pytester: pytest.Pytester, cells: bytes | str, prompts: bytes | str = PROMPTS
) -> pytest.RunResult:
    for name, content in (("cells.yaml", cells), ("prompts.yaml", prompts)):
        data = content.encode() if isinstance(content, str) else content
        (pytester.path / name).write_bytes(data)
    pytester.makepyfile("def test_generate(gpubench_case):\n    gpubench_case.run()\n")
    return pytester.runpytest("--force-load")


def assert_one_usage_line(result: pytest.RunResult, pattern: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if line.strip()]
    assert len(errors) == 1, errors
    assert fnmatch.fnmatch(errors[0], pattern), errors[0]
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output and "INTERNALERROR" not in output


@pytest.mark.parametrize(
    ("cells", "prompts", "expected"),
    [
        (
            "# Bench cells\nnodes: {local: {kind: local}}\ncells:\n"
            "  - {node: local, engine: llamacpp, model: caf\xe9}\n".encode("latin-1"),
            PROMPTS,
            "ERROR: */cells.yaml: line 4: not UTF-8 text (byte 0xe9 at offset *); save the file as UTF-8",
        ),
        (
            ONE_CELL,
            'prompts:\n  P-EASY: {intent: short, prompt: "\xbfQu\xe9?", max_tokens: 4}\n'.encode(
                "latin-1"
            ),
            "ERROR: */prompts.yaml: line 2: not UTF-8 text (byte 0xbf at offset *); save the file as UTF-8",
        ),
        (
            "",
            PROMPTS,
            "ERROR: */cells.yaml: the file is empty (expected a mapping with 'nodes' and 'cells' keys)",
        ),
        (
            "# only a comment\n\n",
            PROMPTS,
            "ERROR: */cells.yaml: the file is empty (expected a mapping with 'nodes' and 'cells' keys)",
        ),
        (
            ONE_CELL,
            "",
            "ERROR: */prompts.yaml: the file is empty (expected a mapping with a 'prompts' key)",
        ),
        (
            "nodes: {local: {kind: local}}\ncells: []\n",
            PROMPTS,
            "ERROR: */cells.yaml: cells: no cells defined (add at least one {node, engine, model} under cells)",
        ),
        (
            "nodes: {local: {kind: local}}\ncells:\n",
            PROMPTS,
            "ERROR: */cells.yaml: cells: no cells defined *",
        ),
        (ONE_CELL, "prompts: {}\n", "ERROR: */prompts.yaml: prompts: no prompts defined"),
        (ONE_CELL, "prompts:\n", "ERROR: */prompts.yaml: prompts: no prompts defined"),
        (
            "- {node: local, engine: llamacpp, model: tiny}\n",
            PROMPTS,
            "ERROR: */cells.yaml: expected a mapping with 'nodes' and 'cells' keys, got list",
        ),
    ],
    ids=[
        "cells-not-utf8",
        "prompts-not-utf8",
        "cells-empty",
        "cells-only-comments",
        "prompts-empty",
        "cells-empty-list",
        "cells-key-with-nothing",
        "prompts-empty-mapping",
        "prompts-key-with-nothing",
        "cells-not-a-mapping",
    ],
)
def test_unreadable_or_empty_files_are_one_usage_line(
    pytester: pytest.Pytester, cells: bytes | str, prompts: bytes | str, expected: str
) -> None:
    assert_one_usage_line(run_with_files(pytester, cells, prompts), expected)


def test_a_utf8_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    cells_path, prompts_path = write(tmp_path, GOOD)
    cells_path.write_bytes(b"\xef\xbb\xbf" + cells_path.read_bytes())
    assert len(read_matrix(cells_path, prompts_path).cells) == 2


# -- named cells: two engine versions side by side ------------------------------------------

SIDE_BY_SIDE = """\
nodes: {local: {kind: local}}
cells:
  - {node: local, engine: openai, model: m, endpoint: "http://127.0.0.1:8000", name: b4100}
  - {node: local, engine: openai, model: m, endpoint: "http://127.0.0.1:8001", name: b4200}
  - {node: local, engine: openai, model: m, endpoint: "http://127.0.0.1:8002"}
"""


def test_a_name_tells_apart_cells_with_the_same_node_engine_and_model(tmp_path: Path) -> None:
    matrix = read_matrix(*write(tmp_path, SIDE_BY_SIDE))
    assert [cell.cell_id for cell in matrix.cells] == [
        "local:openai:m@b4100",
        "local:openai:m@b4200",
        "local:openai:m",
    ]
    assert matrix.cell("local:openai:m@b4200").endpoint_as_written == "http://127.0.0.1:8001"
    assert [baseline_file_name(cell.cell_id) for cell in matrix.cells] == [
        "local_openai_m_b4100.json",
        "local_openai_m_b4200.json",
        "local_openai_m.json",
    ]


@pytest.mark.parametrize(
    ("cells", "expected"),
    [
        (
            SIDE_BY_SIDE.replace("name: b4200", "name: b4100"),
            "cells.yaml: cells[1] (local:openai:m@b4100): duplicate cell id, already defined at "
            "cells[0]",
        ),
        (
            SIDE_BY_SIDE.replace(", name: b4200", ""),
            "cells.yaml: cells[2] (local:openai:m): duplicate cell id, already defined at cells[1] "
            "(two cells with the same node, engine and model on different endpoints: give each a "
            "`name:`, which makes the id <node>:<engine>:<model>@<name>)",
        ),
        (
            SIDE_BY_SIDE.replace("name: b4200", 'name: "new build"'),
            "cells.yaml: cells[1] (local:openai:m@new build).name: must be letters, digits, '.', "
            "'_' or '-', starting with a letter or digit (it ends the cell id, "
            "<node>:<engine>:<model>@<name>) (got 'new build')",
        ),
        (
            SIDE_BY_SIDE.replace("name: b4200", "name: a/b"),
            "cells.yaml: cells[1] (local:openai:m@a/b).name: must be letters, digits",
        ),
    ],
    ids=["same-name-twice", "unnamed-twice", "name-with-space", "name-with-slash"],
)
def test_bad_or_missing_names_are_usage_errors(tmp_path: Path, cells: str, expected: str) -> None:
    with pytest.raises(GpubenchError) as excinfo:
        read_matrix(*write(tmp_path, cells))
    assert expected in str(excinfo.value)


def test_named_cells_collect_with_the_name_in_their_ids(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", prompts=PROMPTS, cells=SIDE_BY_SIDE)
    pytester.makepyfile("def test_generate(gpubench_case):\n    pass\n")
    result = pytester.runpytest("--collect-only", "-q", "-m", "warm", "--gpubench-runs", "1")
    assert result.ret == pytest.ExitCode.OK
    ids = [line.split("[", 1)[1].rstrip("]") for line in result.outlines if "::" in line]
    assert ids == [
        f"{cell}-{prompt}-warm-0"
        for cell in ("local:openai:m@b4100", "local:openai:m@b4200", "local:openai:m")
        for prompt in ("P-EASY", "P-MEDIUM")
    ]


def test_same_cells_without_names_are_a_usage_error(pytester: pytest.Pytester) -> None:
    result = run_with_files(pytester, SIDE_BY_SIDE.replace(", name: b4200", ""))
    assert_one_usage_line(
        result, "ERROR: *cells.yaml: cells[[]2[]] (local:openai:m): duplicate cell id, * `name:`*"
    )


# -- the endpoint as written -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "normalised"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/"),
        ("HTTP://Gpu-Box.lan:8000", "http://gpu-box.lan:8000/"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1/"),
    ],
)
def test_the_endpoint_is_kept_as_written_and_still_validated(
    tmp_path: Path, written: str, normalised: str
) -> None:
    cells = (
        "nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: openai, model: m, endpoint: '{written}'}}\n"
        "  - {node: local, engine: llamacpp, model: tiny}\n"
    )
    remote, managed = read_matrix(*write(tmp_path, cells)).cells
    assert remote.endpoint_as_written == remote.spec.endpoint_as_written == written
    assert str(remote.spec.endpoint) == normalised
    assert managed.endpoint_as_written is None


# -- the shipped prompts are the canonical ones, verbatim -------------------------------------

SHIPPED_PROMPTS = Path(__file__).resolve().parents[1] / "prompts.yaml"
CANONICAL = {
    "P-EASY": ("trivial — single-token response space, near-zero work", "hi", 64),
    "P-MEDIUM": (
        "bounded structured task — 4 sentences on a known topic",
        "Explain in 4 sentences why the sky appears blue at noon.",
        512,
    ),
    "P-HARD": (
        "open-ended creative — 200-word generation",
        "Write a 200-word story about a fisherman who discovers a coin from a sunken empire.",
        1024,
    ),
}


def test_shipped_prompts_are_the_canonical_ones_verbatim() -> None:
    """The ids are frozen with these texts: earlier measurements on other machines used them."""
    prompts = read_prompts(SHIPPED_PROMPTS)
    assert {pid: (p.intent, p.prompt, p.max_tokens) for pid, p in prompts.items()} == CANONICAL
    assert list(prompts) == ["P-EASY", "P-MEDIUM", "P-HARD"]


@pytest.mark.parametrize(
    ("cells", "prompts", "expected"),
    [
        (
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: llamacpp, model: tiny}\n"
            "cells:\n  - {node: local, engine: llamacpp, model: tiny, name: b}\n",
            PROMPTS,
            "cells.yaml: line 4: duplicate key 'cells' (first written on line 2)",
        ),
        (
            "nodes: {local: {kind: local}}\ncells:\n  - node: local\n    engine: llamacpp\n"
            "    model: tiny\n    model: other\n",
            PROMPTS,
            "cells.yaml: line 6: duplicate key 'model' (first written on line 5)",
        ),
        (
            GOOD,
            "prompts:\n  P-EASY: {intent: a, prompt: hi, max_tokens: 4}\n"
            "  P-EASY: {intent: b, prompt: ho, max_tokens: 4}\n",
            "prompts.yaml: line 3: duplicate key 'P-EASY' (first written on line 2)",
        ),
    ],
    ids=["second-cells-list", "model-twice", "prompt-twice"],
)
def test_a_key_written_twice_is_a_usage_error_naming_file_line_and_key(
    tmp_path: Path, cells: str, prompts: str, expected: str
) -> None:
    """YAML keeps the last of two equal keys silently: a second `cells:` dropped the first list's
    cells from the run and the manifest, and `model:` twice measured the last one."""
    with pytest.raises(GpubenchError) as excinfo:
        read_matrix(*write(tmp_path, cells, prompts))
    assert str(excinfo.value).startswith(str(tmp_path))
    assert expected in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_a_duplicate_key_ends_the_run_with_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", prompts=PROMPTS)
    pytester.makefile(
        ".yaml",
        cells="nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: llamacpp, model: tiny}\n"
        "cells:\n  - {node: local, engine: llamacpp, model: tiny, name: b}\n",
    )
    pytester.makepyfile("def test_generate(gpubench_case): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: *cells.yaml: line 4: duplicate key 'cells'*"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_a_deeply_nested_file_is_one_usage_line(pytester: pytest.Pytester) -> None:
    """A cells.yaml that is one list nested 2,000 levels deep ended in INTERNALERROR and a
    RecursionError traceback."""
    pytester.makefile(".yaml", prompts=PROMPTS)
    pytester.makefile(".yaml", cells="[" * 2000 + "]" * 2000)
    pytester.makepyfile("def test_generate(gpubench_case): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: *cells.yaml: line 1: nested deeper than 100 levels"])
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output and "INTERNALERROR" not in output
