"""Does telemetry disturb what it measures? TTFT error with and without sampling, at the shortest
interval cells.yaml accepts, against the timing-controlled server of timed_server.py.

The TTFT error of one request is the client's first-content arrival minus the server's own stamp
of its first write (the client benchmark's figure). With sampling on, this machine's samplers run
as a node's do in a benchmark (the /proc sampler following the server process, NVML where it
loads; an nvidia-smi stand-in stream with --nvidia-smi-standin), and each request is wrapped in
begin_case/end_case as the harness wraps a case. Blocks of requests alternate between off and on
so that machine noise hits both alike. Prints median, p90 and p99 of each, and their difference.

    python benchmarks_dev/telemetry_overhead.py [--requests 600] [--block 50] [--nvidia-smi-standin]
        [--interval-ms 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from timed_server import gpubench_client, start_server

from pytest_gpubench.config.cell import TelemetrySettings
from pytest_gpubench.targets.local import LocalTarget
from pytest_gpubench.telemetry import NodeTelemetry, node_telemetry

SHORTEST_INTERVAL_MS = int(TelemetrySettings.model_fields["interval_ms"].metadata[0].ge)


def _standin_on_path() -> list[dict[str, str]]:
    """Put the tests' nvidia-smi stand-in first on PATH; returns the inventory it reports."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.gpu_standins import write_nvidia_smi

    folder = Path(tempfile.mkdtemp(prefix="gpubench-standin-"))
    write_nvidia_smi(folder)
    os.environ["PATH"] = f"{folder}:{os.environ['PATH']}"
    return LocalTarget().gpu_inventory()


def _telemetry(gpus: list[dict[str, str]], interval_ms: int) -> NodeTelemetry:
    settings = TelemetrySettings(interval_ms=interval_ms)
    telemetry = node_telemetry("local", LocalTarget(), [settings], gpus)
    assert telemetry is not None
    return telemetry


def _percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=600, help="per mode")
    parser.add_argument("--block", type=int, default=50, help="requests per alternating block")
    parser.add_argument("--nvidia-smi-standin", action="store_true")
    parser.add_argument("--interval-ms", type=int, default=SHORTEST_INTERVAL_MS)
    args = parser.parse_args()
    gpus = _standin_on_path() if args.nvidia_smi_standin else []
    url, server = start_server()
    errors: dict[str, list[float]] = {"off": [], "on": []}
    samples_seen = 0
    sources: set[str] = set()
    notes: set[str] = set()
    try:
        for _ in range(30):  # warm imports and caches
            gpubench_client(url)
        while len(errors["on"]) < args.requests:
            for _ in range(args.block):
                errors["off"].append(gpubench_client(url) / 1e6)
            telemetry = _telemetry(gpus, args.interval_ms)
            telemetry.start()
            try:
                for _ in range(args.block):
                    start = telemetry.begin_case(server.pid)
                    errors["on"].append(gpubench_client(url) / 1e6)
                    case = telemetry.end_case(start, gpu=True, cpu=True)
                    samples_seen += len(case.gpu) + len(case.cpu)
                    sources.update(s for s in (case.gpu_source, case.cpu_source) if s)
                    notes.update(case.notes)
            finally:
                telemetry.stop()
    finally:
        server.terminate()
    print(f"interval {args.interval_ms} ms; samplers: {', '.join(sorted(sources))}; "
          f"{samples_seen} samples kept over {len(errors['on'])} sampled requests")  # fmt: skip
    for note in sorted(notes):
        print(f"note: {note}")
    print(f"{'sampling':10} {'median ms':>10} {'p90 ms':>8} {'p99 ms':>8}")
    for mode, values in errors.items():
        print(
            f"{mode:10} {statistics.median(values):10.3f} {_percentile(values, 90):8.3f} "
            f"{_percentile(values, 99):8.3f}"
        )
    off, on = errors["off"], errors["on"]
    print(
        f"{'on - off':10} {statistics.median(on) - statistics.median(off):+10.3f} "
        f"{_percentile(on, 90) - _percentile(off, 90):+8.3f} "
        f"{_percentile(on, 99) - _percentile(off, 99):+8.3f}"
    )
    print(f"({args.requests} requests per mode, alternating blocks of {args.block})")


if __name__ == "__main__":
    main()
