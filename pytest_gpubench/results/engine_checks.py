"""The warm calls checked against the engine's own word (issue 35), per (cell, prompt): the
client's count of streamed tokens against the engine's usage, the prompts its prefix cache
served (and whether the request had asked for none), its counters over the calls (preemptions,
queued requests, KV-cache usage, speculative decoding), and the verdicts a cell asks of them:
`token_check: fail` and `thresholds: {max_preemptions: N}`. Pure: records in, summaries and
verdicts out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from pytest_gpubench.config.engine_series import COUNTER_LIMITS, ENGINE_COUNTERS
from pytest_gpubench.results.decision import Decision
from pytest_gpubench.results.steadiness import PRESSURE_LIMIT
from pytest_gpubench.results.verdict import Verdict, from_decision

if TYPE_CHECKING:
    from pytest_gpubench.config.cell import Thresholds

# The verdicts' metric names (the end record, JUnit, exports).
TOKEN_MISMATCHES = "token_mismatches"
_PEAKS = frozenset(counter.name for counter in ENGINE_COUNTERS if counter.kind == "peak")
# How busy an engine kept the CPUs it may use (engine_cpus_filled) for its wait to be partly its
# own threads'. Measured with the real llama-server on 2 CPUs (benchmarks_dev/engine_own_threads.py
# and sessions of its launches): two threads pinned to one CPU 0.98-1.00, waiting 0.80-0.83 ms
# per ms on a quiet machine; two threads on both CPUs 0.84-0.90; one thread unpinned 0.49; one
# thread pinned, with something else taking part of its CPU, 0.56 (waiting 0.90).
FILLED = 0.9


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
    # config/engine_series.ENGINE_COUNTERS over the calls: counters added up, gauges' peak.
    counters: dict[str, float] = field(default_factory=dict)
    # Speculative decoding by the engine's per-call figures (llama.cpp's timings): tokens the
    # draft proposed and those accepted, over the calls.
    draft_tokens: int = 0
    draft_accepted_tokens: int = 0
    # A local engine's p50 over the calls of its wait for a CPU per ms it ran, and of how busy
    # it kept the CPUs it may use (1.0: every one, all the call long); None where not read.
    engine_wait: float | None = None
    cpus_filled: float | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.cell_id, self.prompt_id)

    @property
    def acceptance(self) -> tuple[float, float] | None:
        """(accepted, proposed) draft tokens: the per-call figures, else the engine's counters."""
        if self.draft_tokens:
            return float(self.draft_accepted_tokens), float(self.draft_tokens)
        found = draft_counts(self.counters)
        return (found[0], found[1]) if found is not None else None

    @property
    def own_threads(self) -> bool:
        """The engine waited for a CPU past the busy limit while it kept every CPU it may use
        busy: its compute threads outnumber its CPUs and wait for each other, which the gate
        cannot tell from a busy machine (docs/gate-noise.md, "The engine's own waiting")."""
        return (
            self.engine_wait is not None
            and self.cpus_filled is not None
            and self.engine_wait > PRESSURE_LIMIT
            and self.cpus_filled >= FILLED
        )

    @property
    def shown(self) -> bool:
        """Anything to show: a token count checked, the cache known, a counter read."""
        return bool(self.token_checked or self.cache_known or self.counters or self.draft_tokens)


def draft_counts(counters: Mapping[str, float]) -> tuple[float, float, float | None] | None:
    """(accepted, proposed, drafts) of speculative decoding by the engine's own counters
    (config/engine_series.ENGINE_COUNTERS' spec_*: vLLM's or llama.cpp's), over warm calls or a load
    point; None where the draft proposed nothing. `drafts` (the draft steps) may be unknown."""
    proposed = counters.get("spec_draft_tokens")
    accepted = counters.get("spec_accepted_tokens")
    if not proposed or accepted is None:
        return None
    return accepted, proposed, counters.get("spec_drafts")


# The call record's fields the checks read, as columns of numbers (a boolean as 1/0, NaN where
# absent): reports/frame.py reads them from a ledger, check_frame from records; each of the
# call's engine_counters is a column of its own (COUNTER_COLUMNS).
CHECK_FIELDS = (
    "token_mismatch",
    "prefix_cache_hit",
    "prefix_cache_off",
    "draft_tokens",
    "draft_accepted_tokens",
    "client_chunks",
    "completion_tokens",
    "engine_wait_per_cpu",
    "engine_cpus_filled",
)
COUNTER_PREFIX = "engine_counters."
COUNTER_COLUMNS = tuple(COUNTER_PREFIX + counter.name for counter in ENGINE_COUNTERS)


