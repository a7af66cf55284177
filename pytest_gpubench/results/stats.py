"""Statistics: per (cell, prompt) summaries of a ledger's call records, vectorized with pandas."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pytest_gpubench.config.metrics import MEASURES, PERCENTILE_NAMES, PERCENTILES, sampled

# The warm measures summarized per (cell, prompt), each to the call record field it is read from
# (config/metrics.py declares them). The decode rate is the record's `tokens_per_sec` (and
# `tpot_ms` its inverse) only in records that carry `coalesced`: older ledgers computed both
# another way, and are left out of them.
WARM_METRICS: dict[str, str] = {measure.name: measure.field for measure in MEASURES}
REASONING_METRICS = tuple(measure.name for measure in MEASURES if measure.reasoning)
DECODE_METRICS = tuple(measure.name for measure in MEASURES if measure.decode)
# Fields read from each call record; everything else (inter-chunk gaps, engine timings) is left
# out of the frame so that a million records stay cheap.
_TEXT_FIELDS = ("cell_id", "prompt_id", "prompt_sha256", "phase", "cold_kind", "kind")
# The raw values kept per (cell, prompt): what the gate tests significance and attribution on.
SAMPLE_FIELDS = sampled()


class WarmSamples(Mapping[str, tuple[float, ...]]):
    """Raw values of the successful warm calls, in ledger order, per measure that keeps them
    (config/metrics.py): what the gate tests on. Every such measure is there, () where the run
    had none. The engine's own figures (engine_*) sit beside the client's, so that a change can
    be attributed to the engine or to what lies between it and the client."""

    __slots__ = ("_values",)

    def __init__(self, **values: Sequence[float]) -> None:
        unknown = sorted(set(values) - set(SAMPLE_FIELDS))
        if unknown:
            raise TypeError(f"no samples are kept of {', '.join(unknown)}")
        self._values = {name: tuple(values.get(name, ())) for name in SAMPLE_FIELDS}

    def __getitem__(self, name: str) -> tuple[float, ...]:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __repr__(self) -> str:
        kept = ", ".join(f"{name}={values!r}" for name, values in self._values.items() if values)
        return f"WarmSamples({kept})"


# A measure's warm percentiles, p50 to p99 (None where the run had no value).
Figures = Mapping[str, float | None]
_NO_FIGURES: Figures = dict.fromkeys(PERCENTILE_NAMES)


@dataclass(frozen=True)
class PromptSummary:
    """The numbers of one (cell, prompt): its first cold call and its warm distribution, as a
    mapping of each measure of config/metrics.py to its percentiles (`figure(measure, "p90")`);
    `warm_coalesced` counts the successful warm calls whose content came in one read."""

    cell_id: str
    prompt_id: str
    prompt_sha256: str | None = None
    n_cold: int = 0
    n_cold_ok: int = 0
    cold_kind: str | None = None
    cold_first_delta_ms: float | None = None
    cold_total_duration_ms: float | None = None
    n_warm: int = 0
    n_warm_ok: int = 0
    # Each measure's percentiles; a reasoning measure's are None unless the engine reasoned on
    # this (cell, prompt): no empty figures for other models.
    warm: Mapping[str, Figures] = field(default_factory=dict)
    warm_coalesced: int = 0
    samples: WarmSamples = field(default_factory=WarmSamples)
    # The prompt's request kind (config/prompts.py); a chat call's record carries none.
    kind: str = "chat"

    def __post_init__(self) -> None:
        # Every measure's four percentiles, None where not measured: summaries of the same
        # figures are equal however they were made (a run, a baseline file, a test).
        unknown = sorted(set(self.warm) - set(WARM_METRICS))
        if unknown:
            raise TypeError(f"no such measure: {', '.join(unknown)} (config/metrics.py)")
        figures = {
            name: {p: self.warm.get(name, _NO_FIGURES).get(p) for p in PERCENTILE_NAMES}
            for name in WARM_METRICS
        }
        object.__setattr__(self, "warm", figures)

    def __hash__(self) -> int:
        return hash((self.cell_id, self.prompt_id, self.n_warm, self.n_warm_ok, self.samples))

    @property
    def key(self) -> tuple[str, str]:
        return (self.cell_id, self.prompt_id)

    def validity_rate(self, measure: str) -> float | None:
        """The share of the successful warm calls whose answer was valid (a validity measure of
        config/metrics.VALIDITY, its 1s and 0s); None where none was checked."""
        values = self.samples[measure]
        return sum(values) / len(values) if values else None

    @property
    def warm_success_rate(self) -> float | None:
        """Successful warm calls over all warm calls; None when no warm call ran."""
        return self.n_warm_ok / self.n_warm if self.n_warm else None

    def figure(self, measure: str, percentile: str = "p50") -> float | None:
        """figure("decode_tokens_per_sec", "p90"): a warm percentile (None: not measured)."""
        return self.warm.get(measure, _NO_FIGURES).get(percentile)


def field_number(value: Any) -> float | None:
    """A record's or a file's field as a float, else None: not a number (text, a list, a bool),
    or an integer past a float's range (a hand-edited file's: float() raised OverflowError).
    NaN and infinities come back as they are; the reader decides what it accepts."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def is_success(record: Mapping[str, Any]) -> bool:
    """A call failed when it carries an error (its finish_reason is then "error")."""
    return record.get("error") is None and record.get("finish_reason") != "error"


