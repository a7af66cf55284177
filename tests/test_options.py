"""Options as users have them: `--gpubench-` names, short aliases that yield to other plugins'
and conftests' options, `--gpubench-skip`, paths from any working directory, and a benchmark
test that forgets to measure."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support.standins import OllamaStandin, serving

from pytest_gpubench.ledger.writer import read_ledger

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}
  P-MEDIUM: {intent: longer, prompt: "Say hello twice.", max_tokens: 6}
"""
BENCH_TEST = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
UNIT_TEST = "def test_unit():\n    assert 1 + 1 == 2\n"
# Another project's conftest with options of its own under two of the plugin's short names.
CONFTEST_WITH_SMOKE_AND_PROBE = """
def pytest_addoption(parser):
    parser.addoption("--smoke", action="store_true", help="the project's own smoke suite")
    parser.addoption("--probe", action="store", default="none", help="the project's own probe")

def pytest_report_header(config):
    return f"project smoke={config.getoption('smoke')} probe={config.getoption('probe')}"
"""


def cells(url: str, runs: int = 2) -> str:
    return (
        "nodes:\n  local: {kind: local}\ncells:\n"
        f"  - {{node: local, engine: ollama, model: 'qwen3.5:0.8b', endpoint: '{url}', "
        f"runs: {runs}}}\n"
    )


def calls_in(runs_dir: Path) -> list[dict[str, object]]:
    (ledger,) = runs_dir.glob("*.jsonl")
    records = read_ledger(ledger)
    return [record for record in records if record["type"] == "call"]


def test_a_conftest_defining_smoke_and_probe_still_runs(pytester: pytest.Pytester) -> None:
    """Before: `ValueError: option dest 'smoke' already used` and pytest did not start."""
    pytester.makeconftest(CONFTEST_WITH_SMOKE_AND_PROBE)
    with serving(OllamaStandin()) as url:
        pytester.makefile(".yaml", prompts=PROMPTS, cells=cells(url, runs=3))
        pytester.makepyfile(test_bench=BENCH_TEST, test_unit=UNIT_TEST)
        theirs = pytester.runpytest(
            "--smoke", "--probe", "deep", "-m", "not cold", "--gpubench-force-load"
        )
        ours = pytester.runpytest(
            "--gpubench-smoke", "--gpubench-force-load", "--gpubench-ledger-dir", "smoke"
        )
        probe = pytester.runpytest("--gpubench-probe")
    # Their --smoke and --probe mean what their conftest says; every warm case ran.
    theirs.stdout.fnmatch_lines(["project smoke=True probe=deep"])
    theirs.assert_outcomes(passed=1 + 2 * 3)
    assert theirs.ret == pytest.ExitCode.OK
    # The plugin's own switches under their --gpubench- names.
    ours.stdout.fnmatch_lines(["project smoke=False probe=none"])
    ours.assert_outcomes(passed=2)  # the unit test and the one smoke case
    assert [c["run_idx"] for c in calls_in(pytester.path / "smoke")] == [0]
    assert probe.ret == pytest.ExitCode.OK
    probe.stdout.fnmatch_lines(["*gpubench probe*", "local:ollama:qwen3.5:0.8b*ok*"])


def test_a_plugin_loaded_before_ours_keeps_its_option(pytester: pytest.Pytester) -> None:
    """A `-p` plugin registers before the installed ones: its --allow-dirty is its own, and
    passing it tells the user which name reaches gpubench."""
    pytester.makepyfile(
        other_plugin="""
        def pytest_addoption(parser):
            parser.addoption("--allow-dirty", action="store", default="no")

        def pytest_report_header(config):
            return f"other allow_dirty={config.getoption('allow_dirty')}"
        """,
        test_unit=UNIT_TEST,
    )
    pytester.syspathinsert()
    result = pytester.runpytest("-p", "other_plugin", "--allow-dirty", "yes")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "other allow_dirty=yes",
            "*--allow-dirty is another plugin's or conftest's option here, not gpubench's; "
            "use --gpubench-allow-dirty*",
        ]
    )


def test_short_aliases_work_where_nothing_else_has_them(pytester: pytest.Pytester) -> None:
    with serving(OllamaStandin()) as url:
        pytester.makefile(".yaml", prompts=PROMPTS, cells=cells(url, runs=3))
        pytester.makepyfile(test_bench=BENCH_TEST)
        result = pytester.runpytest("--smoke", "--force-load", "--allow-dirty")
    result.assert_outcomes(passed=1)
    help_text = pytester.runpytest("--help").stdout.str()
    for name in ("--gpubench-smoke", "--smoke", "--gpubench-skip", "--gpubench-baseline-update"):
        assert name in help_text


