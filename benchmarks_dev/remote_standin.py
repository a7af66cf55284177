"""A remote engine's case for noise_table.py: an OpenAI-compatible stand-in (support/standins.py's
FaultyOpenAIServer, answering normally, each reply on a connection of its own) in one process,
and in another, a loopback proxy (support/delay_proxy.py) on the endpoint's port that sets the
reply's timings itself: the first content `first_ms` after the request (times 1 + the hold file's
share: 0.3 is a TTFT 30 % slower), each later one `gap_ms` after the one before. The two are
started separately, neither the other's child, so that the process that holds the endpoint's
socket is a proxy with no engine under it: what the harness sees of an engine on another machine.

    python remote_standin.py standin                  # prints its port, then serves
    python remote_standin.py proxy --port PORT --upstream-port UP [--first-ms 60] [--gap-ms 5]
        [--hold-file FILE]
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.delay_proxy import DelayProxy, Schedule
from support.standins import FaultyOpenAIServer, _Handler


class ClosingHandler(_Handler):
    """Each reply says `Connection: close` and closes its connection: the proxy times one request
    per connection (a kept-alive connection's later replies would pass through untimed)."""

    def end_headers(self) -> None:
        self.send_header("Connection", "close")  # also sets close_connection
        super().end_headers()


def stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=("standin", "proxy"))
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream-port", type=int, default=0)
    parser.add_argument("--first-ms", type=float, default=60.0)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--hold-file", type=Path)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, stop)
    if args.role == "standin":
        server = FaultyOpenAIServer(model=args.model)
        server.RequestHandlerClass = ClosingHandler
        print(server.server_address[1], flush=True)
        server.serve_forever()
        return
    hold = float(args.hold_file.read_text()) if args.hold_file else 0.0
    proxy = DelayProxy("127.0.0.1", args.upstream_port, listen_port=args.port)
    proxy.schedule = Schedule(first_ms=args.first_ms * (1 + hold), gap_ms=args.gap_ms)
    proxy.start()
    try:
        while True:
            time.sleep(1)
    finally:
        proxy.close()


if __name__ == "__main__":
    main()
