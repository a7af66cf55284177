"""Whether an answer is valid for its request kind (issue 35): a `tools` call's tool calls name an
offered tool and their arguments follow its JSON Schema; a `json_schema` call's answer parses as
JSON and follows the schema. Pure: a measurement and the prompt's kind keys in, 1 or 0 out."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator
from referencing.exceptions import Unresolvable

from pytest_gpubench.measure.call_measurement import CallMeasurement


def follows(instance: Any, schema: Mapping[str, Any]) -> bool:
    """Whether `instance` is valid against the JSON Schema `schema` (draft 2020-12). A local
    `$ref` that points at nothing (prompts.yaml's schemas have no other: config/prompts.py)
    cannot be followed, so no answer is valid against it."""
    try:
        return bool(Draft202012Validator(dict(schema)).is_valid(instance))
    except Unresolvable:
        return False


def parsed(text: str) -> tuple[bool, Any]:
    """(True, the JSON value) where `text` is one JSON value, else (False, None)."""
    try:
        return True, json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False, None


def tool_calls_valid(calls: list[dict[str, str]], keys: Mapping[str, Any]) -> bool:
    """At least one tool call came back; each names an offered tool (the named one where
    tool_choice names one) and its arguments parse as a JSON object that follows the tool's
    parameters schema."""
    tools = {
        tool["function"]["name"]: tool["function"].get("parameters") or {}
        for tool in keys.get("tools") or ()
    }
    choice = keys.get("tool_choice") or "required"
    named = choice if choice not in ("auto", "required", "none") else None
    if not calls:
        return False
    for call in calls:
        name = call.get("name", "")
        if name not in tools or (named is not None and name != named):
            return False
        ok, arguments = parsed(call.get("arguments") or "{}")
        if not ok or not isinstance(arguments, dict) or not follows(arguments, tools[name]):
            return False
    return True


def judge_answer(measurement: CallMeasurement, keys: Mapping[str, Any]) -> None:
    """Set the measurement's validity for its kind; a failed call gets none (its error counts
    against the success rate instead)."""
    if measurement.error is not None:
        return
    if measurement.kind == "tools":
        measurement.tool_call_valid = int(tool_calls_valid(measurement.tool_calls, keys))
    elif measurement.kind == "json_schema":
        ok, answer = parsed(measurement.text.strip())
        schema = keys.get("json_schema") or {}
        measurement.schema_valid = int(ok and follows(answer, schema))
