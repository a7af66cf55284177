"""A stand-in for the GPU marketplace API (docs/remote-nodes.md) on 127.0.0.1, playing scripted scenarios.

Endpoints: GET /api/v1/inventory (offers filtered by gpu_type, provider, min_vram as a broker
would), POST /api/v1/sessions (a session plus `ssh_private_key`), GET /api/v1/sessions/{id}
(the scenario's statuses, one per poll, the last repeating), POST /api/v1/sessions/{id}/done.
The sessions it hands out point at whatever SSH server the scenario names (in the tests: the
real sshd of ssh_fixtures.py).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class Scenario:
    offers: list[dict[str, Any]]
    private_key: str = ""
    ssh_host: str = "127.0.0.1"
    ssh_port: int = 22
    ssh_user: str = "gpubench-test"
    # What successive status polls of every session answer; the last one repeats.
    statuses: list[str] = field(default_factory=lambda: ["provisioning", "running"])
    error: str | None = None
    # offer id -> (HTTP status, error) answered to POST /api/v1/sessions for that offer.
    create_errors: dict[str, tuple[int, str]] = field(default_factory=dict)
    # offer id -> error: that offer's sessions fail while provisioning with this error.
    session_errors: dict[str, str] = field(default_factory=dict)
    token: str | None = None


@dataclass
class StandInSession:
    id: str
    offer_id: Any
    polls: int = 0
    status: str | None = None
    error: str | None = None
    done: bool = False


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    authorization: str | None
    # Wall-clock time the request arrived, to order it against the ledger's timestamps.
    at: float = field(default_factory=time.time)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> Seen | None:
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        seen = Seen(
            method=self.command,
            path=parts.path,
            query=parse_qs(parts.query),
            body=json.loads(raw) if raw else None,
            authorization=self.headers.get("Authorization"),
        )
        standin = self.server.standin
        with standin.lock:
            standin.seen.append(seen)
        token = standin.scenario.token
        if token is not None and seen.authorization != f"Bearer {token}":
            self._reply(401, {"error": "missing or wrong API token"})
            return None
        return seen

    def do_GET(self) -> None:
        seen = self._record()
        if seen is None:
            return
        standin = self.server.standin
        if seen.path == "/api/v1/inventory":
            self._reply(200, {"offers": standin.inventory(seen.query)})
        elif seen.path.startswith("/api/v1/sessions/"):
            session = standin.sessions.get(seen.path.rsplit("/", 1)[1])
            if session is None:
                self._reply(404, {"error": "no such session"})
            else:
                self._reply(200, {"session": standin.poll(session)})
        else:
            self._reply(404, {"error": f"no route {seen.path}"})

    def do_POST(self) -> None:
        seen = self._record()
        if seen is None:
            return
        standin = self.server.standin
        if seen.path == "/api/v1/sessions":
            status, body = standin.create(seen.body or {})
            self._reply(status, body)
        elif seen.path.startswith("/api/v1/sessions/") and seen.path.endswith("/done"):
            session = standin.sessions.get(seen.path.split("/")[-2])
            if session is None:
                self._reply(404, {"error": "no such session"})
                return
            session.done = True
            self._reply(200, {"session": {"id": session.id, "status": "done"}})
        else:
            self._reply(404, {"error": f"no route {seen.path}"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    standin: ProviderStandIn


class ProviderStandIn:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        self.sessions: dict[str, StandInSession] = {}
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.standin = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> ProviderStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- behaviour ------------------------------------------------------------------------

    def inventory(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        gpu_type = query.get("gpu_type", [""])[0]
        provider = query.get("provider", [""])[0]
        min_vram = float(query.get("min_vram", ["0"])[0] or 0)
        return [
            offer
            for offer in self.scenario.offers
            if (not gpu_type or offer.get("gpu_name") == gpu_type)
            and (not provider or offer.get("provider") == provider)
            # A broker's filter is loose; the client must still check VRAM itself.
            and float(offer.get("vram_gb", 0)) >= min_vram / 2
        ]

    def create(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        missing = {"consumer_id", "offer_id", "workload_type", "reservation_hours"} - set(body)
        if missing:
            return 400, {"error": f"missing {sorted(missing)}"}
        offer_id = body["offer_id"]
        if str(offer_id) in self.scenario.create_errors:
            status, error = self.scenario.create_errors[str(offer_id)]
            return status, {"error": error}
        with self.lock:
            session = StandInSession(id=f"sess-{len(self.sessions) + 1}", offer_id=offer_id)
            self.sessions[session.id] = session
        return 201, {
            "session": {
                "id": session.id,
                "status": "pending",
                "ssh_host": self.scenario.ssh_host,
                "ssh_port": self.scenario.ssh_port,
                "ssh_user": self.scenario.ssh_user,
            },
            "ssh_private_key": self.scenario.private_key,
        }

    def poll(self, session: StandInSession) -> dict[str, Any]:
        with self.lock:
            statuses = self.scenario.statuses
            error = self.scenario.error
            if str(session.offer_id) in self.scenario.session_errors:
                statuses = ["provisioning", "failed"]
                error = self.scenario.session_errors[str(session.offer_id)]
            status = statuses[min(session.polls, len(statuses) - 1)]
            session.polls += 1
            if session.status is not None:
                status, error = session.status, session.error
        answer: dict[str, Any] = {"id": session.id, "status": status}
        if status == "running":
            answer.update(
                ssh_host=self.scenario.ssh_host,
                ssh_port=self.scenario.ssh_port,
                ssh_user=self.scenario.ssh_user,
            )
        if error is not None and status != "running":
            answer["error"] = error
        return answer

    def set_status(self, session_id: str, status: str, error: str | None = None) -> None:
        """Change a session from outside, as a provider does when it stops an instance."""
        with self.lock:
            self.sessions[session_id].status = status
            self.sessions[session_id].error = error

    # --- what the tests check -------------------------------------------------------------

    def created(self) -> list[str]:
        return list(self.sessions)

    def done(self) -> list[str]:
        return [
            seen.path.split("/")[-2]
            for seen in self.seen
            if seen.method == "POST" and seen.path.endswith("/done")
        ]

    def requests(self, method: str, path: str) -> list[Seen]:
        return [seen for seen in self.seen if seen.method == method and seen.path == path]
