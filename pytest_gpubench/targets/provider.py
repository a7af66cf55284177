"""A rented GPU machine: chosen and provisioned through the marketplace API, then used over SSH.

The lifecycle follows SPEC §10: inventory → create a session → poll until running → wait for
SSH → connect → setup → benchmark → mark the session done. `close()` marks the session done and
deletes its temporary private key whatever happened before, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from pytest_gpubench.matrix import ProviderNode
from pytest_gpubench.targets import CommandResult
from pytest_gpubench.targets.ssh import HostKeyError, SshProcess, SshTarget
from pytest_gpubench.targets.stages import SetupStep, Stage, StageError, setup_steps

log = logging.getLogger(__name__)

MIN_CONFIDENCE = 0.5
WAITING_STATUSES = ("pending", "provisioning")
RUNNING = "running"
HTTP_TIMEOUT_S = 30.0
DONE_ATTEMPTS = 3
_PRIVATE_KEY_BLOCK = re.compile(
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(-----END [A-Z0-9 ]*PRIVATE KEY-----|$)", re.DOTALL
)

T = TypeVar("T")


@dataclass(frozen=True)
class Offer:
    """One machine the marketplace would rent, as `GET /api/v1/inventory` lists it."""

    id: str | int
    provider: str
    gpu_name: str
    vram_gb: float | None
    price_per_hour: float
    availability_confidence: float | None = None

    @classmethod
    def from_api(cls, raw: Any) -> Offer | None:
        """The offer in one inventory entry; None for an entry too malformed to consider."""
        if not isinstance(raw, dict) or "id" not in raw or "price_per_hour" not in raw:
            return None
        try:
            vram = raw.get("vram_gb")
            confidence = raw.get("availability_confidence")
            return cls(
                id=raw["id"],
                provider=str(raw.get("provider", "")),
                gpu_name=str(raw.get("gpu_name", "")),
                vram_gb=None if vram is None else float(vram),
                price_per_hour=float(raw["price_per_hour"]),
                availability_confidence=None if confidence is None else float(confidence),
            )
        except (TypeError, ValueError):
            return None


def choose_offers(
    offers: Sequence[Offer], *, max_price: float, min_vram_gb: float | None
) -> list[Offer]:
    """Offers worth trying, best first: likely available, enough VRAM, within budget, cheapest.

    An offer without a confidence is not held against; one without a VRAM figure is kept only
    when no minimum is asked for.
    """
    eligible = [
        offer
        for offer in offers
        if (offer.availability_confidence is None or offer.availability_confidence > MIN_CONFIDENCE)
        and offer.price_per_hour <= max_price
        and (min_vram_gb is None or (offer.vram_gb is not None and offer.vram_gb >= min_vram_gb))
    ]
    return sorted(eligible, key=lambda offer: (offer.price_per_hour, str(offer.id)))


class _NoPublicIp(Exception):
    """The host behind an offer has no public address left; another offer may."""


class ProviderProcess:
    """A background process on the rented node; errors say when the provider stopped it."""

    def __init__(self, target: ProviderTarget, process: SshProcess) -> None:
        self._target = target
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._target._guarded("benchmark", lambda _: self._process.alive())

    def stop(self, timeout_s: float = 10.0) -> None:
        self._target._guarded("benchmark", lambda _: self._process.stop(timeout_s))

    def log_tail(self, max_bytes: int = 4000) -> str:
        return self._target._guarded("benchmark", lambda _: self._process.log_tail(max_bytes))


class ProviderTarget:
    """A machine rented for this run; `open()` provisions it, `close()` always gives it back."""

    def __init__(
        self,
        node_id: str,
        node: ProviderNode,
        *,
        poll_interval_s: float = 5.0,
        watch_interval_s: float = 30.0,
    ) -> None:
        self.node_id = node_id
        self.node = node
        self.poll_interval_s = poll_interval_s
        self.watch_interval_s = watch_interval_s
        self.api = str(node.api).rstrip("/")
        self.offer: Offer | None = None
        self.session_id: str | None = None
        self.ssh_host: str | None = None
        self.ssh_port = 22
        self.ssh_user = node.user
        self.done_marked = False
        self.key_dir: Path | None = None
        self.key_path: Path | None = None
        self._token = self._api_token()
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        self._http = httpx.Client(
            base_url=self.api, headers=headers, timeout=HTTP_TIMEOUT_S, trust_env=False
        )
        self._ssh: SshTarget | None = None
        self._listed = 0
        self._created_at: float | None = None
        self._ended_at: float | None = None
        self._stopped_reason: str | None = None
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._closed = False

    # --- provisioning ---------------------------------------------------------------------

    def open(self) -> ProviderTarget:
        """Provision, wait for SSH, connect and run the setup; on any failure give it all back."""
        try:
            self._provision()
            self._start_watch()
            host, port = self._wait_for_ssh()
            self._ssh = self._connect(host, port)
            steps = setup_steps(self.node.setup, self.node.model_pull)
            self._setup(steps)
        except BaseException:
            self.close()
            raise
        return self

    def _api_token(self) -> str | None:
        name = self.node.api_token_env
        if name is None:
            return None
        value = os.environ.get(name)
        if not value:
            raise StageError("provision", f"node {self.node_id}: api_token_env: ${name} is not set")
        return value

    def _fail(self, stage: Stage, message: str) -> StageError:
        return StageError(stage, self._redact(f"node {self.node_id}: {message}"))

    def _redact(self, text: str) -> str:
        """Secrets out of anything that may reach an error message or a log."""
        text = _PRIVATE_KEY_BLOCK.sub("[private key redacted]", text)
        if self._token:
            text = text.replace(self._token, "[token redacted]")
        return text

    def _api_error(self, response: httpx.Response) -> str:
        detail = response.text.strip()
        with contextlib.suppress(ValueError):
            body = response.json()
            if isinstance(body, dict):
                found = body.get("error") or body.get("detail") or body.get("message")
                if found:
                    detail = str(found)
        # Redacted before it is shortened, so no cut-off fragment of a secret slips through.
        return f"HTTP {response.status_code}: {self._redact(detail)[:300]}"

    def _request(self, stage: Stage, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._fail(
                stage, f"provider API {self.api} unreachable ({type(exc).__name__}: {exc})"
            ) from None

    def _provision(self) -> None:
        deadline = time.monotonic() + self.node.provision_timeout_s
        candidates = choose_offers(
            self._inventory(), max_price=self.node.max_price, min_vram_gb=self.node.min_vram_gb
        )
        if not candidates:
            raise self._no_offer_error()
        without_ip: list[str] = []
        for offer in candidates:
            try:
                self._create_session(offer)
                self._await_running(deadline)
            except _NoPublicIp as exc:
                log.warning(
                    "node %s: offer %s: %s; trying the next offer", self.node_id, offer.id, exc
                )
                without_ip.append(str(offer.id))
                self._give_back_session()
                continue
            return
        raise self._fail(
            "provision", f"no public IP on any offer ({', '.join(without_ip)}); try again later"
        )

    def _inventory(self) -> list[Offer]:
        params: dict[str, str] = {"gpu_type": self.node.gpu_type}
        if self.node.provider:
            params["provider"] = self.node.provider
        if self.node.min_vram_gb is not None:
            params["min_vram"] = f"{self.node.min_vram_gb:g}"
        response = self._request("provision", "GET", "/api/v1/inventory", params=params)
        if response.status_code != 200:
            raise self._fail("provision", f"inventory query failed: {self._api_error(response)}")
        try:
            body = response.json()
        except ValueError:
            raise self._fail("provision", "inventory answer is not JSON") from None
        raw_offers = body.get("offers") if isinstance(body, dict) else body
        if not isinstance(raw_offers, list):
            raise self._fail("provision", "inventory answer holds no list of offers")
        self._listed = len(raw_offers)
        return [offer for offer in map(Offer.from_api, raw_offers) if offer is not None]

    def _no_offer_error(self) -> StageError:
        wanted = f"gpu_type {self.node.gpu_type!r}"
        if self.node.provider:
            wanted += f" from {self.node.provider}"
        if self.node.min_vram_gb is not None:
            wanted += f" with at least {self.node.min_vram_gb:g} GB VRAM"
        return self._fail(
            "provision",
            f"no offer for {wanted} at or below max_price {self.node.max_price:g}/h with "
            f"availability confidence above {MIN_CONFIDENCE} ({self._listed} listed); raise "
            "max_price or try another gpu_type",
        )

    def _create_session(self, offer: Offer) -> None:
        body = {
            "consumer_id": self.node.consumer_id,
            "offer_id": offer.id,
            "workload_type": self.node.workload_type,
            "reservation_hours": self.node.reservation_hours,
        }
        response = self._request("provision", "POST", "/api/v1/sessions", json=body)
        if response.status_code >= 400:
            problem = self._api_error(response)
            if "public ip" in problem.lower():
                raise _NoPublicIp(problem)
            raise self._fail("provision", f"creating a session on offer {offer.id}: {problem}")
        try:
            created = response.json()
            session = created["session"]
            session_id = str(session["id"])
        except (ValueError, KeyError, TypeError):
            raise self._fail("provision", "session answer lacks session.id") from None
        self.offer = offer
        self.session_id = session_id
        self.done_marked = False
        # Cost counts from creation, not from `running`: some providers bill from there, and
        # an upper bound is the safer figure.
        self._created_at = time.monotonic()
        self._ended_at = None
        key = created.get("ssh_private_key")
        if not isinstance(key, str) or "PRIVATE KEY" not in key:
            raise self._fail("provision", f"session {session_id}: answer lacks ssh_private_key")
        self._write_key(key)
        self._take_ssh_address(session)
        log.info(
            "node %s: session %s on offer %s (%s, %s/h)",
            self.node_id,
            session_id,
            offer.id,
            offer.gpu_name,
            offer.price_per_hour,
        )

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

    def _session_state(self, stage: Stage) -> dict[str, Any]:
        response = self._request(stage, "GET", f"/api/v1/sessions/{self.session_id}")
        if response.status_code != 200:
            raise self._fail(
                stage, f"session {self.session_id}: status query: {self._api_error(response)}"
            )
        try:
            session = response.json()["session"]
        except (ValueError, KeyError, TypeError):
            raise self._fail(
                stage, f"session {self.session_id}: status answer lacks session"
            ) from None
        if not isinstance(session, dict):
            raise self._fail(stage, f"session {self.session_id}: status answer lacks session")
        return session

    def _await_running(self, deadline: float) -> None:
        status = "unknown"
        while True:
            session = self._session_state("provision")
            status = str(session.get("status", "unknown"))
            if status == RUNNING:
                self._take_ssh_address(session)
                if not self.ssh_host:
                    raise self._fail(
                        "provision", f"session {self.session_id} runs without ssh_host"
                    )
                return
            if status not in WAITING_STATUSES:
                error = str(session.get("error") or "no error given")
                if "public ip" in error.lower():
                    raise _NoPublicIp(self._redact(error))
                ended = "failed" if status == "failed" else f"was {status} by the provider"
                raise self._fail("provision", f"session {self.session_id} {ended}: {error}")
            if time.monotonic() >= deadline:
                raise self._fail(
                    "provision",
                    f"session {self.session_id} not running after "
                    f"{self.node.provision_timeout_s:g} s (status {status}); raise "
                    "provision_timeout_s or try another offer",
                )
            time.sleep(min(self.poll_interval_s, max(0.0, deadline - time.monotonic())))

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
        try:
            session = self._session_state("benchmark")
        except StageError:
            return None  # the API is briefly unreachable: no evidence the instance stopped
        status = str(session.get("status", "unknown"))
        if status == RUNNING:
            return None
        error = session.get("error")
        return self._redact(
            f"node {self.node_id}: the provider stopped the instance (session {self.session_id} "
            f"is {status}{': ' + str(error) if error else ''})"
        )

    def _guarded(self, stage: Stage, call: Callable[[SshTarget], T]) -> T:
        """Run a call on the SSH target; when it fails, say so if the instance was stopped."""
        if self._stopped_reason is not None:
            raise StageError(stage, self._stopped_reason)
        if self._ssh is None:
            raise self._fail(stage, "not provisioned (open() not called, or closed)")
        try:
            return call(self._ssh)
        except StageError as exc:
            reason = self._stopped_by_provider()
            if reason is not None:
                self._stopped_reason = reason
                raise StageError(exc.stage, reason) from None
            raise

    # --- SSH ------------------------------------------------------------------------------

    def _wait_for_ssh(self) -> tuple[str, int]:
        """Until the instance's sshd answers with its banner (a heavy image may still pull)."""
        assert self.ssh_host is not None
        host, port = self.ssh_host, self.ssh_port
        deadline = time.monotonic() + self.node.ssh_wait_timeout_s
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
                raise self._fail(
                    "ssh_wait",
                    f"{host}:{port} did not answer SSH within {self.node.ssh_wait_timeout_s:g} s "
                    f"({last}); a large image may still be pulling: raise ssh_wait_timeout_s",
                )
            time.sleep(min(1.0, self.poll_interval_s, max(0.0, deadline - time.monotonic())))

    def _connect(self, host: str, port: int) -> SshTarget:
        assert self.key_path is not None and self.key_dir is not None
        # Until the instance has installed the session key, logins fail; retry a little while.
        deadline = time.monotonic() + min(self.node.ssh_wait_timeout_s, 120.0)
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

    def _setup(self, steps: Sequence[SetupStep]) -> None:
        if steps:
            self._guarded(
                steps[0].stage, lambda ssh: ssh.run_setup(steps, self.node.setup_timeout_s)
            )

    # --- the Target protocol --------------------------------------------------------------

    def run(self, argv: Sequence[str], *, timeout_s: float) -> CommandResult:
        return self._guarded("benchmark", lambda ssh: ssh.run(argv, timeout_s=timeout_s))

    def run_setup(self, steps: Sequence[SetupStep], timeout_s: float) -> None:
        self._guarded(
            steps[0].stage if steps else "engine_install",
            lambda ssh: ssh.run_setup(steps, timeout_s),
        )

    def start(self, argv: Sequence[str], *, log_path: str) -> ProviderProcess:
        process = self._guarded("benchmark", lambda ssh: ssh.start(argv, log_path=log_path))
        return ProviderProcess(self, process)

    def free_port(self) -> int:
        return self._guarded("benchmark", lambda ssh: ssh.free_port())

    def reach(self, host: str, port: int) -> tuple[str, int]:
        return self._guarded("benchmark", lambda ssh: ssh.reach(host, port))

    def read_file(self, path: str, *, timeout_s: float) -> bytes:
        return self._guarded("results", lambda ssh: ssh.read_file(path, timeout_s=timeout_s))

    def gpu_inventory(self) -> list[dict[str, str]]:
        return self._guarded("benchmark", lambda ssh: ssh.gpu_inventory())

    def elapsed_s(self) -> float:
        """Seconds since the session was created, frozen once it is given back."""
        if self._created_at is None:
            return 0.0
        end = self._ended_at if self._ended_at is not None else time.monotonic()
        return end - self._created_at

    def cost(self) -> float:
        price = self.offer.price_per_hour if self.offer is not None else 0.0
        return self.elapsed_s() / 3600.0 * price

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        if self._ssh is not None and self._stopped_reason is None and not self._closed:
            with contextlib.suppress(StageError):
                facts.update(self._ssh.describe())
        offer = self.offer
        facts.update(
            {
                "kind": "provider",
                "api": self.api,
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

    # --- giving it back -------------------------------------------------------------------

    def close(self) -> None:
        """Mark the session done and delete the key; safe to call again and after any failure."""
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
                self._delete_key()
                self._http.close()

    def _give_back_session(self) -> None:
        if self.session_id is None:
            return
        session_id = self.session_id
        if self._ended_at is None:
            self._ended_at = time.monotonic()
        for attempt in range(1, DONE_ATTEMPTS + 1):
            problem = ""
            try:
                response = self._http.post(f"/api/v1/sessions/{session_id}/done")
                if response.status_code < 400:
                    self.done_marked = True
                    log.info("node %s: session %s marked done", self.node_id, session_id)
                    break
                problem = self._api_error(response)
                if response.status_code < 500:
                    break
            except httpx.HTTPError as exc:
                problem = type(exc).__name__
            if attempt < DONE_ATTEMPTS:
                time.sleep(0.5 * attempt)
        if not self.done_marked:
            # Nothing to raise into (this runs in finally); the charges go on, so say it loudly.
            log.error(
                "node %s: could not mark session %s done at %s (%s): end it by hand",
                self.node_id,
                session_id,
                self.api,
                problem,
            )
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
