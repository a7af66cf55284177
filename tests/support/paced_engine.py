"""A managed engine whose delivery path is slowed: this process starts the engine's argv (after
`--`) as its child on a port of its own, and serves the port the harness gave through the delay
proxy (support/delay_proxy.py), each content event released `gap` ms after the one before (0: as
it comes), or each reply's first content held back by a share of that call's own time to it
(`--hold-file`: 0.3 is a TTFT 30 % slower, following the machine's state as a slower engine's
would). Both are read from files at start, so that the cells.yaml a baseline was ratified
with does not change between runs. The engine is untouched: only the pace the client sees.

    python paced_engine.py --port PORT [--gap-file FILE] [--hold-file FILE] -- llama-server ...
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support.delay_proxy import DelayProxy, Schedule


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--gap-file", type=Path)
    parser.add_argument("--hold-file", type=Path)
    parser.add_argument("engine", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    engine_argv = args.engine[1:] if args.engine[:1] == ["--"] else args.engine
    inner = free_port()
    engine = subprocess.Popen([*engine_argv, "--host", "127.0.0.1", "--port", str(inner)])

    def stop(signum: int, frame: FrameType | None) -> None:
        engine.terminate()
        engine.wait(timeout=10)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    hold = float(args.hold_file.read_text()) if args.hold_file else 0.0
    proxy = DelayProxy("127.0.0.1", inner, delay_fraction=hold, listen_port=args.port)
    gap_ms = float(args.gap_file.read_text()) if args.gap_file else 0.0
    if gap_ms > 0:
        proxy.schedule = Schedule(first_ms=0.0, gap_ms=gap_ms)
    proxy.start()
    while engine.poll() is None:
        time.sleep(0.2)
    proxy.close()
    raise SystemExit(engine.returncode)


if __name__ == "__main__":
    main()
