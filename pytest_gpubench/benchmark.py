"""What a benchmark test gets from the fixtures: `BenchCase` (gpubench_case), `BenchEngine`
(gpubench_engine) and `ChatCall`, the result of one measured chat (docs/benchmarks.md "Writing a
benchmark test", "Writing your own benchmark")."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from pytest_gpubench.config.cases import Case, request_sha256
from pytest_gpubench.config.cell import Cell
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.engines import Request
from pytest_gpubench.ledger.records import skipped_record
from pytest_gpubench.ledger.schema import as_json
from pytest_gpubench.reports.junit import call_properties
from pytest_gpubench.run.guards import FrozenRequests
from pytest_gpubench.run.harness import Harness

if TYPE_CHECKING:
    from pytest_gpubench.engines import Engine


class ChatCall(Mapping[str, Any]):
    """What gpubench_engine.chat() returns: the call record (docs/benchmarks.md), read like
    a dict (`call["first_delta_ms"]`), and `text`, the answer (not in the ledger)."""

    def __init__(self, record: dict[str, Any], text: str) -> None:
        self.record = record
        self.text = text

    def __getitem__(self, key: str) -> Any:
        return self.record[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.record)

    def __len__(self) -> int:
        return len(self.record)

    @property
    def error(self) -> str | None:
        error = self.record.get("error")
        return None if error is None else str(error)

    def __repr__(self) -> str:
        return f"ChatCall(case_id={self.record.get('case_id')!r}, error={self.error!r})"


@dataclass
class BenchEngine:
    """What `gpubench_engine` gives a test: the cell's engine, ready (started, health-checked),
    and `chat()`, one measured call that goes into the ledger under the test's name."""

    case: Case
    harness: Harness
    frozen: FrozenRequests
    # The test's node id, for the messages that name it.
    nodeid: str
    records: list[dict[str, Any]] = field(default_factory=list)
    properties: list[tuple[str, object]] = field(default_factory=list)
    # The call records this case made, in order.
    calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def cell(self) -> Cell:
        """The cell (cell_id, spec.engine, spec.model, timeout_s, ...)."""
        return self.harness.matrix.cell(self.case.cell_id)

    @property
    def engine(self) -> Engine:
        """The engine itself (health, describe); its calls are not measured into the ledger."""
        engine = self.harness.cells[self.case.cell_id].engine
        assert engine is not None  # the fixture skipped the test otherwise
        return engine

    def chat(
        self,
        messages: str | Sequence[Mapping[str, Any]],
        max_tokens: int,
        *,
        answer_schema: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> ChatCall:
        """One streamed call, measured and recorded (prompt_id: the test's name, prompt_sha256:
        the hash of `messages`, `max_tokens`, `options` and `answer_schema`). `messages`: a
        string (one user turn) or the whole conversation; `options`: keys added to the
        request's JSON body. `answer_schema`: a JSON Schema the answer is judged against, not
        sent: the call is recorded as kind json_schema with `schema_valid` (1 or 0), a figure
        the gate judges as it judges a json_schema prompt's (docs/request-kinds.md), instead of
        a failed test. A request that differs from the one this test was baselined with is
        refused, unsent."""
        test_id = self.case.test_id
        if test_id is None:
            pytest.fail(
                f"{self.nodeid}: gpubench_engine.chat() measures a test's own requests; this "
                "test asks for gpubench_case, which measures the prompts of prompts.yaml: call "
                "gpubench_case.run()",
                pytrace=False,
            )
        conversation = _conversation(messages, self.nodeid)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            pytest.fail(
                f"{self.nodeid}: max_tokens: expected a positive integer, got {max_tokens!r}",
                pytrace=False,
            )
        schema = _answer_schema(answer_schema, self.nodeid)
        try:
            sha256 = request_sha256(conversation, max_tokens, options, answer_schema=schema)
        except (TypeError, ValueError) as exc:
            pytest.fail(f"{self.nodeid}: request options are not JSON: {exc}", pytrace=False)
        try:
            self.frozen.check(self.case.cell_id, test_id, sha256, self.nodeid)
        except GpubenchError as exc:
            pytest.fail(str(exc), pytrace=False)
        request = Request("", max_tokens, messages=conversation, extra_body=dict(options))
        record, others, text = self.harness.measure(self.case, request, sha256)
        if schema is not None:
            record = _judged(record, text, schema)
        self.calls.append(record)
        self.records.extend([record, *others])
        self.properties.extend(call_properties(record))
        return ChatCall(record, text)


def _answer_schema(schema: Mapping[str, Any] | None, nodeid: str) -> dict[str, object] | None:
    """The answer's JSON Schema as a dict, checked (draft 2020-12); a bad one fails the test."""
    if schema is None:
        return None
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, Mapping):
        pytest.fail(f"{nodeid}: answer_schema: expected a JSON Schema object, got {schema!r}"[:300],
                    pytrace=False)  # fmt: skip
    try:
        Draft202012Validator.check_schema(dict(schema))
    except SchemaError as exc:
        pytest.fail(f"{nodeid}: answer_schema: not a valid JSON Schema: {exc.message}"[:300],
                    pytrace=False)  # fmt: skip
    return dict(schema)