def test_gpubench_skip_runs_only_the_other_tests(pytester: pytest.Pytester) -> None:
    """No guard, no ledger, and the matrix is not even read (a broken cells.yaml is fine)."""
    pytester.makeini("[pytest]\ngpubench_load_threshold = -1\n")  # the load guard would refuse
    pytester.makefile(".yaml", prompts=PROMPTS, cells="nodes: {local: {kind: lokal}}\n")
    pytester.makepyfile(test_bench=BENCH_TEST, test_unit=UNIT_TEST)
    skipped = pytester.runpytest("--gpubench-skip", "-v")
    plain = pytester.runpytest()
    assert skipped.ret == pytest.ExitCode.OK
    skipped.assert_outcomes(passed=1, deselected=1)
    skipped.stdout.fnmatch_lines(["test_unit.py::test_unit PASSED*"])
    assert not (pytester.path / "runs").exists()
    assert plain.ret == pytest.ExitCode.USAGE_ERROR  # without the switch the matrix is read


def test_guards_apply_only_when_benchmark_cases_are_selected(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpubench_load_threshold = -1\n")
    with serving(OllamaStandin()) as url:
        pytester.makefile(".yaml", prompts=PROMPTS, cells=cells(url))
        pytester.makepyfile(test_bench=BENCH_TEST, test_unit=UNIT_TEST)
        units = pytester.runpytest("-k", "test_unit")
        benchmarks = pytester.runpytest()
    assert units.ret == pytest.ExitCode.OK
    units.assert_outcomes(passed=1, deselected=6)
    assert benchmarks.ret == pytest.ExitCode.USAGE_ERROR
    benchmarks.stderr.fnmatch_lines(["ERROR: 1-minute load average is *--gpubench-force-load"])


def test_a_benchmark_test_that_never_measures_fails(pytester: pytest.Pytester) -> None:
    with serving(OllamaStandin()) as url:
        pytester.makefile(".yaml", prompts=PROMPTS, cells=cells(url, runs=1))
        pytester.makepyfile(
            test_bench="""
            def test_forgot(gpubench_case):
                assert gpubench_case.case.prompt_id

            def test_measured(gpubench_case):
                gpubench_case.run()
            """
        )
        result = pytester.runpytest("--gpubench-force-load", "-m", "warm")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_forgot*P-EASY-warm-0* asked for gpubench_case but never called "
            "gpubench_case.run(): nothing was measured",
        ]
    )


# -- paths ----------------------------------------------------------------------------------------


def commit(path: Path) -> None:
    for args in (("add", "-A"), ("commit", "-qm", "bench")):
        subprocess.run(
            ["git", "-C", str(path), "-c", "user.email=t@t", "-c", "user.name=t", *args],
            check=True, capture_output=True,
        )  # fmt: skip


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A git repository with benchmarks in benchmarks/, and a sub/ to run from."""
    subprocess.run(["git", "init", "-q", str(pytester.path)], check=True)
    (pytester.path / ".gitignore").write_text("runs/\n")
    pytester.mkdir("benchmarks")
    pytester.mkdir("sub")
    (pytester.path / "benchmarks" / "test_bench.py").write_text(BENCH_TEST)
    return pytester


def test_a_run_from_a_subdirectory_finds_the_files_at_the_git_root(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: pytest's rootdir became benchmarks/ and collection ended in a traceback."""
    with serving(OllamaStandin()) as url:
        project.makefile(".yaml", prompts=PROMPTS, cells=cells(url, runs=1))
        commit(project.path)
        monkeypatch.chdir(project.path / "benchmarks")
        inside = project.runpytest("--gpubench-force-load", "-m", "warm")
        monkeypatch.chdir(project.path / "sub")
        beside = project.runpytest("../benchmarks", "--gpubench-force-load", "-m", "warm")
    inside.assert_outcomes(passed=2)
    beside.assert_outcomes(passed=2)
    ledgers = list((project.path / "runs").glob("*.jsonl"))
    assert len(ledgers) == 2
    assert not (project.path / "benchmarks" / "runs").exists()


