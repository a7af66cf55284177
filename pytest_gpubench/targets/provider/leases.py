"""Rentals in the lease journal (targets/leases.py): a session a killed run left is given back
by the next run on the same API or by `gpubench leases --release`, with what it cost."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpubench.config.nodes import ProviderNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.targets.leases import JournalEntry, RentalJournal, leaked_lease
from pytest_gpubench.targets.provider.api import MarketplaceClient

if TYPE_CHECKING:
    from pytest_gpubench.targets.protocol import Rental

log = logging.getLogger(__name__)

KIND = "provider"


def api_key(node: ProviderNode) -> str:
    """Which API a rental was made through, as the journal tells them apart."""
    return str(node.api).rstrip("/")


def release_leaked_rentals(journal: RentalJournal, node: ProviderNode) -> list[Rental]:
    """Give back the sessions of this node's API that a killed run left; each one's cost."""
    released = []
    for entry in journal.leaked(api_key(node)):
        log.warning(
            "node %s: session %s was left rented by a run that was killed; giving it back",
            entry.facts.get("node"),
            entry.session_id,
        )
        released.append(release_rental(entry, journal))
    return released


def describe(entry: JournalEntry, state: str) -> str:
    facts = entry.facts
    return (
        f"node {facts.get('node')}: session {entry.session_id} at {facts.get('api')} "
        f"({facts.get('gpu_name')}, {facts.get('price_per_hour')}/h, since "
        f"{facts.get('created_at_utc')}): {state}"
    )


def release_rental(entry: JournalEntry, journal: RentalJournal) -> Rental:
    """Give a leaked session back (POST .../done, with the token from its environment
    variable) and return what it cost, in the shape of a rental given back (RentalClosed) plus
    `leaked: true`. An entry whose session was never created is struck off: nothing to give
    back. One whose session could not be marked done stays, to be tried again."""
    facts = entry.facts
    elapsed, cost = entry.cost(time.time())
    done = False
    if entry.session_id is None:
        journal.close(entry.path)
    else:
        node = ProviderNode(
            kind="provider",
            api=facts["api"],
            gpu_type=str(facts.get("gpu_type") or "unknown"),
            max_price=float(facts.get("max_price") or 1.0),
            api_token_env=facts.get("api_token_env"),
        )
        try:
            client = MarketplaceClient(str(facts.get("node")), node)
        except GpubenchError as exc:  # its token's variable is not set here
            log.error("rental %s: cannot give it back: %s", entry.session_id, exc)
        else:
            try:
                done = client.mark_done(entry.session_id)
            finally:
                client.close()
        if done:
            _delete_key_dir(facts.get("key_dir"))
            journal.close(entry.path)
    given_back = leaked_lease(
        entry,
        KIND,
        offer_id=facts.get("offer_id"),
        gpu_name=facts.get("gpu_name"),
        price_per_hour=facts.get("price_per_hour"),
        elapsed_s=round(elapsed, 3),
        cost=round(cost, 6),
    )
    given_back["session_done"] = done
    return given_back


def _delete_key_dir(key_dir: Any) -> None:
    """The session's temporary key, left on disk by the killed run (only a folder the provider
    target made: `gpubench-provider-*` in the temporary directory)."""
    if not isinstance(key_dir, str):
        return
    folder = Path(key_dir)
    if folder.name.startswith("gpubench-provider-") and folder.parent == Path(
        tempfile.gettempdir()
    ):
        shutil.rmtree(folder, ignore_errors=True)
