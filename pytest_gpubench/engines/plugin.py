"""A plugin's engine as the harness calls it (pytest_gpubench_make_engine): one that follows the
Engine protocol as it is, one written before the request object (issue 45) or without `kinds`
behind _PluginEngine."""

from __future__ import annotations

import inspect
from typing import Any, cast

from pytest_gpubench.engines.protocol import Engine, Request, _failed
from pytest_gpubench.measure.call_measurement import CallMeasurement


class _PluginEngine:
    """A plugin's engine without `kinds` (chat only), or written to the protocol before the
    request object (issue 45): `chat(prompt, max_tokens, timeout_s)`, taking `request=` (the
    request keys), `messages=` and `extra_body=` only where it names them. Its calls get what
    they got then; everything else is the engine's own."""

    def __init__(self, engine: Any, takes: list[str]) -> None:
        self._engine = engine
        self._takes = takes
        self.kinds: tuple[str, ...] = tuple(getattr(engine, "kinds", ("chat",)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def chat(self, request: Request, timeout_s: float) -> CallMeasurement:
        if self._takes[:1] != ["prompt"]:
            result: CallMeasurement = self._engine.chat(request, timeout_s)
            return result
        # As the harness passed them then: the request keys where any is set.
        shape = (
            request.shape if request.shape and request.shape.model_dump(exclude_none=True) else None
        )
        given = {"request": shape, "messages": request.messages, "extra_body": request.extra_body}
        passed = {name: value for name, value in given.items() if value is not None}
        unknown = sorted(set(passed) - set(self._takes))
        if unknown:
            kind = self._engine.kind
            return _failed(kind, f"engine {kind}'s chat takes no {', '.join(unknown)}")
        result = self._engine.chat(request.prompt, request.max_tokens, timeout_s, **passed)
        return result


def plugin_engine(engine: Any) -> Engine:
    """A plugin's engine as the harness calls it: as it is where it follows the protocol (its
    `kinds`, a chat taking a Request), else behind _PluginEngine."""
    try:
        takes = list(inspect.signature(engine.chat).parameters)
    except (AttributeError, TypeError, ValueError):
        return cast(Engine, engine)
    if takes[:1] != ["prompt"] and hasattr(engine, "kinds"):
        return cast(Engine, engine)
    return cast(Engine, _PluginEngine(engine, takes))
