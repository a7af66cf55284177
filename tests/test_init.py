"""`gpubench init`: a repository's first steps, from an empty git repository to a passing
`pytest benchmarks/`, a subdirectory run, `--gpubench-skip`, and a CI workflow."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from pytest_gpubench.cli.init import template_text

REPOSITORY = Path(__file__).resolve().parent.parent
GPUBENCH = [sys.executable, "-m", "pytest_gpubench.cli.main"]
STARTER_FILES = (
    "cells.yaml",
    "prompts.yaml",
    "benchmarks/test_inference.py",
    ".github/workflows/gpubench.yml",
)


def gpubench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUBENCH, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def git(path: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(path), "-c", "user.email=t@t", "-c", "user.name=t", *args],
        check=True, capture_output=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("template", "shipped"),
    [
        ("cells.yaml", "cells.yaml"),
        ("prompts.yaml", "prompts.yaml"),
        ("test_inference.py.txt", "benchmarks/test_inference.py"),
    ],
)
def test_templates_are_this_repositorys_files(template: str, shipped: str) -> None:
    """One content: the embedded default and the canonical prompts cannot drift apart."""
    assert template_text(template) == (REPOSITORY / shipped).read_text(encoding="utf-8")


def test_init_writes_the_starter_files_and_keeps_existing_ones(tmp_path: Path) -> None:
    (tmp_path / ".gitignore").write_text("*.pyc")  # no newline at the end
    first = gpubench("init", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    for name in STARTER_FILES:
        assert f"wrote {name}" in first.stdout
        assert (tmp_path / name).is_file()
    assert "added runs/ to .gitignore" in first.stdout
    assert (tmp_path / ".gitignore").read_text().splitlines()[0] == "*.pyc"

    (tmp_path / "cells.yaml").write_text("# mine\n")
    again = gpubench("init", str(tmp_path), cwd=REPOSITORY)
    assert again.returncode == 0
    for name in STARTER_FILES:
        assert f"kept {name} (it exists; --force overwrites it)" in again.stdout
    assert "kept .gitignore (it already ignores runs/)" in again.stdout
    assert (tmp_path / "cells.yaml").read_text() == "# mine\n"
    assert (tmp_path / ".gitignore").read_text().splitlines().count("runs/") == 1

    forced = gpubench("init", "--force", cwd=tmp_path)
    assert forced.returncode == 0
    assert "wrote cells.yaml" in forced.stdout
    assert (tmp_path / "cells.yaml").read_text() == (REPOSITORY / "cells.yaml").read_text()


def test_init_respects_a_gitignore_that_already_has_runs(tmp_path: Path) -> None:
    (tmp_path / ".gitignore").write_text("/runs\n")
    done = gpubench("init", cwd=tmp_path)
    assert done.returncode == 0
    assert (tmp_path / ".gitignore").read_text() == "/runs\n"


def test_init_into_a_new_directory_and_onto_a_file(tmp_path: Path) -> None:
    made = gpubench("init", "project/inner", cwd=tmp_path)
    assert made.returncode == 0
    assert (tmp_path / "project" / "inner" / "benchmarks" / "test_inference.py").is_file()
    (tmp_path / "plain").write_text("")
    refused = gpubench("init", "plain", cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip() == "gpubench: error: plain: not a directory"


def test_the_workflow_runs_the_gate_and_keeps_ledger_and_report(tmp_path: Path) -> None:
    gpubench("init", cwd=tmp_path)
    workflow = yaml.safe_load((tmp_path / ".github/workflows/gpubench.yml").read_text())
    steps = workflow["jobs"]["gate"]["steps"]
    runs = {step.get("name"): step.get("run", "") for step in steps}
    version = metadata.version("pytest-gpubench")
    assert f'pip install "pytest-gpubench=={version}"' in runs["Install pytest-gpubench"]
    assert "gpubench install-server" in runs["llama-server and the tiny model"]
    assert runs["Regression gate"] == "pytest benchmarks/"
    (report,) = [step for step in steps if step.get("name") == "Report"]
    assert report["run"].splitlines()[0] == "gpubench report runs/*.jsonl -o report.md"
    # The HTML report too: the pull request summary points at it in the run's artifacts.
    assert report["run"].splitlines()[1] == "gpubench report --html runs/*.jsonl -o report.html"
    assert "always()" in report["if"]
    (upload,) = [step for step in steps if "upload-artifact" in step.get("uses", "")]
    assert "always()" in upload["if"]
    assert upload["with"]["path"].split() == ["runs/", "report.md", "report.html"]
    # The report step runs after the gate, the upload after the report.
    names = [step.get("name") for step in steps]
    assert names.index("Regression gate") < names.index("Report") < steps.index(upload)


@pytest.mark.engine
def test_init_then_commit_then_pytest_benchmarks_passes(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    llama_server: Path,
    tiny_model: Path,
) -> None:
    """The user's path: an empty repository, `gpubench init`, commit, `pytest benchmarks/`.
    --gpubench-force-load only because this machine is shared: the load guard would refuse.
    The starter matrix's 20 warm runs a prompt are collected as shipped, then measured with
    --gpubench-runs 2: its P-MEDIUM and P-HARD generate 512 and 1,024 tokens a call, and what
    the run shows does not depend on how many calls it makes."""
    root = pytester.path
    git(root, "init", "-q")
    assert gpubench("init", cwd=root).returncode == 0
    pytester.mkdir("tests")
    (root / "tests" / "test_unit.py").write_text("def test_unit():\n    assert True\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "benchmarks")

    planned = pytester.runpytest("benchmarks/", "-p", "no:cacheprovider", "--collect-only", "-q")
    assert planned.ret == pytest.ExitCode.OK, planned.stdout.str()
    # 3 prompts, a cold case and 20 warm runs each
    planned.stdout.fnmatch_lines([f"{3 * (1 + 20)} tests collected*"])
    gate = pytester.runpytest(
        "benchmarks/", "-p", "no:cacheprovider", "--gpubench-force-load", "--gpubench-runs", "2"
    )
    assert gate.ret == pytest.ExitCode.OK, gate.stdout.str()
    gate.assert_outcomes(passed=3 * (1 + 2))  # 3 prompts, a cold case and 2 warm runs each
    gate.stdout.fnmatch_lines(["*local:llamacpp:tiny*P-HARD*new*", f"ledger: {root}/runs/*.jsonl"])

    monkeypatch.chdir(root / "benchmarks")
    inside = pytester.runpytest(
        "-p", "no:cacheprovider", "--gpubench-force-load", "--gpubench-smoke"
    )
    assert inside.ret == pytest.ExitCode.OK, inside.stdout.str()
    inside.assert_outcomes(passed=1)
    assert len(list((root / "runs").glob("*.jsonl"))) == 2
    assert not (root / "benchmarks" / "runs").exists()

    monkeypatch.chdir(root)
    units = pytester.runpytest("-p", "no:cacheprovider", "--gpubench-skip", "-v")
    assert units.ret == pytest.ExitCode.OK
    units.assert_outcomes(passed=1, deselected=1)  # the test, not parametrized
    units.stdout.fnmatch_lines(["tests/test_unit.py::test_unit PASSED*"])
    assert len(list((root / "runs").glob("*.jsonl"))) == 2  # no ledger without benchmarks