def call_frame(records: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per call record, with only the columns the summaries need and an `ok` flag."""
    calls = [record for record in records if record.get("type") == "call"]
    # One pass per field is faster than building a tuple per record (and tolerates older ledgers
    # that lack a field).
    frame = pd.DataFrame(
        {field: text_column([record.get(field) for record in calls]) for field in _TEXT_FIELDS}
    )
    frame["run_idx"] = _floats([record.get("run_idx") for record in calls])
    for metric, source in WARM_METRICS.items():
        frame[metric] = _floats([record.get(source) for record in calls])
    current_definition = np.array(["coalesced" in record for record in calls], dtype=bool)
    for metric in DECODE_METRICS:
        frame.loc[~current_definition, metric] = np.nan
    frame["coalesced"] = np.array([record.get("coalesced") is True for record in calls], dtype=bool)
    # is_success, inlined: a function call per record costs a third of a second per million.
    frame["ok"] = np.array(
        [
            record.get("error") is None and record.get("finish_reason") != "error"
            for record in calls
        ],
        dtype=bool,
    )
    return frame


def _objects(values: list[Any]) -> np.ndarray[Any, np.dtype[np.object_]]:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def text_column(values: Sequence[Any]) -> np.ndarray[Any, np.dtype[np.object_]]:
    """A text field's values as an object array that pandas can group: a list or mapping where
    text belongs (an edited or damaged ledger) becomes its text, not a TypeError in a report."""
    array = np.empty(len(values), dtype=object)
    array[:] = values
    try:
        pd.factorize(array)
    except TypeError:
        array[:] = [value if isinstance(value, Hashable) else str(value) for value in values]
    return array


def _floats(values: list[Any]) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Numbers as float64 with NaN for None; anything unparsable also becomes NaN."""
    try:
        return np.array(values, dtype="float64")
    except (TypeError, ValueError, OverflowError):
        plain = [_in_float_range(value) for value in values]
        coerced = pd.to_numeric(pd.Series(_objects(plain)), errors="coerce")
        return coerced.to_numpy(dtype="float64", na_value=np.nan)


def _in_float_range(value: Any) -> Any:
    """An integer past a float's range (10**400 in a damaged ledger) as no value: converting it
    raised OverflowError in every report of the ledger."""
    if isinstance(value, int):
        try:
            float(value)
        except OverflowError:
            return None
    return value


def summarize(records: Iterable[Mapping[str, Any]]) -> list[PromptSummary]:
    """Per (cell, prompt) summaries of the call records, sorted by cell id then prompt id."""
    return summarize_frame(call_frame(records))


def summarize_frame(frame: pd.DataFrame, *, with_samples: bool = True) -> list[PromptSummary]:
    """Summaries of a call_frame; every groupby runs on one integer code per (cell, prompt).
    Without samples (a report that draws no distribution) a million calls cost a second less."""
    # A load case's calls are summarised per load point (load/summary.py), not here.
    frame, keys = _with_group_codes(frame[frame["phase"] != "load"])
    # A frame cached before a metric existed (the control call) lacks its column: all unknown.
    missing = {metric: np.nan for metric in WARM_METRICS if metric not in frame.columns}
    if missing:
        frame = frame.assign(**missing)
    if frame.empty:
        return []
    frame = _reasoning_only(frame)
    warm = frame[frame["phase"] == "warm"]
    warm_ok = warm[warm["ok"]]
    cold = frame[frame["phase"] == "cold"]
    shas = _first_text(frame, "prompt_sha256")
    kinds = _first_text(frame, "kind") if "kind" in frame.columns else {}
    cold_counts = _counts(cold)
    first_cold = _first_cold(cold)
    warm_counts = _counts(warm)
    percentiles = _percentiles(warm_ok, list(WARM_METRICS))
    coalesced = warm_ok.groupby("group", sort=False)["coalesced"].sum()
    samples = _samples(warm_ok) if with_samples else {}
    return [
        _summary(
            keys[group],
            sha=shas.get(group),
            cold_counts=cold_counts.get(group, (0, 0)),
            first_cold=first_cold.get(group),
            warm_counts=warm_counts.get(group, (0, 0)),
            warm={
                metric: values.get(group, _NO_PERCENTILES) for metric, values in percentiles.items()
            },
            coalesced=int(coalesced.get(group, 0)),
            samples=samples.get(group, WarmSamples()),
            kind=kinds.get(group) or "chat",
        )
        for group in sorted(range(len(keys)), key=keys.__getitem__)
    ]


def _reasoning_only(frame: pd.DataFrame) -> pd.DataFrame:
    """The reasoning figures kept only for the (cell, prompt)s where a successful warm call
    reasoned: elsewhere the first answer is the first token, and a reasoning count of 0 or none
    says nothing, so a model that does not reason shows no reasoning columns at all."""
    reasoned = (frame["phase"] == "warm") & frame["ok"] & (frame["reasoning_tokens"] > 0)
    others = ~frame["group"].isin(frame.loc[reasoned, "group"].unique())
    if not others.any():
        return frame
    frame = frame.copy()
    frame.loc[others, list(REASONING_METRICS)] = np.nan
    return frame


def _with_group_codes(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """Adds `group`, a dense code per (cell_id, prompt_id); rows missing either are dropped."""
    cell_codes, cells = pd.factorize(frame["cell_id"].to_numpy(dtype=object))
    prompt_codes, prompts = pd.factorize(frame["prompt_id"].to_numpy(dtype=object))
    combined = cell_codes.astype("int64") * max(len(prompts), 1) + prompt_codes
    valid = (cell_codes >= 0) & (prompt_codes >= 0)
    codes, uniques = pd.factorize(combined[valid])
    keys = [
        (str(cells[code // max(len(prompts), 1)]), str(prompts[code % max(len(prompts), 1)]))
        for code in uniques.tolist()
    ]
    kept = frame[valid].assign(group=codes)
    return kept, keys


_NO_PERCENTILES: tuple[float | None, ...] = (None,) * len(PERCENTILES)


def _summary(
    key: tuple[str, str],
    *,
    sha: str | None,
    cold_counts: tuple[int, int],
    first_cold: tuple[str | None, float | None, float | None] | None,
    warm_counts: tuple[int, int],
    warm: Mapping[str, tuple[float | None, ...]],
    coalesced: int,
    samples: WarmSamples,
    kind: str = "chat",
) -> PromptSummary:
    cold_kind, cold_ttft, cold_total = first_cold or (None, None, None)
    figures: dict[str, Figures] = {
        metric: {name: value for name, value in zip(PERCENTILE_NAMES, values, strict=True)}
        for metric, values in warm.items()
    }
    return PromptSummary(
        cell_id=key[0],
        prompt_id=key[1],
        prompt_sha256=sha,
        n_cold=cold_counts[0],
        n_cold_ok=cold_counts[1],
        cold_kind=cold_kind,
        cold_first_delta_ms=cold_ttft,
        cold_total_duration_ms=cold_total,
        n_warm=warm_counts[0],
        n_warm_ok=warm_counts[1],
        warm=figures,
        warm_coalesced=coalesced,
        samples=samples,
        kind=kind,
    )


def frame_number(value: Any) -> float | None:
    """A frame's value as a float (a summary's, a check's), or None for a missing or NaN one."""
    if value is None:
        return None
    number = float(value)
    return None if math.isnan(number) else number


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _counts(frame: pd.DataFrame) -> dict[int, tuple[int, int]]:
    """(calls, successful calls) per group."""
    grouped = frame.groupby("group", sort=False)["ok"].agg(["size", "sum"])
    return {
        int(group): (int(size), int(ok))
        for group, size, ok in zip(grouped.index, grouped["size"], grouped["sum"], strict=True)
    }


def _first_text(frame: pd.DataFrame, field: str) -> dict[int, str | None]:
    present = frame[frame[field].notna()].drop_duplicates(subset="group", keep="first")
    return {
        int(group): _text(value)
        for group, value in zip(present["group"], present[field], strict=True)
    }


def _first_cold(cold: pd.DataFrame) -> dict[int, tuple[str | None, float | None, float | None]]:
    """The first successful cold call per group: lowest run index, then ledger order."""
    ok = cold[cold["ok"]].sort_values("run_idx", kind="stable", na_position="last")
    first = ok.drop_duplicates(subset="group", keep="first")
    return {
        int(group): (_text(kind), frame_number(ttft), frame_number(total))
        for group, kind, ttft, total in zip(
            first["group"],
            first["cold_kind"],
            first["first_delta_ms"],
            first["total_duration_ms"],
            strict=True,
        )
    }


def _percentiles(
    frame: pd.DataFrame, fields: list[str]
) -> dict[str, dict[int, tuple[float | None, ...]]]:
    """p50/p90/p95/p99 per field and group with linear interpolation (numpy's default), in one
    groupby for every field; NaN values are left out (a group with none has no entry)."""
    if frame.empty:
        return {field: {} for field in fields}
    table = frame.groupby("group", sort=False)[fields].quantile(np.array(PERCENTILES))
    groups = table.index.get_level_values(0).to_numpy()[:: len(PERCENTILES)]
    result: dict[str, dict[int, tuple[float | None, ...]]] = {}
    for name in fields:
        values = table[name].to_numpy(dtype="float64").reshape(-1, len(PERCENTILES))
        result[name] = {
            int(group): tuple(frame_number(value) for value in row)
            for group, row in zip(groups.tolist(), values, strict=True)
            if not np.isnan(row).all()
        }
    return result


def _samples(frame: pd.DataFrame) -> dict[int, WarmSamples]:
    """The raw values per group, split once after a stable sort by group (ledger order kept)."""
    if frame.empty:
        return {}
    groups = frame["group"].to_numpy()
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    boundaries = np.flatnonzero(sorted_groups[1:] != sorted_groups[:-1]) + 1
    starts = np.concatenate(([0], boundaries))
    split = {
        field: np.split(frame[field].to_numpy(dtype="float64")[order], boundaries)
        for field in SAMPLE_FIELDS
    }
    return {
        int(sorted_groups[start]): WarmSamples(
            **{field: _finite(split[field][index]) for field in SAMPLE_FIELDS}
        )
        for index, start in enumerate(starts.tolist())
    }


def _finite(values: np.ndarray[Any, np.dtype[np.float64]]) -> tuple[float, ...]:
    return tuple(values[~np.isnan(values)].tolist())


def summaries_by_key(
    summaries: Iterable[PromptSummary],
) -> dict[tuple[str, str], PromptSummary]:
    return {summary.key: summary for summary in summaries}
