"""Managed Ollama: `ollama serve` on the node's loopback, with the cell's environment.

`OLLAMA_HOST` is set to the port the harness chose; `launch_env` adds the rest (`OLLAMA_MODELS`
for the models directory, `OLLAMA_KEEP_ALIVE`). The model is pulled afterwards, as its own
stage (model_pull), through the API the `ollama pull` command itself uses.
"""

from __future__ import annotations

import json
import time

import httpx

from pytest_gpubench.config.cell import Cell
from pytest_gpubench.engines.launch_plan import LaunchPlan
from pytest_gpubench.engines.protocol import control_client
from pytest_gpubench.targets import Target
from pytest_gpubench.targets.stages import StageError

OLLAMA_LAUNCH = ("ollama", "serve")


def ollama_plan(cell: Cell, target: Target) -> LaunchPlan:
    """`ollama serve` (or the cell's `launch:`), healthy once `/api/version` answers."""
    spec = cell.spec
    return LaunchPlan(
        launch=tuple(spec.launch or OLLAMA_LAUNCH),
        health_path="/api/version",
        program="ollama",
        values={"model": spec.model, "model_path": spec.model_path or spec.model},
        env={"OLLAMA_HOST": "{host}:{port}"},
        pulls_model=True,
    )


def pull_model(base_url: str, model: str, timeout_s: float) -> dict[str, object]:
    """Stage model_pull: POST /api/pull (what `ollama pull` sends), its NDJSON progress read to
    the end. Returns the progress kept in the stage record: each status in order (once), the
    bytes of each layer, the seconds it took. An `error` line, or no `success`, fails it."""
    started = time.monotonic()
    statuses: list[str] = []
    layers: dict[str, int] = {}
    try:
        with (
            control_client(timeout_s) as client,
            client.stream(
                "POST", f"{base_url}/api/pull", json={"model": model, "stream": True}
            ) as response,
        ):
            for line in response.iter_lines():
                if time.monotonic() - started > timeout_s:
                    raise httpx.ReadTimeout("pull ran past its timeout")
                if not line.strip():
                    continue
                try:
                    progress = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(progress, dict):
                    continue
                if progress.get("error"):
                    raise StageError(
                        "model_pull", f"ollama pull {model}: {str(progress['error'])[:300]}"
                    )
                status = str(progress.get("status", ""))
                if status.startswith("pulling ") and "digest" in progress:
                    status = "pulling"
                    total = progress.get("total")
                    if isinstance(total, int):
                        layers[str(progress["digest"])] = total
                if status and status not in statuses:
                    statuses.append(status)
    except httpx.TimeoutException:
        raise StageError(
            "model_pull",
            f"ollama pull {model} did not finish within {timeout_s:g} s "
            f"(last status: {statuses[-1] if statuses else 'none yet'})",
            timed_out=True,
        ) from None
    except httpx.HTTPError as exc:
        raise StageError(
            "model_pull", f"ollama pull {model}: {type(exc).__name__}: {exc}"
        ) from None
    if "success" not in statuses:
        raise StageError("model_pull", f"ollama pull {model} ended without success ({statuses})")
    return {
        "statuses": statuses,
        "layers": len(layers),
        "bytes": sum(layers.values()),
        "seconds": round(time.monotonic() - started, 3),
    }


def pulled_model_bytes(base_url: str, model: str) -> float | None:
    """The pulled model's size in bytes, from GET /api/tags (None when not listed)."""
    wanted = (model, f"{model}:latest")
    with control_client(30.0) as client:
        listed = client.get(f"{base_url}/api/tags").json()
    for entry in listed.get("models") or [] if isinstance(listed, dict) else []:
        if isinstance(entry, dict) and entry.get("name") in wanted:
            size = entry.get("size")
            return float(size) if isinstance(size, int | float) else None
    return None