def _number(value: Any) -> float:
    """A field as its column holds it: a number or a boolean (1/0), else NaN (an integer too
    large for a float, too: an edited ledger's)."""
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:
            pass
    return float("nan")


def check_frame(calls: Iterable[Mapping[str, Any]]) -> Any:
    """The columns engine_checks_frame reads (cell_id, prompt_id, phase, ok, CHECK_FIELDS,
    COUNTER_COLUMNS), from call records: what reports/frame.py reads from a ledger."""
    import pandas as pd

    rows = []
    for call in calls:
        counters = call.get("engine_counters")
        counters = counters if isinstance(counters, Mapping) else {}
        rows.append(
            (
                str(call.get("cell_id")),
                str(call.get("prompt_id")),
                call.get("phase"),
                call.get("error") is None and call.get("finish_reason") != "error",
                *(_number(call.get(name)) for name in CHECK_FIELDS),
                *(
                    _number(value) if not isinstance(value := counters.get(name), bool) else NAN
                    for name in _COUNTER_NAMES
                ),
            )
        )
    names = ["cell_id", "prompt_id", "phase", "ok", *CHECK_FIELDS, *COUNTER_COLUMNS]
    return pd.DataFrame.from_records(rows, columns=names)


NAN = float("nan")
_COUNTER_NAMES = tuple(counter.name for counter in ENGINE_COUNTERS)


def engine_checks(
    calls: Iterable[Mapping[str, Any]], unchecked: Iterable[str] = ()
) -> list[EngineChecks]:
    """Per (cell, prompt), in the order first seen, the checks of its successful warm calls;
    the token counts of the `unchecked` cells (token_check: off) are left alone."""
    return engine_checks_frame(check_frame(calls), unchecked)


def engine_checks_frame(frame: Any, unchecked: Iterable[str] = ()) -> list[EngineChecks]:
    """engine_checks on the calls as columns (check_frame's, or a ledger's read by
    reports/frame.py): one pass of vectorised sums per (cell, prompt), no object per call."""
    import numpy as np
    import pandas as pd

    from pytest_gpubench.results.stats import frame_number

    keep = (frame["phase"] == "warm").to_numpy(dtype=bool) & frame["ok"].to_numpy(dtype=bool)
    warm = frame.loc[keep]
    if warm.empty:
        return []
    cells = warm["cell_id"].astype(str).to_numpy(dtype=object)
    prompts = warm["prompt_id"].astype(str).to_numpy(dtype=object)

    def column(name: str) -> Any:
        return warm[name].to_numpy(dtype="float64")

    mismatch = column("token_mismatch")
    checked = ~np.isnan(mismatch) & ~np.isin(cells, list(set(unchecked)))
    differs = checked & (mismatch != 0)
    hit = column("prefix_cache_hit")
    known = ~np.isnan(hit)
    hits = known & (hit != 0)
    proposed, accepted = column("draft_tokens"), column("draft_accepted_tokens")
    drafted = ~np.isnan(proposed) & ~np.isnan(accepted)
    counts = pd.DataFrame(
        {
            "calls": np.ones(len(warm), dtype="int64"),
            "token_checked": checked,
            "token_mismatches": differs,
            "cache_known": known,
            "cache_hits": hits,
            "unwanted_cache_hits": hits & (column("prefix_cache_off") == 1),
            "draft_tokens": np.where(drafted, proposed, 0.0),
            "draft_accepted_tokens": np.where(drafted, accepted, 0.0),
        }
    )
    keys = [cells, prompts]
    sums = counts.groupby(keys, sort=False).sum()
    present = [name for name in COUNTER_COLUMNS if name in warm.columns]
    counters = pd.DataFrame({name: column(name) for name in present})
    grouped = counters.groupby(keys, sort=False)
    peaks = [name for name in present if name.removeprefix(COUNTER_PREFIX) in _PEAKS]
    added = [name for name in present if name not in peaks]
    totals = pd.concat([grouped[added].sum(min_count=1), grouped[peaks].max()], axis=1)
    waiting = (
        pd.DataFrame(
            {"wait": column("engine_wait_per_cpu"), "filled": column("engine_cpus_filled")}
        )
        .groupby(keys, sort=False)
        .median()
    )
    # The first differing call's (client chunks, engine count), per (cell, prompt).
    examples = (
        pd.DataFrame(
            {
                "streamed": np.nan_to_num(column("client_chunks")[differs]),
                "counted": np.nan_to_num(column("completion_tokens")[differs]),
            }
        )
        .groupby([cells[differs], prompts[differs]], sort=False)
        .first()
    )
    found = []
    for key, row in sums.iterrows():
        cell_id, prompt_id = cast("tuple[str, str]", key)
        example = (
            (
                round(cast("float", examples.at[key, "streamed"])),
                round(cast("float", examples.at[key, "counted"])),
            )
            if key in examples.index
            else None
        )
        found.append(
            EngineChecks(
                cell_id,
                prompt_id,
                calls=int(row["calls"]),
                token_checked=int(row["token_checked"]),
                token_mismatches=int(row["token_mismatches"]),
                mismatch_example=example,
                cache_known=int(row["cache_known"]),
                cache_hits=int(row["cache_hits"]),
                unwanted_cache_hits=int(row["unwanted_cache_hits"]),
                counters={
                    name.removeprefix(COUNTER_PREFIX): value
                    for name in present
                    if (value := frame_number(totals.at[key, name])) is not None
                },
                draft_tokens=int(row["draft_tokens"]),
                draft_accepted_tokens=int(row["draft_accepted_tokens"]),
                engine_wait=frame_number(waiting.at[key, "wait"]),
                cpus_filled=frame_number(waiting.at[key, "filled"]),
            )
        )
    return found


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


