"""Which steadiness signal separates the machine from the engine (issue 37): the machine's CPU
pressure (Linux PSI `some`, measure/control.py), the engine's own run-queue wait as a share of
the call's wall time, and the engine's wait per unit of the CPU it got (measure/engine_wait.py),
beside the control call, under each neighbour and under a change of the engine's path alone.

One managed llama-server (the tiny model, one thread) answers a ~1,800-token prompt with its
prompt cache off (every call prefills it), 32 tokens out. Conditions, each for --calls calls:
`quiet`; `nice19` (two busy processes at nice 19: they barely take the engine's CPU);
`busy2` (two busy processes at nice 0 on 2 cores: the engine loses CPU); `memstream` (one process
copying 512 MiB over and over: it takes memory bandwidth, not much run queue); `slow-path`
(quiet, the reply paced by a proxy at twice the engine's inter-token gap: the engine unchanged,
its decode rate as the client sees it halved). The signal to keep moves for `busy2` (and ideally
`memstream`), not for `nice19` and never for `slow-path`.

    python benchmarks_dev/steadiness_signals.py [--calls 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from pytest_gpubench.engines import Request
from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.engines.tinymodel import ensure_tiny_model
from pytest_gpubench.measure.control import ControlCall, CpuPressure
from pytest_gpubench.measure.engine_wait import EngineWait
from pytest_gpubench.targets.local import LocalTarget

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.delay_proxy import Schedule, delay_proxy

PROMPT = " ".join(f"word{index % 97} and more" for index in range(350))
MAX_TOKENS = 32
NO_CACHE = {"cache_prompt": False}
BUSY = "while True: pass"
MEMSTREAM = "b = bytearray(512 << 20)\nc = bytearray(512 << 20)\nwhile True: c[:] = b\n"


def neighbours(condition: str) -> list[subprocess.Popen[bytes]]:
    """The condition's processes, each in a session of its own."""

    def start(code: str, nice: int = 0) -> subprocess.Popen[bytes]:
        argv = ["nice", "-n", str(nice), sys.executable, "-c", code]
        return subprocess.Popen(argv, start_new_session=True)

    if condition == "nice19":
        return [start(BUSY, 19), start(BUSY, 19)]
    if condition == "busy2":
        return [start(BUSY), start(BUSY)]
    if condition == "memstream":
        return [start(MEMSTREAM)]
    return []


def p50(values: list[float]) -> str:
    return f"{statistics.median(values):8.3f}" if values else "       -"


def measure(call: Callable[[], object], reader: EngineWait, calls: int) -> dict[str, list[float]]:
    control, pressure = ControlCall(), CpuPressure()
    figures: dict[str, list[float]] = {
        k: [] for k in ("ttft", "decode", "control", "psi", "wait_share", "wait_per_cpu")
    }
    for _ in range(calls):
        figures["control"].append(control.measure_ms())
        mark, wait_mark = pressure.start(), reader.mark()
        measurement = call()
        waited, share = reader.since(wait_mark), pressure.share(mark)
        figures["ttft"].append(getattr(measurement, "first_delta_ms", None) or 0.0)
        figures["decode"].append(getattr(measurement, "tokens_per_sec", None) or 0.0)
        if share is not None:
            figures["psi"].append(share)
        if waited is not None:
            figures["wait_share"].append(waited.share)
            if waited.cpu_ms > 0:
                figures["wait_per_cpu"].append(waited.wait_ms / waited.cpu_ms)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--conditions", default="quiet,nice19,busy2,memstream,slow-path,quiet")
    args = parser.parse_args()
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not installed: run `make engine`")
    print(f"machine: {os.cpu_count()} cores, shared; load {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpubench-signals-") as temp:
        server = ManagedLlamaServer(
            LocalTarget(), cell_id="local:llamacpp:tiny", binary=str(binary),
            model_path=str(ensure_tiny_model()), alias="tiny", log_dir=temp,
            extra_args=("--threads", "1"),
        )  # fmt: skip
        upstream = server.start()
        try:
            assert server.pid is not None
            reader = EngineWait(server.pid)
            engine = LlamaCppEngine(upstream, "tiny")

            def direct() -> object:
                return engine.chat(Request(PROMPT, MAX_TOKENS, extra_body=NO_CACHE), 60)

            for _ in range(10):
                direct()
            gaps = direct()
            gap_ms = statistics.median(getattr(gaps, "inter_chunk_ms", None) or [5.0])
            header = "condition | TTFT ms | decode tok/s | control ms | PSI share | "
            print(header + "engine wait share | engine wait per CPU ms | load1")
            for condition in args.conditions.split(","):
                procs = neighbours(condition)
                try:
                    time.sleep(1.0)
                    if condition == "slow-path":
                        with delay_proxy(upstream) as proxy:
                            proxy.schedule = Schedule(first_ms=0.0, gap_ms=2 * gap_ms)
                            client = LlamaCppEngine(proxy.url, "tiny")
                            request = Request(PROMPT, MAX_TOKENS, extra_body=NO_CACHE)
                            paced = partial(client.chat, request, 60)
                            figures = measure(paced, reader, args.calls)
                    else:
                        figures = measure(direct, reader, args.calls)
                finally:
                    for proc in procs:
                        proc.kill()
                        proc.wait()
                print(
                    f"{condition:9} | {p50(figures['ttft'])} | {p50(figures['decode'])} | "
                    f"{p50(figures['control'])} | {p50(figures['psi'])} | "
                    f"{p50(figures['wait_share'])} | {p50(figures['wait_per_cpu'])} | "
                    f"{os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
