"""Every example in docs/ runs (issue 44), the pages a new user follows first: each prompts.yaml,
cells.yaml and command example of every page (tests/support/docs_examples.py extracts them) is run
here against
the real llama.cpp server the embedded default runs, through the shipped benchmarks/test_inference.py
(or, for commands, in the project `gpubench init` writes), and its documented outcome is asserted:
the exit status and the lines its marker names (0 and none by default). An example that cannot run
here says why in the page (`<!-- example: not here: ... -->`), and every other example runs: a
page's new example is run the day it is written.

How each kind of example is run:
- prompts.yaml: as it is, with a cells.yaml that gives each kind the cell the page says it needs
  (generating kinds one cell with `--chat-template llama3`, which the json_schema example needs;
  embeddings and reranks a cell each), two warm runs a prompt;
- cells.yaml: as it is, with the canonical prompts and every prompt example of the same page;
- commands: as a bash script in a new git repository (`cd your-repository` goes into it), with
  the installed `pytest` and `gpubench`; PYTEST_ADDOPTS lets the shared machine's load through
  (`--force-load`) and makes each prompt 5 warm runs (the starter's 20 would cost minutes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from support.bench_files import png
from support.docs_examples import Example, page_examples

from pytest_gpubench.cli.init import template_text

REPOSITORY = Path(__file__).resolve().parent.parent
DOCS = REPOSITORY / "docs"
# Every page: its every example runs here or says why not (the pages a new user follows first).
FIRST_PAGES = ("getting-started.md", "request-kinds.md")
RUN_PAGES = FIRST_PAGES + tuple(
    sorted(path.name for path in DOCS.glob("*.md") if path.name not in FIRST_PAGES)
)
# The files the examples name, as the shipped sample (a ShareGPT file the package ships).
SAMPLE = REPOSITORY / "pytest_gpubench" / "config" / "samples" / "chat_sample.jsonl"
EXAMPLE_FILES = {"samples/chat_sample.jsonl": SAMPLE, "chat.jsonl": SAMPLE}
INFERENCE_TEST = REPOSITORY / "benchmarks" / "test_inference.py"
# What a prompt's kind needs of its cell (docs/request-kinds.md).
GENERATING_ARGS = "[--threads, '1', --chat-template, llama3]"
ONE_CELL_KINDS = {"embedding": "embed", "rerank": "rank"}
RUN_OPTIONS = (
    "--force-load", "-p", "no:cacheprovider", "--gpubench-steadiness", "off",
    "--gpubench-runs", "2", "-rs",
)  # fmt: skip


def examples_of(page: str) -> list[Example]:
    return page_examples(page, (DOCS / page).read_text(encoding="utf-8"))


RUN = [example for page in RUN_PAGES for example in examples_of(page) if not example.not_here]


def prompts_of_page(page: str) -> dict[str, object]:
    """Every prompt the page's prompts.yaml examples define, merged."""
    merged: dict[str, object] = {}
    for example in examples_of(page):
        if example.kind == "prompts":
            merged.update(example.yaml()["prompts"])
    return merged


def cells_for(prompts: dict[str, dict[str, object]]) -> str:
    """A cells.yaml that gives each prompt a cell of the kind it needs."""
    by_cell: dict[str, list[str]] = {}
    for prompt_id, prompt in prompts.items():
        name = ONE_CELL_KINDS.get(str(prompt.get("kind", "chat")), "")
        by_cell.setdefault(name, []).append(prompt_id)
    lines = []
    for name, ids in by_cell.items():
        named = f", name: {name}" if name else ""
        args = "[--threads, '1']" if name else GENERATING_ARGS
        lines.append(
            f"  - {{node: local, engine: llamacpp, model: tiny{named}, server_args: {args}, "
            f"phases: [warm], prompts: [{', '.join(ids)}]}}\n"
        )
    return "nodes: {local: {kind: local}}\ncells:\n" + "".join(lines)


