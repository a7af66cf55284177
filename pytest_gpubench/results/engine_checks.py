"""The warm calls checked against the engine's own word (issue 35), per (cell, prompt): the
client's count of streamed tokens against the engine's usage, the prompts its prefix cache
served (and whether the request had asked for none), its counters over the calls (preemptions,
queued requests, KV-cache usage, speculative decoding), and the verdicts a cell asks of them:
`token_check: fail` and `thresholds: {max_preemptions: N}`. Pure: records in, summaries and
verdicts out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_gpubench.config.metrics import ENGINE_COUNTERS

if TYPE_CHECKING:
    from pytest_gpubench.results.gate import Verdict
    from pytest_gpubench.results.judging import JudgingSettings

# The verdicts' metric names (the end record, JUnit, exports).
TOKEN_MISMATCHES = "token_mismatches"
PREEMPTIONS = "preemptions"
_PEAKS = frozenset(counter.name for counter in ENGINE_COUNTERS if counter.kind == "peak")


@dataclass
class EngineChecks:
    """One (cell, prompt)'s successful warm calls against the engine's own counts."""

    cell_id: str
    prompt_id: str
    calls: int = 0
    # Calls whose engine sent a token count, and those whose count differed from the client's;
    # the first such call's (client chunks, engine completion_tokens).
    token_checked: int = 0
    token_mismatches: int = 0
    mismatch_example: tuple[int, int] | None = None
    # Calls the engine said whether its prefix cache served; those it did; those whose request
    # had asked for no prefix cache and were served from it all the same.
    cache_known: int = 0
    cache_hits: int = 0
    unwanted_cache_hits: int = 0
    # config/metrics.ENGINE_COUNTERS over the calls: counters added up, gauges' peak.
    counters: dict[str, float] = field(default_factory=dict)
    # Speculative decoding by the engine's per-call figures (llama.cpp's timings): tokens the
    # draft proposed and those accepted, over the calls.
    draft_tokens: int = 0
    draft_accepted_tokens: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return (self.cell_id, self.prompt_id)

    @property
    def acceptance(self) -> tuple[float, float] | None:
        """(accepted, proposed) draft tokens: the per-call figures, else the engine's counters."""
        if self.draft_tokens:
            return float(self.draft_accepted_tokens), float(self.draft_tokens)
        proposed = self.counters.get("spec_draft_tokens")
        accepted = self.counters.get("spec_accepted_tokens")
        if proposed and accepted is not None:
            return accepted, proposed
        return None

    @property
    def shown(self) -> bool:
        """Anything to show: a token count checked, the cache known, a counter read."""
        return bool(self.token_checked or self.cache_known or self.counters or self.draft_tokens)


def _ok_warm(record: Mapping[str, Any]) -> bool:
    return (
        record.get("phase") == "warm"
        and record.get("error") is None
        and record.get("finish_reason") != "error"
    )


