"""How much the delaying proxy of tests/support/delay_proxy.py adds to TTFT, passing through with
no delay: the real llama-server (the tiny model, one thread), called directly and through the
proxy in turn (so that both see the same state of the machine), TTFT p50 of each and the
difference against the direct p50.

The tests' proxied runs measure the proxy's overhead in the baseline and in every comparison
alike; this says how large it is beside the engine's own TTFT. It was a test's assertion (under a
third of the direct p50) until 2026-11-26, when a shared CPU failed it (3.66 ms proxied against
2.69 ms direct): a timing relation of a real engine on a busy machine is a figure, not a check.

    python benchmarks_dev/proxy_overhead.py [--calls 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from pytest_gpubench.engines import Request
from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.engines.tinymodel import ensure_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.delay_proxy import delay_proxy
from support.tiny_server import tiny_llama_server

PROMPT = "What is the capital of France?"
MAX_TOKENS = 64
# The bar the test held it to: the proxy's overhead under this share of the direct TTFT p50.
BAR = 1 / 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=60, help="calls each way (default: 60)")
    args = parser.parse_args()
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not installed: run `make engine`")
    samples: dict[str, list[float]] = {"direct": [], "proxied": []}
    with (
        tempfile.TemporaryDirectory(prefix="gpubench-proxy-") as temp,
        tiny_llama_server(Path(binary), ensure_tiny_model(), Path(temp)) as server,
        delay_proxy(server.base_url) as proxy,
    ):
        direct = LlamaCppEngine(server.base_url, "tiny")
        proxied = LlamaCppEngine(proxy.url, "tiny")
        for engine in (direct, proxied):  # warm-up
            engine.chat(Request(PROMPT, MAX_TOKENS), 30)
        for _ in range(args.calls):
            for name, engine in (("direct", direct), ("proxied", proxied)):
                call = engine.chat(Request(PROMPT, MAX_TOKENS), 30)
                if call.error is not None or call.first_delta_ms is None:
                    raise SystemExit(f"{name} call failed: {call.error}")
                samples[name].append(call.first_delta_ms)
    direct_p50 = statistics.median(samples["direct"])
    proxied_p50 = statistics.median(samples["proxied"])
    added = proxied_p50 - direct_p50
    print(f"machine: {os.cpu_count()} cores; load {os.getloadavg()}")
    print(f"TTFT p50 over {args.calls} calls each, alternating:")
    print(f"  direct          {direct_p50:.3f} ms")
    print(f"  through proxy   {proxied_p50:.3f} ms")
    print(
        f"  added           {added:+.3f} ms = {added / direct_p50:+.1%} of direct "
        f"(the old test's bar: under {BAR:.0%}: {'met' if added < direct_p50 * BAR else 'missed'})"
    )


if __name__ == "__main__":
    main()
