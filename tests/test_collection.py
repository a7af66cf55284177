"""Collection: case ids, markers, -m selection, ordering, --gpubench-runs, --smoke, xdist order."""

from __future__ import annotations

import json

import pytest

from pytest_gpubench.ledger.writer import read_ledger

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}
  P-MEDIUM: {intent: longer, prompt: "Say hello twice.", max_tokens: 8}
"""
# Skipped cells collect like any other but never touch an engine.
CELLS = """\
nodes:
  local: {kind: local}
  pavilion: {kind: ssh, host: 127.0.0.1, user: bench}
cells:
  - {node: pavilion, engine: ollama, model: "qwen3.5:0.8b", endpoint: "http://127.0.0.1:9", runs: 2,
     skip: "box is off"}
  - {node: local, engine: llamacpp, model: tiny, runs: 2, skip: "not today"}
"""


@pytest.fixture
def bench_dir(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makefile(".yaml", prompts=PROMPTS, cells=CELLS)
    pytester.makepyfile(
        test_bench="""
        def test_plain():
            pass

        def test_generate(gpubench_case):
            gpubench_case.run()
        """
    )
    return pytester


def collected(result: pytest.RunResult) -> list[str]:
    return [line for line in result.outlines if "::" in line]


def test_ids_order_cells_together_and_cold_first(bench_dir: pytest.Pytester) -> None:
    result = bench_dir.runpytest("--collect-only", "-q")
    cell = "pavilion:ollama:qwen3.5:0.8b"
    assert collected(result) == [
        "test_bench.py::test_plain",
        f"test_bench.py::test_generate[{cell}-P-EASY-cold-0]",
        f"test_bench.py::test_generate[{cell}-P-MEDIUM-cold-0]",
        f"test_bench.py::test_generate[{cell}-P-EASY-warm-0]",
        f"test_bench.py::test_generate[{cell}-P-EASY-warm-1]",
        f"test_bench.py::test_generate[{cell}-P-MEDIUM-warm-0]",
        f"test_bench.py::test_generate[{cell}-P-MEDIUM-warm-1]",
        "test_bench.py::test_generate[local:llamacpp:tiny-P-EASY-cold-0]",
        "test_bench.py::test_generate[local:llamacpp:tiny-P-MEDIUM-cold-0]",
        "test_bench.py::test_generate[local:llamacpp:tiny-P-EASY-warm-0]",
        "test_bench.py::test_generate[local:llamacpp:tiny-P-EASY-warm-1]",
        "test_bench.py::test_generate[local:llamacpp:tiny-P-MEDIUM-warm-0]",
        "test_bench.py::test_generate[local:llamacpp:tiny-P-MEDIUM-warm-1]",
    ]


def test_markers_select_phases(bench_dir: pytest.Pytester) -> None:
    warm = collected(bench_dir.runpytest("--collect-only", "-q", "-m", "warm", "--strict-markers"))
    cold = collected(bench_dir.runpytest("--collect-only", "-q", "-m", "cold", "--strict-markers"))
    assert len(warm) == 8 and all("-warm-" in line for line in warm)
    assert len(cold) == 4 and all("-cold-" in line for line in cold)


def test_gpubench_runs_raises_warm_n(bench_dir: pytest.Pytester) -> None:
    result = bench_dir.runpytest("--collect-only", "-q", "-m", "warm", "--gpubench-runs", "20")
    assert len(collected(result)) == 2 * 2 * 20


def test_smoke_runs_one_case(bench_dir: pytest.Pytester) -> None:
    bench_dir.makefile(
        ".yaml",
        cells=CELLS
        + "  - {node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:9'}\n",
    )
    result = bench_dir.runpytest("--collect-only", "-q", "--smoke", "-k", "generate")
    assert collected(result) == ["test_bench.py::test_generate[local:openai:m-P-EASY-warm-0]"]


def test_unavailable_cells_are_skipped_with_reason_and_recorded(bench_dir: pytest.Pytester) -> None:
    result = bench_dir.runpytest("-rs", "--force-load")
    result.assert_outcomes(passed=1, skipped=12)
    result.stdout.fnmatch_lines(["*SKIPPED*skip: box is off*", "*SKIPPED*skip: not today*"])
    (ledger,) = (bench_dir.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    assert records[0]["type"] == "meta" and records[-1]["type"] == "end"
    skipped = [r for r in records if r["type"] == "skipped"]
    assert len(skipped) == 12
    assert {r["reason"] for r in skipped} == {"skip: box is off", "skip: not today"}


def test_same_order_on_every_xdist_worker(bench_dir: pytest.Pytester) -> None:
    """xdist refuses to run when workers collect different orders; every case must still report."""
    pytest.importorskip("xdist")
    result = bench_dir.runpytest("-n", "2", "--force-load", "-p", "xdist")
    result.assert_outcomes(passed=1, skipped=12)
    (ledger,) = (bench_dir.path / "runs").glob("*.jsonl")
    kinds = [json.loads(line)["type"] for line in ledger.read_text().splitlines()]
    assert kinds.count("skipped") == 12 and kinds[0] == "meta" and kinds[-1] == "end"


def test_every_case_gets_a_timeout_from_its_cell(pytester: pytest.Pytester) -> None:
    """pytest-timeout guards each case; the engine's own stream timeout (timeout_s) fires first."""
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="settings: {timeout_s: 10}\nnodes: {local: {kind: local}}\ncells:\n"
        "  - {node: local, engine: openai, model: a, endpoint: 'http://127.0.0.1:9', skip: later}\n"
        "  - {node: local, engine: openai, model: b, endpoint: 'http://127.0.0.1:9', skip: later,"
        " timeout_s: 100}\n",
    )
    pytester.makeconftest(
        """
        def pytest_collection_finish(session):
            for item in session.items:
                print("TIMEOUT", item.callspec.id, item.get_closest_marker("timeout").args[0])
        """
    )
    pytester.makepyfile(test_bench="def test_generate(gpubench_case):\n    pass\n")
    result = pytester.runpytest("--collect-only", "-q", "-s")
    result.stdout.fnmatch_lines(
        ["TIMEOUT local:openai:a-P-EASY-cold-0 200.0", "TIMEOUT local:openai:b-P-EASY-cold-0 380.0"]
    )


