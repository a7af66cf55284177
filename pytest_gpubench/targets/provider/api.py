"""The marketplace API client: inventory and offer choice, sessions created, polled, marked done.

Every error it raises is a StageError that names the node, with the API token and any private
key cut out.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pytest_gpubench.config.nodes import ProviderNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.secrets import SecretScrubber, secret_from_env
from pytest_gpubench.targets.stages import Stage, StageError

log = logging.getLogger(__name__)

MIN_CONFIDENCE = 0.5
WAITING_STATUSES = ("pending", "provisioning")
RUNNING = "running"
HTTP_TIMEOUT_S = 30.0
DONE_ATTEMPTS = 3


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


class NoPublicIp(Exception):
    """The host behind an offer has no public address left; another offer may."""


@dataclass(frozen=True)
class CreatedSession:
    """A session the marketplace has just created: its id, its state and its SSH login key
    (None when the answer lacks one)."""

    session_id: str
    session: dict[str, object]
    private_key: str | None


class MarketplaceClient:
    """The marketplace API as one rented node uses it, authenticated by the node's token."""

    def __init__(self, node_id: str, node: ProviderNode) -> None:
        self.node_id = node_id
        self.node = node
        self.api = str(node.api).rstrip("/")
        self._token = self._api_token()
        self._scrub = SecretScrubber([self._token] if self._token else [])
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        self._http = httpx.Client(
            base_url=self.api, headers=headers, timeout=HTTP_TIMEOUT_S, trust_env=False
        )
        # How many offers the last inventory listed, before any choice: for the no-offer error.
        self.listed = 0

    def _api_token(self) -> str | None:
        name = self.node.api_token_env
        if name is None:
            return None
        try:
            return secret_from_env(name, owner=f"node {self.node_id}", key="api_token_env")
        except GpubenchError as exc:
            raise StageError("provision", str(exc)) from None

    def fail(self, stage: Stage, message: str) -> StageError:
        """The error for a failure of this node, secrets cut out."""
        return StageError(stage, self.redact(f"node {self.node_id}: {message}"))

    def redact(self, text: str) -> str:
        """Secrets (the token, any private key) out of anything that may reach an error message
        or a log."""
        return self._scrub(text)

    def _api_error(self, response: httpx.Response) -> str:
        detail = response.text.strip()
        with contextlib.suppress(ValueError):
            body = response.json()
            if isinstance(body, dict):
                found = body.get("error") or body.get("detail") or body.get("message")
                if found:
                    detail = str(found)
        # Redacted before it is shortened, so no cut-off fragment of a secret slips through.
        return f"HTTP {response.status_code}: {self.redact(detail)[:300]}"

    def _request(self, stage: Stage, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise StageError(
                stage,
                self.redact(
                    f"node {self.node_id}: provider API {self.api} did not answer in "
                    f"time ({type(exc).__name__})"
                ),
                timed_out=True,
            ) from None
        except httpx.HTTPError as exc:
            raise self.fail(
                stage, f"provider API {self.api} unreachable ({type(exc).__name__}: {exc})"
            ) from None

    def inventory(self, timeout_s: float = HTTP_TIMEOUT_S) -> list[Offer]:
        """The offers listed for the node's gpu_type (and provider, and VRAM minimum); stage
        inventory."""
        params: dict[str, str] = {"gpu_type": self.node.gpu_type}
        if self.node.provider:
            params["provider"] = self.node.provider
        if self.node.min_vram_gb is not None:
            params["min_vram"] = f"{self.node.min_vram_gb:g}"
        response = self._request(
            "inventory", "GET", "/api/v1/inventory", params=params, timeout=timeout_s
        )
        if response.status_code != 200:
            raise self.fail("inventory", f"inventory query failed: {self._api_error(response)}")
        try:
            body = response.json()
        except ValueError:
            raise self.fail("inventory", "inventory answer is not JSON") from None
        raw_offers = body.get("offers") if isinstance(body, dict) else body
        if not isinstance(raw_offers, list):
            raise self.fail("inventory", "inventory answer holds no list of offers")
        self.listed = len(raw_offers)
        return [offer for offer in map(Offer.from_api, raw_offers) if offer is not None]

    def no_offer_error(self) -> StageError:
        wanted = f"gpu_type {self.node.gpu_type!r}"
        if self.node.provider:
            wanted += f" from {self.node.provider}"
        if self.node.min_vram_gb is not None:
            wanted += f" with at least {self.node.min_vram_gb:g} GB VRAM"
        return self.fail(
            "inventory",
            f"no offer for {wanted} at or below max_price {self.node.max_price:g}/h with "
            f"availability confidence above {MIN_CONFIDENCE} ({self.listed} listed); raise "
            "max_price or try another gpu_type",
        )

    def create_session(self, offer: Offer) -> CreatedSession:
        """Rent the offer. Raises NoPublicIp when its host has no public address left."""
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
                raise NoPublicIp(problem)
            raise self.fail("provision", f"creating a session on offer {offer.id}: {problem}")
        try:
            created = response.json()
            session = created["session"]
            session_id = str(session["id"])
        except (ValueError, KeyError, TypeError):
            raise self.fail("provision", "session answer lacks session.id") from None
        key = created.get("ssh_private_key")
        return CreatedSession(session_id, session, key if isinstance(key, str) else None)

    def session_state(self, stage: Stage, session_id: str) -> dict[str, object]:
        response = self._request(stage, "GET", f"/api/v1/sessions/{session_id}")
        if response.status_code != 200:
            raise self.fail(
                stage, f"session {session_id}: status query: {self._api_error(response)}"
            )
        try:
            session = response.json()["session"]
        except (ValueError, KeyError, TypeError):
            raise self.fail(stage, f"session {session_id}: status answer lacks session") from None
        if not isinstance(session, dict):
            raise self.fail(stage, f"session {session_id}: status answer lacks session")
        return session

    def wait_until_running(
        self, session_id: str, deadline: float, poll_interval_s: float, limit_s: float
    ) -> dict[str, object]:
        """The session's state once it runs; raises when it ends or the deadline passes."""
        while True:
            session = self.session_state("provision", session_id)
            status = str(session.get("status", "unknown"))
            if status == RUNNING:
                return session
            if status not in WAITING_STATUSES:
                error = str(session.get("error") or "no error given")
                if "public ip" in error.lower():
                    raise NoPublicIp(self.redact(error))
                ended = "failed" if status == "failed" else f"was {status} by the provider"
                raise self.fail("provision", f"session {session_id} {ended}: {error}")
            if time.monotonic() >= deadline:
                raise StageError(
                    "provision",
                    self.redact(
                        f"node {self.node_id}: session {session_id} not running after "
                        f"{limit_s:g} s (status {status}); raise provision_timeout_s or try "
                        "another offer"
                    ),
                    timed_out=True,
                )
            time.sleep(min(poll_interval_s, max(0.0, deadline - time.monotonic())))

    def stopped_reason(self, session_id: str) -> str | None:
        """Why the instance is gone, when the API says it no longer runs; else None."""
        try:
            session = self.session_state("benchmark", session_id)
        except StageError:
            return None  # the API is briefly unreachable: no evidence the instance stopped
        status = str(session.get("status", "unknown"))
        if status == RUNNING:
            return None
        error = session.get("error")
        return self.redact(
            f"node {self.node_id}: the provider stopped the instance (session {session_id} "
            f"is {status}{': ' + str(error) if error else ''})"
        )

    def mark_done(self, session_id: str) -> bool:
        """End the session (and its charges), retried a few times; False when that failed."""
        problem = ""
        for attempt in range(1, DONE_ATTEMPTS + 1):
            try:
                response = self._http.post(f"/api/v1/sessions/{session_id}/done")
                if response.status_code < 400:
                    log.info("node %s: session %s marked done", self.node_id, session_id)
                    return True
                problem = self._api_error(response)
                if response.status_code < 500:
                    break
            except httpx.HTTPError as exc:
                problem = type(exc).__name__
            if attempt < DONE_ATTEMPTS:
                time.sleep(0.5 * attempt)
        # Nothing to raise into (this runs in finally); the charges go on, so say it loudly.
        log.error(
            "node %s: could not mark session %s done at %s (%s): end it by hand",
            self.node_id,
            session_id,
            self.api,
            problem,
        )
        return False

    def close(self) -> None:
        self._http.close()
