"""What reading the engine's /metrics around each warm call costs (issue 35): the real
llama-server (the tiny model, one thread, --metrics), the page read before a call
(CaseCounters.read) and after it, as the harness reads it (at once where the engine has counted
the call's tokens, else once its counters hold still: read(settled=True, ...)), each timed;
and the calls' TTFT and total with the reads around them and without, in turn, so that both see
the same state of the machine. The reads are outside each call's timed span: what they add is
wall time between calls, which the second pair of figures shows does not reach into the calls.

    python benchmarks_dev/engine_counters_overhead.py [--calls 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from pytest_gpubench.engines import Request
from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.engines.tinymodel import ensure_tiny_model
from pytest_gpubench.measure.gauges import CaseCounters, counter_changes
from pytest_gpubench.measure.stream import Endpoint
from pytest_gpubench.targets.local import LocalTarget

PROMPT = "What is the capital of France?"
MAX_TOKENS = 64


def ms(start: int) -> float:
    return (time.perf_counter_ns() - start) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="calls each way (default: 40)")
    args = parser.parse_args()
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not built: run `make engine-build`")
    figures: dict[str, list[float]] = {
        "read before": [],
        "read after (settled)": [],
        "TTFT with reads": [],
        "TTFT without": [],
        "total with reads": [],
        "total without": [],
    }
    target = LocalTarget()
    with tempfile.TemporaryDirectory(prefix="gpubench-counters-") as temp:
        server = ManagedLlamaServer(
            target,
            cell_id="local:llamacpp:tiny",
            binary=str(binary),
            model_path=str(ensure_tiny_model()),
            alias="tiny",
            log_dir=temp,
            extra_args=("--threads", "1", "--metrics"),
        )
        try:
            server.start()
            engine = LlamaCppEngine(server.base_url, "tiny")
            counters = CaseCounters(Endpoint.parse(server.base_url), ())
            engine.chat(Request(PROMPT, MAX_TOKENS), 30)  # warm-up
            changes: dict[str, float] = {}
            for _ in range(args.calls):
                started = time.perf_counter_ns()
                before = counters.read()
                figures["read before"].append(ms(started))
                call = engine.chat(Request(PROMPT, MAX_TOKENS), 30)
                started = time.perf_counter_ns()
                after = counters.read(settled=True, since=before, generated=call.completion_tokens)
                figures["read after (settled)"].append(ms(started))
                if before is None or after is None or call.error is not None:
                    raise SystemExit(f"no page or a failed call: {counters.absent or call.error}")
                changes = counter_changes(before, after)
                plain = engine.chat(Request(PROMPT, MAX_TOKENS), 30)
                for name, measured in (("with reads", call), ("without", plain)):
                    assert measured.first_delta_ms is not None
                    assert measured.total_duration_ms is not None
                    figures[f"TTFT {name}"].append(measured.first_delta_ms)
                    figures[f"total {name}"].append(measured.total_duration_ms)
        finally:
            server.stop()
            target.close()
    print(f"{args.calls} calls each way; load average {os.getloadavg()[0]:.2f} at the end")
    for name, values in figures.items():
        print(f"  {name:22} p50 {statistics.median(values):8.3f} ms   max {max(values):8.3f} ms")
    print(f"  the last call's counters: {changes}")


if __name__ == "__main__":
    main()