def test_an_absolute_path_as_a_separate_argument(
    project: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`--gpubench-baselines /abs/dir` made pytest take /abs/dir for a test path and move the
    rootdir there; the files are still found, and the baselines go where they were asked to."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    with serving(OllamaStandin()) as url:
        # 4 warm runs: the fewest whose baseline can ever be significant against 4 later ones
        # (1/C(8, 4) < 0.05); --baseline-update refuses fewer.
        project.makefile(".yaml", prompts=PROMPTS, cells=cells(url, runs=4))
        result = project.runpytest(
            "benchmarks",
            "--gpubench-baselines",
            str(elsewhere),
            "--gpubench-ledger-dir",
            str(elsewhere / "runs"),
            "--gpubench-baseline-update",
            "--gpubench-force-load",
            "--gpubench-allow-dirty",
        )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=10)
    assert [p.name for p in elsewhere.glob("*.json")] == ["local_ollama_qwen3.5_0.8b.json"]
    assert len(calls_in(elsewhere / "runs")) == 10


def test_ini_values_resolve_against_the_ini_file_and_options_against_the_cwd(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.makeini("[pytest]\ngpubench_cells = matrix/cells.yaml\ngpubench_ledger_dir = out\n")
    (project.path / ".gitignore").write_text("out/\n")
    with serving(OllamaStandin()) as url:
        project.mkdir("matrix")
        (project.path / "matrix" / "cells.yaml").write_text(cells(url, runs=1))
        (project.path / "prompts.yaml").write_text(PROMPTS)
        (project.path / "sub" / "other.yaml").write_text(PROMPTS.replace("P-MEDIUM", "P-OTHER"))
        commit(project.path)
        monkeypatch.chdir(project.path / "sub")
        result = project.runpytest(
            "../benchmarks",
            "--gpubench-prompts",
            "other.yaml",
            "--gpubench-force-load",
            "-m",
            "warm",
        )
    result.assert_outcomes(passed=2)
    assert {c["prompt_id"] for c in calls_in(project.path / "out")} == {"P-EASY", "P-OTHER"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "ERROR: */cells.yaml: not found; test_generate needs the cell matrix (looked in the git root; run `gpubench init` there, or pass --gpubench-cells PATH)"),
        (("--gpubench-cells", "nowhere.yaml"), "ERROR: */nowhere.yaml: file not found"),
        (("--gpubench-baselines", "prompts.yaml"), "ERROR: */prompts.yaml: the baselines must be a directory, not a file (--gpubench-baselines)"),
        (("--gpubench-ledger-dir", "prompts.yaml"), "ERROR: */prompts.yaml: the ledger directory must be a directory, not a file (--gpubench-ledger-dir)"),
        (("--gpubench-ledger-dir", "prompts.yaml/runs", "--gpubench-cells", "matrix.yaml"), "ERROR: */prompts.yaml/runs/*.jsonl: cannot create the ledger: *"),
    ],
)  # fmt: skip
def test_every_path_problem_is_one_line_exit_4(
    project: pytest.Pytester, args: tuple[str, ...], message: str
) -> None:
    (project.path / "prompts.yaml").write_text(PROMPTS)
    (project.path / "matrix.yaml").write_text(cells("http://127.0.0.1:9"))
    result = project.runpytest(
        "benchmarks", "--gpubench-force-load", "--gpubench-allow-dirty", *args
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_a_missing_matrix_under_xdist_is_one_line_per_worker(project: pytest.Pytester) -> None:
    """Workers collect, the controller does not: each worker's collection error says why."""
    pytest.importorskip("xdist")
    (project.path / "prompts.yaml").write_text(PROMPTS)
    result = project.runpytest("benchmarks", "-n", "2")
    assert result.ret not in (pytest.ExitCode.OK, pytest.ExitCode.INTERNAL_ERROR)
    result.stdout.fnmatch_lines(["*/cells.yaml: not found; test_generate needs the cell matrix*"])
    assert "INTERNALERROR" not in result.stdout.str()
    assert "Traceback" not in result.stdout.str()


def test_a_path_value_pytest_took_for_a_test_path_is_named(
    project: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With no test path given, pytest reads `/abs/dir` as one before the plugin is loaded and
    misses the ini file; the gpubench files are still found, and the warning says what to write."""
    elsewhere = tmp_path_factory.mktemp("baselines")
    project.makeini("[pytest]\naddopts = -p no:cacheprovider\n")
    project.makepyfile(test_unit=UNIT_TEST)
    result = project.runpytest("--gpubench-skip", "--gpubench-baselines", str(elsewhere))
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "*pytest found no ini file: it took the value of --gpubench-baselines for a test path*"
            f"write --gpubench-baselines={elsewhere} to keep its ini file and rootdir",
        ]
    )
    joined = project.runpytest("--gpubench-skip", f"--gpubench-baselines={elsewhere}")
    assert "pytest found no ini file" not in joined.stdout.str()
    joined.stdout.fnmatch_lines(["configfile: tox.ini"])