def _judged(record: dict[str, Any], text: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The call record of an answer judged against `schema`: kind json_schema, and
    `schema_valid` 1 or 0 (none for a failed call, whose error counts against the success
    rate), as a json_schema prompt's call has (measure/validity.py judges both)."""
    from pytest_gpubench.measure.validity import follows, parsed

    judged = {**record, "kind": "json_schema"}
    if record.get("error") is None:
        ok, answer = parsed(text.strip())
        judged["schema_valid"] = int(ok and follows(answer, schema))
    return judged


def _conversation(
    messages: str | Sequence[Mapping[str, Any]], nodeid: str
) -> list[dict[str, object]]:
    """The messages a test sends, as a list of {role, content, ...}; a string is one user turn."""
    if isinstance(messages, str):
        if not messages:
            pytest.fail(f"{nodeid}: messages: an empty prompt", pytrace=False)
        return [{"role": "user", "content": messages}]
    conversation = [dict(message) for message in messages if isinstance(message, Mapping)]
    if not conversation or len(conversation) != len(list(messages)):
        pytest.fail(
            f"{nodeid}: messages: expected a string or a non-empty list of "
            f"{{'role': ..., 'content': ...}} mappings, got {messages!r}"[:300],
            pytrace=False,
        )
    for index, message in enumerate(conversation):
        if not isinstance(message.get("role"), str) or "content" not in message:
            pytest.fail(
                f"{nodeid}: messages[{index}]: needs a 'role' and a 'content' ({message!r})"[:300],
                pytrace=False,
            )
    return conversation


@dataclass
class BenchCase:
    """What a benchmark test gets: the case, and `run()` to measure it once."""

    case: Case
    harness: Harness
    records: list[dict[str, Any]] = field(default_factory=list)
    record: dict[str, Any] | None = None
    # The test item's user_properties: the call's figures go into the JUnit XML from here.
    properties: list[tuple[str, object]] = field(default_factory=list)

    def run(self) -> dict[str, Any]:
        """Measure the case once; returns its call record (docs/benchmarks.md); the case's
        sample record travels beside it."""
        made: tuple[dict[str, Any], list[dict[str, Any]]] | GpubenchError
        try:
            made = self.harness.run_case(self.case)
        except GpubenchError as exc:
            made = exc
        if isinstance(made, GpubenchError):
            self._not_made(made)  # outside the except: the failure is one line, no chain
        record, others = made
        self.record = record
        self.records.extend([record, *others])
        self.properties.extend(call_properties(record))
        return record

    def _not_made(self, error: GpubenchError) -> NoReturn:
        """A case its cell cannot make (a synthetic prompt no tokenizer counts exactly, a changed
        one refused against its baseline): a `skipped` record at stage `benchmark` (the cell's
        outcome then says why it was not measured), and the test fails in one line."""
        reason = self.harness.scrub(f"cell {self.case.cell_id}: {error}")
        cell = self.harness.matrix.cell(self.case.cell_id)
        record = skipped_record(
            run_id=self.harness.run_id, cell=cell, case=self.case, reason=reason, stage="benchmark"
        )
        self.records.append(self.harness.scrub.record(as_json(record)))
        pytest.fail(reason, pytrace=False)
