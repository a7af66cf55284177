"""The lease journal: everything the plugin starts that outlives a crash (a rented session, a
Slurm job) written down before it is started, outside the clone (under the cache directory), and
struck off once it is given back. A run killed with -9 leaves its entry behind; the next run (for
the same API or cluster) and `gpubench leases --release` (alias `gpubench rentals`) give it back
and say what became of it. An entry's `kind` says what it holds (none: a rental); how each kind
is found and given back is its target's (targets.release_leaked, targets.release_lease)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pytest_gpubench.config.nodes import ProviderNode
from pytest_gpubench.core.cache import cache_dir
from pytest_gpubench.core.files import atomic_write
from pytest_gpubench.core.provenance import utc_now

if TYPE_CHECKING:
    from pytest_gpubench.targets.protocol import Rental

# The kind of a managed server's lease on an ssh node (targets/ssh/leases.py), named here, below
# the SSH target, so that what reads leases (targets/rentals.py) need not load paramiko.
SSH_SERVER_LEASE = "ssh_server"

log = logging.getLogger(__name__)

JOURNAL_FOLDER = "rentals"


def journal_dir() -> Path:
    return cache_dir() / JOURNAL_FOLDER


def _process_start(pid: int) -> str | None:
    """The start time of a process (field 22 of /proc/PID/stat): a pid reused by another
    process later has another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


@dataclass(frozen=True)
class JournalEntry:
    """One rental as written down: where it lives on disk and what it says."""

    path: Path
    facts: dict[str, Any]

    @property
    def kind(self) -> str:
        """What the lease holds: `provider` (a rental: older entries say nothing) or `slurm`."""
        return str(self.facts.get("kind") or "provider")

    @property
    def session_id(self) -> str | None:
        value = self.facts.get("session_id")
        return None if value is None else str(value)

    def run_alive(self) -> bool:
        """Whether the run that rented it still runs (then it is not leaked, only in use)."""
        if self.facts.get("host") != socket.gethostname():
            return False
        pid = self.facts.get("pid")
        return isinstance(pid, int) and _process_start(pid) == self.facts.get("pid_start")

    def cost(self, now: float) -> tuple[float, float]:
        """Seconds held from creation until `now`, and what that cost (an upper bound)."""
        created = self.facts.get("created_at")
        price = self.facts.get("price_per_hour") or 0.0
        if not isinstance(created, int | float):
            return 0.0, 0.0
        elapsed = max(0.0, now - created)
        return elapsed, elapsed / 3600.0 * float(price)


class RentalJournal:
    """The journal's folder; one JSON file per rental not yet given back (mode 0600: it names
    the API and the environment variable of its token, never the token)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory if directory is not None else journal_dir()

    def begin(self, node_id: str, node: ProviderNode, offer: dict[str, Any]) -> Path:
        """Written before the session is asked for: a kill between asking and the answer still
        leaves a trace."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.directory / f"{uuid.uuid4()}.json"
        facts = {
            "node": node_id,
            "api": str(node.api).rstrip("/"),
            "api_token_env": node.api_token_env,
            "gpu_type": node.gpu_type,
            "max_price": node.max_price,
            "offer_id": offer.get("id"),
            "gpu_name": offer.get("gpu_name"),
            "price_per_hour": offer.get("price_per_hour"),
            "session_id": None,
            "created_at": None,
            "created_at_utc": None,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "written_at_utc": utc_now(),
        }
        self._write(path, facts)
        return path

    def begin_lease(self, kind: str, node_id: str, facts: dict[str, Any]) -> Path:
        """A lease of another kind (a Slurm job), written before it is started; `facts` say how
        to give it back from another process (never a secret)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.directory / f"{uuid.uuid4()}.json"
        self._write(
            path,
            {
                "kind": kind,
                "node": node_id,
                "session_id": None,
                "created_at": time.time(),
                "created_at_utc": utc_now(),
                **facts,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "pid_start": _process_start(os.getpid()),
                "written_at_utc": utc_now(),
            },
        )
        return path

    def created(self, path: Path, session_id: str) -> None:
        entry = self._read(path)
        facts = entry.facts if entry is not None else {}
        facts.update(session_id=session_id, created_at=time.time(), created_at_utc=utc_now())
        self._write(path, facts)

    def update(self, path: Path, **facts: Any) -> None:
        entry = self._read(path)
        self._write(path, {**(entry.facts if entry is not None else {}), **facts})

    def close(self, path: Path) -> None:
        """The session was given back (or never created): strike it off."""
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def entries(self) -> list[JournalEntry]:
        if not self.directory.is_dir():
            return []
        found = []
        for path in sorted(self.directory.glob("*.json")):
            entry = self._read(path)
            if entry is not None:
                found.append(entry)
        return found

    def leaked(self, api: str | None = None) -> list[JournalEntry]:
        """Entries whose run is gone (rentals of one API, when given)."""
        return [
            entry
            for entry in self.entries()
            if not entry.run_alive() and (api is None or entry.facts.get("api") == api.rstrip("/"))
        ]

    def leaked_of_kind(self, kind: str) -> list[JournalEntry]:
        """Leases of one kind (`slurm`) whose run is gone."""
        return [entry for entry in self.entries() if entry.kind == kind and not entry.run_alive()]

    def _write(self, path: Path, facts: dict[str, Any]) -> None:
        # Durable: the entry is what finds a paid node again after a crash.
        atomic_write(path, json.dumps(facts), mode=0o600)

    def _read(self, path: Path) -> JournalEntry | None:
        try:
            facts = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return JournalEntry(path, facts) if isinstance(facts, dict) else None


def leaked_lease(entry: JournalEntry, kind: str, **facts: Any) -> Rental:
    """What became of a lease a killed run left, in the shape of one given back (RentalClosed)
    plus `leaked: true`; `session_done` False until the kind's release says it is given back."""
    lease = {
        "node": entry.facts.get("node"),
        "kind": kind,
        "session_id": entry.session_id,
        **facts,
        "leaked": True,
        "leaked_at_utc": entry.facts.get("created_at_utc"),
        "session_done": False,
    }
    return cast("Rental", lease)