def test_non_ascii_names_under_xdist(pytester: pytest.Pytester) -> None:
    """pytest escapes `modèle` in node ids; the controller must still recognize the cases."""
    pytest.importorskip("xdist")
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        "  - {node: local, engine: openai, model: modèle, endpoint: 'http://127.0.0.1:9',"
        " runs: 1, skip: later}\n",
    )
    pytester.makepyfile(test_bench="def test_generate(gpubench_case):\n    gpubench_case.run()\n")
    result = pytester.runpytest("-n", "2", "-p", "xdist", "--force-load")
    result.assert_outcomes(skipped=4)
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    assert records[0]["cases_planned"] == 4
    assert {r["cell_id"] for r in records if r["type"] == "skipped"} == {"local:openai:modèle"}


@pytest.mark.parametrize(
    ("args", "ini", "expected"),
    [
        (["--gpubench-runs", "0"], "", "ERROR: --gpubench-runs: must be at least 1 (got 0)"),
        (["--gpubench-runs", "-3"], "", "ERROR: --gpubench-runs: must be at least 1 (got -3)"),
        ([], "gpubench_runs = 0", "ERROR: ini gpubench_runs: must be at least 1 (got 0)"),
    ],
    ids=["option-0", "option-negative", "ini-0"],
)
def test_zero_runs_is_a_usage_error_not_the_default(
    bench_dir: pytest.Pytester, args: list[str], ini: str, expected: str
) -> None:
    """0 used to fall through to the cells' runs (`0 or default`) and silently run 2 here."""
    if ini:
        bench_dir.makeini(f"[pytest]\n{ini}\n")
    result = bench_dir.runpytest("--collect-only", "-q", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.errlines if line.strip()] == [expected]
    assert not collected(result)


def test_one_run_is_one_warm_case_per_prompt(bench_dir: pytest.Pytester) -> None:
    result = bench_dir.runpytest("--collect-only", "-q", "-m", "warm", "--gpubench-runs", "1")
    assert result.ret == pytest.ExitCode.OK
    assert len(collected(result)) == 2 * 2
