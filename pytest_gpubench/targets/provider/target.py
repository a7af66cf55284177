"""A rented GPU machine's life cycle: provision, wait for SSH, connect, set up, give back, bill.

The order: inventory → create a session → poll until running → wait for SSH → connect → setup →
benchmark → mark the session done. `close()` marks the session done, deletes its temporary
private key and reports what the rental cost, whatever happened before, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pytest_gpubench.config.nodes import ProviderNode
from pytest_gpubench.targets.bringup import bring_up
from pytest_gpubench.targets.leases import RentalJournal
from pytest_gpubench.targets.protocol import CommandResult, NodeFacts, Rental, RentalClosed
from pytest_gpubench.targets.provider.api import (
    HTTP_TIMEOUT_S,
    CreatedSession,
    MarketplaceClient,
    NoPublicIp,
    Offer,
    choose_offers,
)
from pytest_gpubench.targets.ssh import SshTarget
from pytest_gpubench.targets.ssh.hostkeys import HostKeyError
from pytest_gpubench.targets.ssh.target import SshLineStream, SshProcess
from pytest_gpubench.targets.stages import SetupStep, Stage, StageClock, StageError

log = logging.getLogger(__name__)

T = TypeVar("T")


class ProviderProcess:
    """A background process on the rented node; errors say when the provider stopped it."""

    def __init__(self, target: ProviderTarget, process: SshProcess) -> None:
        self._target = target
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._target.guarded("benchmark", lambda _: self._process.alive())

    def stop(self, timeout_s: float = 10.0) -> None:
        self._target.guarded("benchmark", lambda _: self._process.stop(timeout_s))

    def log_tail(self, max_bytes: int = 4000) -> str:
        return self._target.guarded("benchmark", lambda _: self._process.log_tail(max_bytes))


class ProviderTarget:
    """A machine rented for this run; `open()` provisions it, `close()` always gives it back.

    on_rental_closed is told what the rental cost (rental_facts()) once, when a session that
    was created is given back; never when nothing was rented.
    """

    def __init__(
        self,
        node_id: str,
        node: ProviderNode,
        *,
        on_rental_closed: RentalClosed,
        poll_interval_s: float = 5.0,
        watch_interval_s: float = 30.0,
        clock: StageClock | None = None,
        journal: RentalJournal | None = None,
    ) -> None:
        self.node_id = node_id
        self.clock = clock or StageClock(node_id)
        self.journal = journal if journal is not None else RentalJournal()
        self._journal_entry: Path | None = None
        self.node = node
        self.on_rental_closed = on_rental_closed
        self.poll_interval_s = poll_interval_s
        self.watch_interval_s = watch_interval_s
        self.offer: Offer | None = None
        self.session_id: str | None = None
        self.ssh_host: str | None = None
        self.ssh_port = 22
        self.ssh_user = node.user
        self.done_marked = False
        self.key_dir: Path | None = None
        self.key_path: Path | None = None
        self._api = MarketplaceClient(node_id, node)
        self._ssh: SshTarget | None = None
        self._created_at: float | None = None
        self._ended_at: float | None = None
        self._stopped_reason: str | None = None
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._closed = False

    @property
    def work_dir(self) -> str:
        return f"/tmp/gpubench-{self.ssh_user or 'root'}"

    # --- provisioning ---------------------------------------------------------------------

    def open(self) -> ProviderTarget:
        """Provision, wait for SSH, connect and run the setup; on any failure give it all back."""
        clock, node = self.clock, self.node
        try:
            with clock.stage("inventory", HTTP_TIMEOUT_S) as limit:
                candidates = choose_offers(
                    self._api.inventory(limit or HTTP_TIMEOUT_S),
                    max_price=node.max_price,
                    min_vram_gb=node.min_vram_gb,
                )
                if not candidates:
                    raise self._api.no_offer_error()
            with clock.stage("provision", node.provision_timeout_s) as limit:
                self._provision(candidates, limit or node.provision_timeout_s)
            self._start_watch()
            with clock.stage("ssh_wait", node.ssh_wait_timeout_s) as limit:
                host, port = self._wait_for_ssh(limit or node.ssh_wait_timeout_s)
            with clock.stage("ssh_connect", min(node.ssh_wait_timeout_s, 120.0)) as limit:
                self._ssh = self._connect(host, port, limit or node.connect_timeout_s)
            bring_up(self, clock, node)
        except BaseException:
            self._close_after_failure()
            raise
        return self

    def _close_after_failure(self) -> None:
        """Give everything back when opening failed, as stage cleanup (the harness never
        holds a node that failed to open, so it cannot time this one)."""
        begun = time.monotonic()
        rented = self.session_id is not None
        self.close()
        given_back = self.done_marked or not rented
        self.clock.note(
            "cleanup",
            "ok" if given_back else "failed",
            time.monotonic() - begun,
            error=None if given_back else f"session {self.session_id} not marked done",
        )

    def _provision(self, candidates: Sequence[Offer], limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        without_ip: list[str] = []
        for offer in candidates:
            try:
                self._rent(offer)
                running = self._api.wait_until_running(
                    self._session(), deadline, self.poll_interval_s, limit_s
                )
            except NoPublicIp as exc:
                log.warning(
                    "node %s: offer %s: %s; trying the next offer", self.node_id, offer.id, exc
                )
                without_ip.append(str(offer.id))
                self._give_back_session()
                continue
            self._take_ssh_address(running)
            if not self.ssh_host:
                raise self._api.fail(
                    "provision", f"session {self.session_id} runs without ssh_host"
                )
            return
        raise self._api.fail(
            "provision", f"no public IP on any offer ({', '.join(without_ip)}); try again later"
        )

    def _rent(self, offer: Offer) -> None:
        # Written down before it is asked for: a run killed from here on leaves a trace that
        # the next run (and `gpubench rentals --release`) follows to give the session back.
        self._journal_entry = self.journal.begin(
            self.node_id,
            self.node,
            {"id": offer.id, "gpu_name": offer.gpu_name, "price_per_hour": offer.price_per_hour},
        )
        try:
            created: CreatedSession = self._api.create_session(offer)
        except BaseException:
            self.journal.close(self._journal_entry)
            self._journal_entry = None
            raise
        self.journal.created(self._journal_entry, created.session_id)
        self.offer = offer
        self.session_id = created.session_id
        self.done_marked = False
        # Cost counts from creation, not from `running`: some providers bill from there, and
        # an upper bound is the safer figure.
        self._created_at = time.monotonic()
        self._ended_at = None
        key = created.private_key
        if key is None or "PRIVATE KEY" not in key:
            raise self._api.fail(
                "provision", f"session {created.session_id}: answer lacks ssh_private_key"
            )
        self._write_key(key)
        # A run killed with -9 leaves the key on disk: whoever gives the session back deletes it.
        self.journal.update(self._journal_entry, key_dir=str(self.key_dir))
        self._take_ssh_address(created.session)
        log.info(
            "node %s: session %s on offer %s (%s, %s/h)",
            self.node_id,
            created.session_id,
            offer.id,
            offer.gpu_name,
            offer.price_per_hour,
        )

    def _session(self) -> str:
        assert self.session_id is not None
        return self.session_id

    def _take_ssh_address(self, session: dict[str, Any]) -> None:
        if session.get("ssh_host"):
            self.ssh_host = str(session["ssh_host"])
        if session.get("ssh_port"):
            self.ssh_port = int(session["ssh_port"])
        if self.node.user is None and session.get("ssh_user"):
            self.ssh_user = str(session["ssh_user"])

    def _write_key(self, key: str) -> None:
        if self.key_dir is None:
            # mkdtemp makes the directory 0700; the key inside is created 0600 from the start,
            # never readable by others even for an instant.
            self.key_dir = Path(tempfile.mkdtemp(prefix="gpubench-provider-"))
        self.key_path = self.key_dir / "session_key"
        self.key_path.unlink(missing_ok=True)
        descriptor = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="ascii") as key_file:
            key_file.write(key if key.endswith("\n") else key + "\n")

    # --- watching the running instance ----------------------------------------------------

    def _start_watch(self) -> None:
        self._watcher = threading.Thread(
            target=self._watch, name=f"gpubench-watch-{self.node_id}", daemon=True
        )
        self._watcher.start()

    def _watch(self) -> None:
        """Poll the session; when the provider stops the instance, drop SSH so calls fail now."""
        while not self._watch_stop.wait(self.watch_interval_s):
            try:
                reason = self._stopped_by_provider()
            except Exception:  # a watcher must not die with a traceback mid-run
                continue
            if reason is not None:
                self._stopped_reason = reason
                log.error("%s", reason)
                if self._ssh is not None:
                    self._ssh.disconnect()
                return

    def _stopped_by_provider(self) -> str | None:
        """Why the instance is gone, when the API says it is no longer running; else None."""
        if self._stopped_reason is not None:
            return self._stopped_reason
        if self.session_id is None:
            return None
        return self._api.stopped_reason(self.session_id)

    def guarded(self, stage: Stage, call: Callable[[SshTarget], T]) -> T:
        """Run a call on the SSH target; when it fails, say so if the instance was stopped."""
        if self._stopped_reason is not None:
            raise StageError(stage, self._stopped_reason)
        if self._ssh is None:
            raise self._api.fail(stage, "not provisioned (open() not called, or closed)")
        try:
            return call(self._ssh)
        except StageError as exc:
            reason = self._stopped_by_provider()
            if reason is not None:
                self._stopped_reason = reason
                raise StageError(exc.stage, reason) from None
            raise

    # --- SSH ------------------------------------------------------------------------------

    def _wait_for_ssh(self, limit_s: float) -> tuple[str, int]:
        """Until the instance's sshd answers with its banner (a heavy image may still pull)."""
        assert self.ssh_host is not None
        host, port = self.ssh_host, self.ssh_port
        deadline = time.monotonic() + limit_s
        last = "no answer yet"
        next_status_check = time.monotonic() + self.poll_interval_s
        while True:
            if self._stopped_reason is not None:
                raise StageError("ssh_wait", self._stopped_reason)
            remaining = deadline - time.monotonic()
            try:
                banner = _read_banner(host, port, max(0.1, min(5.0, remaining)))
                if banner.startswith(b"SSH-"):
                    return host, port
                last = f"unexpected banner {banner[:20]!r}"
            except OSError as exc:
                last = exc.strerror or type(exc).__name__
            if time.monotonic() >= next_status_check:
                reason = self._stopped_by_provider()
                if reason is not None:
                    self._stopped_reason = reason
                    raise StageError("ssh_wait", reason)
                next_status_check = time.monotonic() + self.poll_interval_s
            if time.monotonic() >= deadline:
                raise StageError(
                    "ssh_wait",
                    self._api.redact(
                        f"node {self.node_id}: {host}:{port} did not answer SSH within "
                        f"{limit_s:g} s ({last}); a large image may still be pulling: raise "
                        "ssh_wait_timeout_s"
                    ),
                    timed_out=True,
                )
            time.sleep(min(1.0, self.poll_interval_s, max(0.0, deadline - time.monotonic())))

    def _connect(self, host: str, port: int, limit_s: float) -> SshTarget:
        assert self.key_path is not None and self.key_dir is not None
        # Until the instance has installed the session key, logins fail; retry a little while.
        deadline = time.monotonic() + limit_s
        while True:
            try:
                return SshTarget(
                    self.node_id,
                    host,
                    port,
                    self.ssh_user or "root",
                    key_file=str(self.key_path),
                    # The instance was created a moment ago, so its host key cannot be known in
                    # advance: trusting it on first use is the only option, and acceptable for
                    # provider nodes only. It goes into a throwaway known_hosts beside the key,
                    # so a rented IP that is later reused cannot poison the user's own file.
                    known_hosts=str(self.key_dir / "known_hosts"),
                    trust_new_host=True,
                    connect_timeout_s=self.node.connect_timeout_s,
                    command_timeout_s=self.node.command_timeout_s,
                )
            except HostKeyError:
                raise
            except StageError as exc:
                if time.monotonic() >= deadline:
                    raise
                log.info("node %s: SSH not ready yet (%s); retrying", self.node_id, exc.message)
                time.sleep(min(2.0, self.poll_interval_s))

    def run_setup(self, steps: Sequence[SetupStep], timeout_s: float) -> None:
        """The node's setup commands (targets/bringup.py runs them stage by stage)."""
        if steps:
            self.guarded(steps[0].stage, lambda ssh: ssh.run_setup(steps, timeout_s))

    # --- the Target protocol --------------------------------------------------------------

    def run(self, argv: Sequence[str], *, timeout_s: float) -> CommandResult:
        return self.guarded("benchmark", lambda ssh: ssh.run(argv, timeout_s=timeout_s))

    def start(self, argv: Sequence[str], *, log_path: str) -> ProviderProcess:
        process = self.guarded("benchmark", lambda ssh: ssh.start(argv, log_path=log_path))
        return ProviderProcess(self, process)

    def stream(self, argv: Sequence[str]) -> SshLineStream:
        return self.guarded("benchmark", lambda ssh: ssh.stream(argv))

    def free_port(self) -> int:
        return self.guarded("benchmark", lambda ssh: ssh.free_port())

    def reach(self, host: str, port: int) -> tuple[str, int]:
        return self.guarded("benchmark", lambda ssh: ssh.reach(host, port))

    def gpu_inventory(self) -> list[dict[str, str]]:
        return self.guarded("benchmark", lambda ssh: ssh.gpu_inventory())

    # --- billing --------------------------------------------------------------------------

    def elapsed_s(self) -> float:
        """Seconds since the session was created, frozen once it is given back."""
        if self._created_at is None:
            return 0.0
        end = self._ended_at if self._ended_at is not None else time.monotonic()
        return end - self._created_at

    def cost(self) -> float:
        price = self.offer.price_per_hour if self.offer is not None else 0.0
        return self.elapsed_s() / 3600.0 * price

    def describe(self) -> NodeFacts:
        facts: NodeFacts = {}
        if self._ssh is not None and self._stopped_reason is None and not self._closed:
            with contextlib.suppress(StageError):
                facts.update(self._ssh.describe())
        offer = self.offer
        facts.update(
            {
                "kind": "provider",
                "api": self._api.api,
                "session_id": self.session_id,
                "offer_id": offer.id if offer else None,
                "provider": offer.provider if offer else None,
                "gpu_name": offer.gpu_name if offer else None,
                "vram_gb": offer.vram_gb if offer else None,
                "price_per_hour": offer.price_per_hour if offer else None,
                "elapsed_s": round(self.elapsed_s(), 3),
                "cost": round(self.cost(), 6),
            }
        )
        return facts

    def rental_facts(self) -> Rental:
        """What the rented node cost: price, time held, cost, and whether it was given back."""
        offer = self.offer
        return {
            "node": self.node_id,
            "kind": "provider",
            "session_id": self.session_id,
            "offer_id": offer.id if offer else None,
            "gpu_name": offer.gpu_name if offer else None,
            "price_per_hour": offer.price_per_hour if offer else None,
            "elapsed_s": round(self.elapsed_s(), 3),
            "cost": round(self.cost(), 6),
            "session_done": self.done_marked,
        }

    # --- giving it back -------------------------------------------------------------------

    def close(self) -> None:
        """Mark the session done, delete the key and report the rental's cost; safe to call
        again and after any failure."""
        if self._closed:
            return
        self._closed = True
        self._watch_stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        try:
            if self._ssh is not None and self._stopped_reason is None:
                with contextlib.suppress(Exception):
                    self._ssh.close()
            elif self._ssh is not None:
                self._ssh.disconnect()
        finally:
            try:
                self._give_back_session()
            finally:
                try:
                    self._delete_key()
                    self._api.close()
                finally:
                    if self.session_id is not None:  # None: nothing was rented
                        self.on_rental_closed(self.rental_facts())

    def _give_back_session(self) -> None:
        if self.session_id is None:
            return
        session_id = self.session_id
        if self._ended_at is None:
            self._ended_at = time.monotonic()
        self.done_marked = self._api.mark_done(session_id)
        if self.done_marked and self._journal_entry is not None:
            self.journal.close(self._journal_entry)
            self._journal_entry = None
        if self.session_id == session_id and not self._closed:
            self.session_id = None

    def _delete_key(self) -> None:
        if self.key_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.key_path.unlink()
        if self.key_dir is not None:
            shutil.rmtree(self.key_dir, ignore_errors=True)


def _read_banner(host: str, port: int, timeout_s: float) -> bytes:
    with socket.create_connection((host, port), timeout=timeout_s) as probe:
        return probe.recv(64)