class CheckedCell(Protocol):
    """What the verdicts ask of a cell's judging settings (results/judging_settings.CellJudging)."""

    @property
    def token_check(self) -> str: ...

    @property
    def thresholds(self) -> Thresholds: ...


class CheckedCells(Protocol):
    """The run's judging settings, as the verdicts read them
    (results/judging_settings.JudgingSettings: named by its shape, for judging.py imports this
    module)."""

    def cell(self, cell_id: str) -> CheckedCell | None: ...


def check_verdicts(checks: Iterable[EngineChecks], settings: CheckedCells) -> list[Verdict]:
    """A regression for each (cell, prompt) whose cell asked for it: a token-count mismatch
    where its token_check is `fail`, more preemptions than its thresholds' max_preemptions; and
    `inconclusive` (exit 10) where such a check could not be made: a CI gate never passes a
    check it did not make."""
    verdicts: list[Verdict] = []
    for found in checks:
        cell = settings.cell(found.cell_id)
        if cell is None:
            continue
        if cell.token_check == "fail" and found.token_mismatches:
            text = f"{mismatch_words(found)} (token_check: fail)"
            verdicts.append(
                from_decision(
                    *found.key, TOKEN_MISMATCHES, Decision("regression", text),
                    current=float(found.token_mismatches),
                )
            )  # fmt: skip
        if cell.token_check == "fail" and found.calls and not found.token_checked:
            text = (
                "no warm call's token count could be checked (the engine sent no usage, or every "
                "call was a tool call): token_check: fail is not met"
            )
            verdicts.append(
                from_decision(*found.key, TOKEN_MISMATCHES, Decision("inconclusive", text))
            )
        verdicts.extend(_counter_verdicts(found, cell.thresholds))
    return verdicts


def _counter_verdicts(found: EngineChecks, thresholds: Thresholds) -> list[Verdict]:
    """Each engine counter the cell limits (config/engine_series.COUNTER_LIMITS): over its limit a
    regression, not read `inconclusive`; named by the counter."""
    verdicts = []
    for key, counter in COUNTER_LIMITS.items():
        limit = getattr(thresholds, key)
        value = found.counters.get(counter.name)
        where = f"{key}: {limit}"
        if limit is not None and value is None and found.calls:
            text = (
                f"the engine's {counter.label} were not read (its /metrics has no such counter, "
                f"or none was read): {where} is not met"
            )
            verdicts.append(from_decision(*found.key, counter.name, Decision("inconclusive", text)))
        if limit is not None and value is not None and value > limit:
            text = (
                f"the engine's {counter.label} over the warm calls: {value:g}, over its limit "
                f"({where})"
            )
            verdicts.append(
                from_decision(*found.key, counter.name, Decision("regression", text), current=value)
            )
    return verdicts