def example_files(root: Path, prompts: dict[str, dict[str, object]]) -> None:
    """The files the examples name (EXAMPLE_FILES), and the image files an image prompt names
    (a red PNG), where the YAML finds them."""
    for name, source in EXAMPLE_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, root / name)
    for prompt in prompts.values():
        for name in prompt.get("images") or []:  # type: ignore[attr-defined]
            path = root / str(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(png(255))


def assert_documented(example: Example, status: int, output: str) -> None:
    assert status == example.exit_status, f"{example.id}: exit {status}\n{output[-5000:]}"
    lines = output.splitlines()
    for shown in example.shows:
        import fnmatch

        assert any(fnmatch.fnmatch(line, shown) for line in lines), (
            f"{example.id}: no line {shown!r}\n{output[-5000:]}"
        )


def run_yaml_example(pytester: pytest.Pytester, example: Example) -> None:
    if example.kind == "prompts":
        prompts = example.yaml()["prompts"]
        pytester.makefile(".yaml", prompts=example.text, cells=cells_for(prompts))
    else:
        prompts = {**yaml.safe_load(template_text("prompts.yaml"))["prompts"]}
        prompts.update(prompts_of_page(example.page))
        pytester.makefile(".yaml", prompts=yaml.safe_dump({"prompts": prompts}), cells=example.text)
    example_files(pytester.path, prompts)
    pytester.mkdir("benchmarks")
    shutil.copy(INFERENCE_TEST, pytester.path / "benchmarks" / "test_inference.py")
    result = pytester.runpytest("benchmarks/", *RUN_OPTIONS)
    output = result.stdout.str() + result.stderr.str()
    assert_documented(example, int(result.ret), output)
    assert result.parseoutcomes().get("failed", 0) == 0, output[-5000:]


def run_commands_example(tmp_path: Path, example: Example) -> None:
    """In a new git repository: one `cd your-repository` goes into (the quick start writes its
    files with `gpubench init`), or, for commands run in a project, the project `gpubench init`
    writes, committed, with a test of its own beside the benchmarks."""
    repository = tmp_path / "your-repository"
    repository.mkdir()
    commands = example.commands()
    git = ("git", "-c", "user.email=t@t", "-c", "user.name=t")
    subprocess.run([*git, "init", "-q"], cwd=repository, check=True)
    in_project = not commands[0].startswith("cd ")
    if in_project:
        init = [sys.executable, "-m", "pytest_gpubench.cli.main", "init"]
        subprocess.run(init, cwd=repository, check=True, capture_output=True)
        (repository / "tests").mkdir()
        (repository / "tests" / "test_unit.py").write_text("def test_unit():\n    assert True\n")
        subprocess.run([*git, "add", "-A"], cwd=repository, check=True)
        subprocess.run([*git, "commit", "-qm", "benchmarks"], cwd=repository, check=True)
    environment = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(sys.path),
        "PYTEST_ADDOPTS": "--force-load --gpubench-runs 5 -p no:cacheprovider",
        "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
    }  # fmt: skip
    script = "set -e\n" + "\n".join(commands) + "\n"
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=repository if in_project else tmp_path, env=environment, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert_documented(example, done.returncode, done.stdout + done.stderr)


@pytest.mark.engine
@pytest.mark.parametrize("example", RUN, ids=lambda example: example.id)
def test_the_example_runs_as_its_page_says(
    example: Example, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    if example.kind == "commands":
        run_commands_example(tmp_path, example)
    else:
        run_yaml_example(pytester, example)


def test_every_example_in_the_docs_runs_or_says_why_not() -> None:
    """Every example of every page is run above or carries its reason (more than a word); the
    counts per page are printed."""
    counts: dict[str, Counter[str]] = {}
    for page in RUN_PAGES:
        for example in examples_of(page):
            count = counts.setdefault(page, Counter())
            count["examples"] += 1
            count["not here" if example.not_here else "run"] += 1
            assert example.not_here is None or len(example.not_here) > 10, example.id
    print("\n".join(f"{page}: {dict(count)}" for page, count in counts.items()))
    assert all(counts[page]["run"] > 0 for page in FIRST_PAGES)
    assert sum(count["run"] for count in counts.values()) == len(RUN)