def engine_checks(
    calls: Iterable[Mapping[str, Any]], unchecked: Iterable[str] = ()
) -> list[EngineChecks]:
    """Per (cell, prompt), in the order first seen, the checks of its successful warm calls;
    the token counts of the `unchecked` cells (token_check: off) are left alone."""
    off = set(unchecked)
    found: dict[tuple[str, str], EngineChecks] = {}
    for call in calls:
        if not _ok_warm(call):
            continue
        key = (str(call.get("cell_id")), str(call.get("prompt_id")))
        checks = found.setdefault(key, EngineChecks(*key))
        checks.calls += 1
        if key[0] not in off:
            _tokens(checks, call)
        hit = call.get("prefix_cache_hit")
        if isinstance(hit, bool):
            checks.cache_known += 1
            checks.cache_hits += hit
            checks.unwanted_cache_hits += hit and call.get("prefix_cache_off") is True
        for name, value in (call.get("engine_counters") or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                earlier = checks.counters.get(name)
                if earlier is None:
                    checks.counters[name] = float(value)
                elif name in _PEAKS:
                    checks.counters[name] = max(earlier, float(value))
                else:
                    checks.counters[name] = earlier + float(value)
        proposed, accepted = call.get("draft_tokens"), call.get("draft_accepted_tokens")
        if isinstance(proposed, int) and isinstance(accepted, int):
            checks.draft_tokens += proposed
            checks.draft_accepted_tokens += accepted
    return list(found.values())


def _tokens(checks: EngineChecks, call: Mapping[str, Any]) -> None:
    mismatch = call.get("token_mismatch")
    if not isinstance(mismatch, bool):
        return
    checks.token_checked += 1
    if mismatch:
        checks.token_mismatches += 1
        if checks.mismatch_example is None:
            checks.mismatch_example = (
                int(call.get("client_chunks") or 0),
                int(call.get("completion_tokens") or 0),
            )


def mismatch_words(checks: EngineChecks) -> str:
    """`2 of 5 warm calls streamed another count of tokens than the engine's usage (12
    streamed, usage 15)`."""
    example = ""
    if checks.mismatch_example is not None:
        streamed, counted = checks.mismatch_example
        example = f" ({streamed} streamed, usage {counted})"
    return (
        f"{checks.token_mismatches} of {checks.token_checked} warm calls streamed another count "
        f"of tokens than the engine's usage{example}"
    )


def check_verdicts(checks: Iterable[EngineChecks], settings: JudgingSettings) -> list[Verdict]:
    """A regression for each (cell, prompt) whose cell asked for it: a token-count mismatch
    where its token_check is `fail`, more preemptions than its thresholds' max_preemptions."""
    from pytest_gpubench.results.gate import Verdict

    verdicts: list[Verdict] = []
    for found in checks:
        cell = settings.cell(found.cell_id)
        if cell is None:
            continue
        where = f"{found.cell_id} {found.prompt_id}"
        if cell.token_check == "fail" and found.token_mismatches:
            verdicts.append(
                Verdict(
                    cell_id=found.cell_id,
                    prompt_id=found.prompt_id,
                    metric=TOKEN_MISMATCHES,
                    baseline=None,
                    current=float(found.token_mismatches),
                    change_ratio=None,
                    p_value=None,
                    verdict="regression",
                    message=f"{where}: {mismatch_words(found)} (token_check: fail)",
                )
            )
        if cell.token_check == "fail" and found.calls and not found.token_checked:
            verdicts.append(
                _unmeasured(
                    found, TOKEN_MISMATCHES,
                    f"{where}: no warm call's token count could be checked (the engine sent no "
                    "usage, or every call was a tool call): token_check: fail is not met",
                )
            )  # fmt: skip
        limit = cell.thresholds.max_preemptions
        preempted = found.counters.get("preemptions")
        if limit is not None and preempted is None and found.calls:
            verdicts.append(
                _unmeasured(
                    found, PREEMPTIONS,
                    f"{where}: the engine's preemptions were not read (its /metrics has no "
                    f"preemption counter, or none was read): max_preemptions: {limit} is not met",
                )
            )  # fmt: skip
        if limit is not None and preempted is not None and preempted > limit:
            verdicts.append(
                Verdict(
                    cell_id=found.cell_id,
                    prompt_id=found.prompt_id,
                    metric=PREEMPTIONS,
                    baseline=None,
                    current=preempted,
                    change_ratio=None,
                    p_value=None,
                    verdict="regression",
                    message=(
                        f"{where}: the engine preempted {preempted:g} requests over the warm "
                        f"calls, over its limit (max_preemptions: {limit})"
                    ),
                )
            )
    return verdicts


def _unmeasured(found: EngineChecks, metric: str, message: str) -> Verdict:
    """A check a cell asked for that nothing measured: `inconclusive`, which holds the run back
    (exit 10): a CI gate never passes a check it did not make."""
    from pytest_gpubench.results.gate import Verdict

    return Verdict(
        cell_id=found.cell_id,
        prompt_id=found.prompt_id,
        metric=metric,
        baseline=None,
        current=None,
        change_ratio=None,
        p_value=None,
        verdict="inconclusive",
        message=message,
    )
