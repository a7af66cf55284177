"""A shared prefix against none on real engines: the same load run twice per engine, prompts
sharing a prefix (`prefix: {tokens, groups}`) and unique prompts of the same length, and the
engine's prefix-cache hit rate beside the TTFT of each, as the load record and the terminal's
load table give them.

- llama-server (`make engine`) serving a model whose prompt reading takes time (the tiny one
  reads a prompt in well under a millisecond): hit rate from llama.cpp's `cache_n`.
- vLLM on CPU where it is installed (/opt/pytest-gpubench, tests/support/vllm_server.py):
  hit rate from its own prefix_cache_queries / hits counters.

Each run is a pytest session of the plugin in a scratch directory (as a user runs it).

    python benchmarks_dev/prefix_cache.py [--requests 24] [--prefix-tokens 256] [--no-vllm]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pytest_gpubench.engines import tinymodel
from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.engines.tinymodel import TinyConfig
from pytest_gpubench.ledger.writer import read_ledger

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.vllm_server import running_vllm, vllm_installed

ROOT = Path(__file__).resolve().parent.parent
LOAD_TEST_FILE = (ROOT / "benchmarks" / "test_inference.py").read_text()
# As tests/test_workloads_real.py: prompt reading that takes milliseconds on a CPU.
HEAVY = TinyConfig(n_embd=512, n_layer=4, n_head=8, n_head_kv=4, n_ff=1536)
QUESTION_TOKENS = 32
PYTEST = (sys.executable, "-m", "pytest")


def cells_yaml(cell: str, requests: int, prefix_tokens: int) -> str:
    """Two cells of one engine: a shared prefix in 2 groups, and unique prompts as long."""
    shared = (
        f"load: {{concurrency: [2], requests: {requests}, synthetic: {{input_tokens:"
        f" {QUESTION_TOKENS}, output_tokens: 4, count: 6}}, prefix: {{tokens: {prefix_tokens},"
        " groups: 2}}"
    )
    unique = (
        f"load: {{concurrency: [2], requests: {requests}, synthetic: {{input_tokens:"
        f" {prefix_tokens + QUESTION_TOKENS}, output_tokens: 4, count: {requests + 1}}}}}"
    )
    return (
        "nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{{cell}, name: prefix, {shared}}}\n"
        f"  - {{{cell}, name: unique, {unique}}}\n"
    )


def run_pair(scratch: Path, cell: str, requests: int, prefix_tokens: int) -> list[dict[str, Any]]:
    """One pytest session of both cells; its load records, and its load table printed."""
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "prompts.yaml").write_text("prompts:\n  P: {intent: p, prompt: hi, max_tokens: 4}\n")
    (scratch / "cells.yaml").write_text(cells_yaml(cell, requests, prefix_tokens))
    (scratch / "test_bench.py").write_text(LOAD_TEST_FILE)
    result = subprocess.run(
        [*PYTEST, "-m", "load", "--force-load", "--allow-dirty", "-p", "no:cacheprovider", "-q"],
        cwd=scratch,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    if result.returncode not in (0, 1):
        raise SystemExit(f"pytest exited {result.returncode}:\n{result.stdout[-3000:]}")
    table = [line for line in result.stdout.splitlines() if "prefix cache hit" in line]
    at = result.stdout.find(table[0]) if table else -1
    if at >= 0:
        print("\n".join(result.stdout[at:].splitlines()[:6]))
    ledger = max((scratch / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    return [record for record in read_ledger(ledger) if record["type"] == "load"]


def side_by_side(engine: str, loads: list[dict[str, Any]]) -> None:
    by_name = {load["cell_id"].rsplit("@", 1)[1]: load for load in loads}
    for name in ("prefix", "unique"):
        load = by_name[name]
        rate = load.get("prefix_cache_hit_rate")
        print(
            f"{engine:<12} {name:<7} hit rate {'-' if rate is None else f'{rate:6.1%}'}"
            f" ({load.get('prefix_cache_source')})  TTFT p50 {load['ttft_ms_p50']:8.2f} ms"
            f"  p99 {load['ttft_ms_p99']:8.2f} ms  ok {load['ok']}/{load['requests']}"
        )


@contextlib.contextmanager
def vllm(scratch: Path) -> Iterator[str | None]:
    """A running vLLM's base URL, or None where it is not installed."""
    if vllm_installed() is not None:
        print(f"vLLM left out: {vllm_installed()}")
        yield None
        return
    with running_vllm(scratch / "vllm-logs") as server:
        yield server.base_url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24, help="measured requests per run")
    parser.add_argument("--prefix-tokens", type=int, default=256, help="llama.cpp's prefix")
    parser.add_argument("--vllm-prefix-tokens", type=int, default=1536, help="vLLM's prefix")
    parser.add_argument("--no-vllm", action="store_true", help="llama-server only")
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}; load average {os.getloadavg()[0]:.2f} (a shared machine)")
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        binary = find_llama_server(None)
        if binary is None:
            raise SystemExit("llama-server is not installed: make engine")
        model = scratch / "heavy.gguf"
        tinymodel.write_tiny_model(model, config=HEAVY)
        cell = (
            f"node: local, engine: llamacpp, model: heavy, model_path: '{model}',"
            f" server_binary: '{binary}', parallel: 2, server_args: [--threads, '1']"
        )
        llamacpp = run_pair(scratch / "llamacpp", cell, args.requests, args.prefix_tokens)
        rows = [("llama-server", llamacpp)]
        if not args.no_vllm:
            with vllm(scratch) as base_url:
                if base_url is not None:
                    cell = (
                        f"node: local, engine: openai, model: tiny-vllm, endpoint: '{base_url}',"
                        " timeout_s: 120"
                    )
                    loads = run_pair(scratch / "vllm", cell, args.requests, args.vllm_prefix_tokens)
                    rows.append(("vLLM (CPU)", loads))
        print("shared prefix against unique prompts of the same length:")
        for engine, loads in rows:
            side_by_side(engine, loads)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
