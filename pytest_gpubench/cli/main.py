"""The `gpubench` command, every subcommand: init, install-server, make-model, report, history,
export, compare, merge, gate, calibrate, slurm submit, rentals."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpubench.cli import judge_commands
from pytest_gpubench.core.errors import GpubenchError

if TYPE_CHECKING:
    from pytest_gpubench.reports.frame import LedgerData


def _init(args: argparse.Namespace) -> int:
    from pytest_gpubench.cli.init import NEXT_STEPS, init_project

    for line in init_project(Path(args.directory), force=args.force):
        print(line)
    print(NEXT_STEPS)
    return 0


def _install_server(args: argparse.Namespace) -> int:
    """Install (or find, or build) the llama.cpp server the embedded default runs, say which
    and why, and print what starts it: a binary's path, or the prebuilt server's launcher."""
    from pytest_gpubench.engines.llamacpp_build import (
        CMAKE_FLAGS,
        build_llama_server,
        cuda_flags,
    )
    from pytest_gpubench.engines.llamacpp_choice import choose_llama_server, ensure_installed
    from pytest_gpubench.engines.llamacpp_prebuilt import BUILD_ENV

    def say(line: str) -> None:
        print(line, flush=True)

    started = time.monotonic()
    if args.cuda or args.sdist:
        if args.binary:
            raise GpubenchError(
                "install-server: --binary cannot be combined with --cuda or --sdist"
            )
        flags = cuda_flags(args.cuda_arch) if args.cuda else CMAKE_FLAGS
        sdist = Path(args.sdist).expanduser() if args.sdist else None
        binary = build_llama_server(progress=say, flags=flags, sdist=sdist)
        say(f"llama-server ready in {time.monotonic() - started:.0f} s")
        print(binary)
        return 0
    environ = {**os.environ, BUILD_ENV: "1"} if args.build else None
    choice = choose_llama_server(args.binary, environ=environ)
    say(choice.describe())
    installed = ensure_installed(choice, progress=say, check=True)
    say(f"ready in {time.monotonic() - started:.1f} s")
    print(" ".join(installed.command))
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from pytest_gpubench.engines.tinymodel import ensure_tiny_model, write_tiny_model

    if args.output:
        digest = write_tiny_model(Path(args.output), seed=args.seed)
        print(f"{args.output} sha256:{digest}")
    else:
        print(ensure_tiny_model())
    return 0


def _report(args: argparse.Namespace) -> int:
    from pytest_gpubench.reports.frame import read_ledger_frame
    from pytest_gpubench.reports.markdown import render_document

    data = read_ledger_frame(Path(args.ledger))
    if args.html:
        text = _html_report(data, args.baselines)
    else:
        from pytest_gpubench.results.judging_settings import unchecked_cells

        text = render_document(
            data.others,
            data.summaries(with_samples=data.has_validity()),
            data.telemetry(),
            data.engine_checks(unchecked_cells(data.meta)),
        )
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(args.output)
    else:
        sys.stdout.write(text)
    return 0


def _html_report(data: LedgerData, baselines: str | None) -> str:
    """The HTML report, against the baselines of --baselines, or else of baselines/ in the run's
    rootdir (from the meta record) or in the current directory, where one exists."""
    from pytest_gpubench.reports.html import render_html
    from pytest_gpubench.results.baseline import baseline_summaries
    from pytest_gpubench.results.load_baseline import read_load_baselines

    found = _baselines_dir(data, baselines)
    cell_ids = {str(cell_id) for cell_id in data.calls["cell_id"].dropna().unique()}
    baseline = baseline_summaries(found, cell_ids) if found is not None else []
    load_cells = {str(record.get("cell_id")) for record in data.of_type("load")}
    read_baselines = read_load_baselines(found, load_cells) if found is not None else None
    return render_html(
        data,
        baseline,
        baseline_source=str(found) if found else None,
        read_baselines=read_baselines,
    )


def _baselines_dir(data: LedgerData, named: str | None) -> Path | None:
    if named is not None:
        path = Path(named)
        if not path.is_dir():
            raise GpubenchError(f"{path}: --baselines is not a directory")
        return path
    rootdir = data.meta.get("rootdir")
    candidates = [Path(rootdir) / "baselines"] if isinstance(rootdir, str) else []
    candidates.append(Path("baselines"))
    return next((path for path in candidates if path.is_dir()), None)


def _history(args: argparse.Namespace) -> int:
    from pytest_gpubench.reports.history import read_history, render_history, render_history_html

    history = read_history(Path(args.directory))
    if args.html:
        output = Path(args.output or "history.html")
        _write_text(output, render_history_html(history))
        print(output)
    elif args.output:
        _write_text(Path(args.output), render_history(history) + "\n")
        print(args.output)
    else:
        print(render_history(history))
    return 0


def _export(args: argparse.Namespace) -> int:
    from pytest_gpubench.reports.exports import (
        write_csv,
        write_json,
        write_load_csv,
        write_load_slices_csv,
        write_prometheus,
    )
    from pytest_gpubench.reports.frame import read_ledger_frame

    if not (args.prometheus or args.csv or args.json or args.load_csv or args.load_slices_csv):
        raise GpubenchError(
            "export: name at least one of --prometheus, --csv, --json, --load-csv, "
            "--load-slices-csv"
        )
    data = read_ledger_frame(Path(args.ledger), export=bool(args.csv))
    from pytest_gpubench.results.judging_settings import unchecked_cells

    # The valid rates of the JSON and Prometheus need the samples of a tools or json_schema
    # prompt; the engine checks are read once for both.
    wanted = bool(args.json or args.prometheus)
    summaries = data.summaries(with_samples=wanted and data.has_validity())
    checks = data.engine_checks(unchecked_cells(data.meta)) if wanted else []
    if args.prometheus:
        write_prometheus(data, summaries, Path(args.prometheus), checks)
        print(args.prometheus)
    if args.csv:
        rows = write_csv(data, Path(args.csv))
        print(f"{args.csv} ({rows} call records)")
    if args.load_csv:
        rows = write_load_csv(data, Path(args.load_csv))
        print(f"{args.load_csv} ({rows} load records)")
    if args.load_slices_csv:
        rows = write_load_slices_csv(data, Path(args.load_slices_csv))
        print(f"{args.load_slices_csv} ({rows} slices)")
    if args.json:
        write_json(data, summaries, Path(args.json), checks)
        print(args.json)
    return 0


def _write_text(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot write: {exc.strerror or exc}") from None


def _calibrate(args: argparse.Namespace) -> int:
    from pytest_gpubench.cli.calibrate import calibrate

    extra = [arg for arg in args.pytest_args if arg != "--"]
    return calibrate(args.repeat, extra, Path(args.baselines))


def _slurm_submit(args: argparse.Namespace) -> int:
    from pytest_gpubench.targets.slurm.array import (
        ArraySpec,
        array_script,
        default_shards,
        next_steps,
        submit,
    )

    root = Path(args.root).resolve()
    cells = root / (args.cells or "cells.yaml")
    groups = default_shards(cells, root / (args.prompts or "prompts.yaml"))
    shards = args.shards or groups
    if shards > groups:
        raise GpubenchError(
            f"slurm submit: --shards {shards}: {cells} has {groups} node(s); a shard runs whole "
            "nodes, so the others would have nothing to run"
        )
    pytest_args = list(args.pytest_args)
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    if args.cells:
        pytest_args.append(f"--gpubench-cells={args.cells}")
    if args.prompts:
        pytest_args.append(f"--gpubench-prompts={args.prompts}")
    spec = ArraySpec(
        shards=shards,
        root=root,
        ledger_dir=Path(args.ledger_dir).resolve(),
        python=args.python or sys.executable,
        pytest_args=tuple(pytest_args),
        sbatch_options=tuple(args.sbatch_option),
    )
    script = Path(args.script) if args.script else spec.ledger_dir / "gpubench-array.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    (spec.ledger_dir / "logs").mkdir(parents=True, exist_ok=True)
    _write_text(script, array_script(spec))
    if args.no_submit:
        print(script)
        return 0
    job_id = submit(script)
    baselines = Path(args.baselines) if args.baselines else None
    for line in next_steps(job_id, spec, baselines):
        print(line)
    return 0


def _leases(args: argparse.Namespace) -> int:
    """The lease journal: each rented session and Slurm job not yet given back; --release
    gives back those whose run is gone (a rental marked done, a job cancelled). Status 1 when
    one could not be given back."""
    from pytest_gpubench.reports.terminal import rental_lines
    from pytest_gpubench.targets import describe_lease, release_lease
    from pytest_gpubench.targets.leases import RentalJournal

    journal = RentalJournal()
    entries = journal.entries()
    if not entries:
        print(f"no rentals in {journal.directory} (and no Slurm job)")
        return 0
    failed = False
    for entry in entries:
        in_use = entry.run_alive()
        if args.release and not in_use:
            released = release_lease(entry, journal)
            failed = failed or not released["session_done"]
            print(rental_lines([released])[0].text)
            continue
        state = f"in use by pid {entry.facts.get('pid')}" if in_use else "left by a killed run"
        print(describe_lease(entry, state))
    return 1 if failed else 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="gpubench", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)

    init = commands.add_parser(
        "init",
        help="write cells.yaml, prompts.yaml, benchmarks/test_inference.py, a CI workflow and the "
        ".gitignore line for runs/ (existing files are kept)",
    )
    init.add_argument("directory", nargs="?", default=".", help="the repository (default: .)")
    init.add_argument("--force", action="store_true", help="overwrite files that exist")
    init.set_defaults(handler=_init)

    install = commands.add_parser(
        "install-server",
        help="install the prebuilt llama.cpp server where this machine runs it (x86_64 Linux with "
        "AVX2), else build llama-server from source; say which and why, and print what starts it",
    )
    install.add_argument("--binary", help="use this llama-server instead of searching or building")
    install.add_argument(
        "--build",
        action="store_true",
        help="build llama-server from source even where the prebuilt server runs (as "
        "GPUBENCH_LLAMA_SERVER_BUILD=1 does)",
    )
    install.add_argument(
        "--cuda",
        action="store_true",
        help="build a CUDA llama-server (needs nvcc), cached apart from the CPU build; name it "
        "in a cell's server_binary",
    )
    install.add_argument(
        "--cuda-arch",
        default="native",
        help="CMAKE_CUDA_ARCHITECTURES of a --cuda build (default: native; 90 for Hopper)",
    )
    install.add_argument(
        "--sdist",
        help="build from this llama-cpp-python sdist file instead of downloading it (a node "
        "with no package index)",
    )
    install.set_defaults(handler=_install_server)

    model = commands.add_parser("make-model", help="write the tiny deterministic GGUF model")
    model.add_argument("--output", "-o", help="write here instead of the cache")
    model.add_argument("--seed", type=int, default=0)
    model.set_defaults(handler=_make_model)

    report = commands.add_parser(
        "report",
        help="write the Markdown baseline document (or, --html, the HTML report) of a ledger",
    )
    report.add_argument("ledger")
    report.add_argument("--output", "-o", help="file to write (default: standard output)")
    report.add_argument(
        "--html",
        action="store_true",
        help="one self-contained HTML file: charts, verdicts, cells, telemetry, provenance",
    )
    report.add_argument(
        "--baselines",
        metavar="DIR",
        help="with --html: draw this baselines directory's distributions beside the run's "
        "(default: baselines/ in the run's rootdir or the current directory, if any)",
    )
    report.set_defaults(handler=_report)

    history = commands.add_parser(
        "history",
        help="the trend of every cell, prompt and gated metric across the ledgers in a "
        "directory, with regressions (R) and baseline updates (B) marked",
    )
    history.add_argument("directory", help="a directory of ledgers (*.jsonl, searched below)")
    history.add_argument("--html", action="store_true", help="write an HTML page of charts")
    history.add_argument(
        "--output", "-o", help="file to write (default: standard output; history.html with --html)"
    )
    history.set_defaults(handler=_history)

    export = commands.add_parser(
        "export", help="export a ledger: Prometheus textfile, CSV of call records, JSON summary"
    )
    export.add_argument("ledger")
    export.add_argument(
        "--prometheus",
        metavar="FILE",
        help="a textfile for node_exporter's textfile collector (gauges gpubench_*)",
    )
    export.add_argument("--csv", metavar="FILE", help="one row per call record")
    export.add_argument(
        "--load-csv",
        metavar="FILE",
        help="one row per load point: its figures and their intervals, the engine's own means "
        "and the offsets, the queue trend, the slices' spread, a sweep's stop",
    )
    export.add_argument(
        "--load-slices-csv",
        metavar="FILE",
        help="one row per time slice of each load point (slice_s), the ramp's and the window's",
    )
    export.add_argument(
        "--json",
        metavar="FILE",
        help="the summaries, load points, verdicts and cell outcomes of the run",
    )
    export.set_defaults(handler=_export)

    compare = commands.add_parser(
        "compare",
        help="judge a ledger (NEW) as gpubench gate does, with the settings it recorded, against "
        "another ledger or a baselines/ directory (OLD); exits with the gate's statuses",
    )
    compare.add_argument(
        "old", help="the reference: a baselines/ directory, or a ledger (its numbers as a baseline)"
    )
    compare.add_argument("new", help="the newer ledger")
    compare.set_defaults(handler=judge_commands.compare)
    _add_sharded_run_commands(commands)

    leases = commands.add_parser(
        "leases",
        aliases=["rentals"],
        help="what the plugin started that outlives a crash and is not yet given back: rented "
        "sessions and Slurm jobs (the lease journal in the cache directory)",
    )
    leases.add_argument(
        "--release",
        action="store_true",
        help="give back everything whose run is gone (killed): mark rentals done and print "
        "what they cost, cancel Slurm jobs (scancel) and print how they ended",
    )
    leases.set_defaults(handler=_leases)
    return root


def _add_sharded_run_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """merge, gate and slurm submit: a matrix spread over a job array, merged, then gated."""
    merge = commands.add_parser(
        "merge",
        help="combine the ledgers of one sharded run (the tasks of a job array) into one ledger",
    )
    merge.add_argument("ledgers", nargs="+", help="each shard's ledger (one meta per shard)")
    merge.add_argument("--output", "-o", required=True, help="the merged ledger to write")
    merge.add_argument(
        "--baselines",
        default="baselines",
        metavar="DIR",
        help="the baselines the merged records are judged against for its end record, as "
        "gpubench gate judges them (default: baselines)",
    )
    merge.set_defaults(handler=judge_commands.merge)

    gate = commands.add_parser(
        "gate",
        help="judge a ledger (a merged one) against the baselines, with the settings the run "
        "recorded; exits as the run did: 6 on a regression, 7 with a cell unmeasured, 8 on an "
        "incomparable baseline, 10 where the machine was unsteady",
    )
    gate.add_argument("ledger")
    gate.add_argument("--baselines", default="baselines", metavar="DIR")
    gate.add_argument(
        "--cells",
        metavar="PATH",
        help="only for a ledger of an earlier release, which recorded no settings: the "
        "cells.yaml with its thresholds (default: the run's, as it is now)",
    )
    gate.set_defaults(handler=judge_commands.gate)

    calibrate = commands.add_parser(
        "calibrate",
        help="measure the unchanged matrix R times (A/A) to seed the baselines' between-run "
        "history; pytest's arguments after --",
    )
    calibrate.add_argument("--repeat", "-R", type=int, default=5, help="runs (default 5)")
    calibrate.add_argument(
        "--baselines", default="baselines", help="the baselines directory (default baselines/)"
    )
    calibrate.add_argument("pytest_args", nargs=argparse.REMAINDER)
    calibrate.set_defaults(handler=_calibrate)

    slurm = commands.add_parser("slurm", help="run a matrix on a Slurm cluster")
    slurm_commands = slurm.add_subparsers(dest="slurm_command", required=True)
    submit = slurm_commands.add_parser(
        "submit",
        help="write a job-array script (task i runs pytest --gpubench-shard i/N) and sbatch it",
    )
    submit.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest's arguments")
    submit.add_argument("--shards", type=int, help="tasks (default: one per node of cells.yaml)")
    submit.add_argument(
        "--ledger-dir", required=True, metavar="DIR", help="a shared folder for the ledgers"
    )
    submit.add_argument("--root", default=".", help="the project (default: .)")
    submit.add_argument("--cells", metavar="PATH", help="cells.yaml, relative to --root")
    submit.add_argument("--prompts", metavar="PATH", help="prompts.yaml, relative to --root")
    submit.add_argument("--python", help="the Python that runs pytest (default: this one)")
    submit.add_argument(
        "--sbatch-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="an sbatch option of every task, e.g. --sbatch-option=--partition=gpu (repeatable)",
    )
    submit.add_argument("--script", metavar="PATH", help="where to write the job script")
    submit.add_argument("--baselines", metavar="DIR", help="named in the gate step it prints")
    submit.add_argument(
        "--no-submit", action="store_true", help="write the script and print its path only"
    )
    submit.set_defaults(handler=_slurm_submit)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        status = handler(args)
    except GpubenchError as exc:
        print(f"gpubench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpubench: interrupted", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
