"""Every figure the plugin measures and judges, declared once: what a call record's field is
summarized as (its unit, which way is better, whether its raw values are kept), and which of
those figures the gate judges (the percentile, the threshold key of cells.yaml, the verdict's
name and label, the engine's own counterpart, whether an A/B pair judges it too). Statistics,
the gate, the baseline file, the thresholds of cells.yaml, the judging settings and the reports
read these tables; a new figure is a new entry here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Percentile = Literal["p50", "p90", "p95", "p99"]
# The defaults in force (docs/gate.md), written into each run's judging settings: a gated figure's
# relative threshold, and the absolute floor of the warm success rate. 20 %, not the 30 % of
# earlier versions: a gate at 30 % catches a +30 % regression in half the runs (the measured
# change falls either side of it); at 20 % it is caught with room on a quiet machine, whose
# between-run spread is a few per cent, and where a machine's spread is wider the gate says it
# cannot tell rather than guessing.
DEFAULT_RATIO_THRESHOLD = 0.20
DEFAULT_SUCCESS_RATE = 0.95
PERCENTILES: tuple[float, ...] = (0.50, 0.90, 0.95, 0.99)
PERCENTILE_NAMES: tuple[str, ...] = ("p50", "p90", "p95", "p99")
# What a prompt asks of the engine (config/prompts.py `kind:`, docs/request-kinds.md): every kind
# but embedding and rerank generates tokens, so has a TTFT and a decode rate; those two have
# neither, and their inputs per second instead.
REQUEST_KINDS: tuple[str, ...] = (
    "chat", "completion", "embedding", "rerank", "tools", "json_schema", "image",
)  # fmt: skip
GENERATING: frozenset[str] = frozenset(REQUEST_KINDS) - {"embedding", "rerank"}


@dataclass(frozen=True)
class Measure:
    """A figure of each warm call, summarized per (cell, prompt) as its percentiles."""

    # Its name in the summaries and the baseline file, and the call record field it is read from.
    name: str
    field: str
    unit: str
    label: str
    higher_is_better: bool = False
    # Its raw values are kept per (cell, prompt): the gate tests significance on them.
    samples: bool = False
    # Only in records that carry `coalesced`: older ledgers computed the decode rate otherwise.
    decode: bool = False
    # Only where the engine reasoned on the (cell, prompt) (a reasoning model's).
    reasoning: bool = False
    # A baseline file must hold it (a measure added later is read as unknown where it is absent).
    in_every_baseline: bool = True
    # Digits after the point in the reports' tables.
    decimals: int = 2
    # The request kinds it means something for (a call of another kind has none: absent, not 0).
    kinds: frozenset[str] = GENERATING

    @property
    def whole(self) -> bool:
        """Each call's value is a count (a CSV export writes it as an integer)."""
        return self.unit in ("tokens", "processes", "bits")

    @property
    def always_in_baseline(self) -> bool:
        """Every baseline file holds it; a reasoning model's, or one only some runs measure, is
        written only where the run measured it."""
        return self.in_every_baseline and not self.reasoning


MEASURES: tuple[Measure, ...] = (
    Measure("first_delta_ms", "first_delta_ms", "ms", "TTFT", samples=True),
    Measure(
        "total_duration_ms",
        "total_duration_ms",
        "ms",
        "total",
        samples=True,
        kinds=frozenset(REQUEST_KINDS),
    ),
    Measure(
        "decode_tokens_per_sec",
        "tokens_per_sec",
        "tokens/s",
        "decode tokens/s",
        higher_is_better=True,
        samples=True,
        decode=True,
        decimals=1,
    ),
    Measure("tpot_ms", "tpot_ms", "ms", "TPOT", decode=True),
    Measure("e2e_tokens_per_sec", "e2e_tokens_per_sec", "tokens/s", "end-to-end tokens/s", True),
    Measure(
        "engine_tokens_per_sec",
        "engine_tokens_per_sec",
        "tokens/s",
        "engine's decode rate",
        higher_is_better=True,
        samples=True,
    ),
    Measure("engine_prompt_ms", "engine_prompt_ms", "ms", "engine's prompt time", samples=True),
    Measure("engine_total_ms", "engine_total_ms", "ms", "engine's total time", samples=True),
    # The control call measured before each call (measure/control.py): the machine's speed then.
    Measure("control_ms", "control_ms", "ms", "control call", samples=True),
    # A reasoning model's (issue 23): its first answer token, and the tokens it reasoned with.
    Measure(
        "first_answer_ms",
        "first_answer_ms",
        "ms",
        "time to first answer",
        samples=True,
        reasoning=True,
        in_every_baseline=False,
    ),
    Measure(
        "reasoning_tokens",
        "reasoning_tokens",
        "tokens",
        "reasoning tokens",
        reasoning=True,
        in_every_baseline=False,
    ),
    # The share of each call's wall time in which some task waited for a CPU (measure/control.py).
    Measure("cpu_pressure", "cpu_pressure", "share", "CPU pressure", samples=True),
    # A local managed engine's own threads over each call: how long they waited on a run queue
    # for a CPU, and ran (measure/engine_wait.py). Recorded beside the machine's pressure.
    Measure(
        "engine_wait_ms",
        "engine_wait_ms",
        "ms",
        "engine's CPU wait",
        samples=True,
        in_every_baseline=False,
    ),
    Measure("engine_cpu_ms", "engine_cpu_ms", "ms", "engine's CPU time", in_every_baseline=False),
    # Their ratio: how long the engine's threads waited for a CPU per ms they ran (0.25: its CPU
    # work took a quarter longer than on a free CPU). The steadiness of a local engine: a slower
    # engine runs longer and waits in proportion, a slower path around it changes neither.
    Measure(
        "engine_wait_per_cpu",
        "engine_wait_per_cpu",
        "ms/ms",
        "engine's CPU wait per CPU ms",
        samples=True,
        in_every_baseline=False,
        decimals=3,
    ),
    # The harness's own threads over each call (the client's), likewise: a client that waited
    # for a CPU read the engine's bytes late (measure/engine_wait.client_wait).
    Measure(
        "client_wait_per_cpu",
        "client_wait_per_cpu",
        "ms/ms",
        "client's CPU wait per CPU ms",
        samples=True,
        in_every_baseline=False,
        decimals=3,
    ),
    # The machine's CPU time over each call with the benchmark's own (the engine's where read,
    # this process's) taken out: the neighbours' share; and the share a hypervisor stole
    # (measure/control.MachineCpu). The steadiness where the engine's own wait is not read.
    Measure(
        "neighbour_cpu_share",
        "neighbour_cpu_share",
        "share",
        "neighbours' CPU share",
        samples=True,
        in_every_baseline=False,
        decimals=3,
    ),
    Measure(
        "steal_share",
        "steal_share",
        "share",
        "CPU time stolen",
        samples=True,
        in_every_baseline=False,
        decimals=3,
    ),
    # A GPU's neighbours over each call (telemetry/aggregate.py, through NVML): how many compute
    # processes that are not the engine's ran on it, and the clock events that held it down
    # (CLOCK_EVENTS' bits). The gate's steadiness names them
    # (results/machine_steadiness.gpu_signals).
    Measure(
        "gpu_other_processes",
        "gpu_other_process_count",
        "processes",
        "other GPU processes",
        samples=True,
        in_every_baseline=False,
        decimals=0,
    ),
    Measure(
        "gpu_clock_events",
        "gpu_clock_event_bits",
        "bits",
        "GPU clock events",
        samples=True,
        in_every_baseline=False,
        decimals=0,
    ),
    # An embedding request's inputs (a rerank request's documents) over its end-to-end time.
    Measure(
        "inputs_per_sec",
        "inputs_per_sec",
        "inputs/s",
        "inputs/s",
        higher_is_better=True,
        samples=True,
        in_every_baseline=False,
        decimals=1,
        kinds=frozenset({"embedding", "rerank"}),
    ),
    # Whether a call's answer was valid for its kind, 1 or 0 (measure/validity.py): its samples
    # give the rate per (cell, prompt) that the gate judges (VALIDITY below).
    Measure(
        "tool_call_valid",
        "tool_call_valid",
        "share",
        "tool call valid",
        higher_is_better=True,
        samples=True,
        in_every_baseline=False,
        kinds=frozenset({"tools"}),
    ),
    Measure(
        "schema_valid",
        "schema_valid",
        "share",
        "schema valid",
        higher_is_better=True,
        samples=True,
        in_every_baseline=False,
        kinds=frozenset({"json_schema"}),
    ),
)


@dataclass(frozen=True)
class GatedFigure:
    """A figure the gate judges on every (cell, prompt) it can: a measure's percentile."""

    # The verdict's metric name (the end record, JUnit, history, exports) and its label in the
    # verdicts' messages.
    name: str
    label: str
    measure: str
    percentile: Percentile
    # Its relative threshold's key under `thresholds:` in cells.yaml.
    threshold_key: str
    # The engine's own counterpart (a change that moved it too is engine-side), and its words.
    engine_measure: str | None
    engine_label: str
    # Its column in the terminal, Markdown and HTML tables ("TTFT p50 ms"), the short word of
    # the change column ("Δ TTFT / total / decode tok/s"), and its distribution chart's title.
    column: str
    short: str
    chart: str
    # Judged with the default threshold unless cells.yaml sets one; an opt-in figure is judged
    # only where its cell (or the settings) gives its threshold.
    opt_in: bool = False
    # An A/B candidate's pairs are judged on it too (results/paired.py), and sequential
    # sampling against a baseline decides on it (results/sequential_runs.py).
    paired: bool = False
    sequential: bool = False


GATED: tuple[GatedFigure, ...] = (
    GatedFigure(
        name="warm_ttft_p50_ms",
        label="warm TTFT p50",
        measure="first_delta_ms",
        percentile="p50",
        threshold_key="ttft_p50",
        engine_measure="engine_prompt_ms",
        engine_label="prompt time",
        column="TTFT p50 ms",
        short="TTFT",
        chart="Warm TTFT",
        paired=True,
        sequential=True,
    ),
    GatedFigure(
        name="warm_total_p50_ms",
        label="warm total p50",
        measure="total_duration_ms",
        percentile="p50",
        threshold_key="total_p50",
        engine_measure="engine_total_ms",
        engine_label="prompt + decode time",
        column="total p50 ms",
        short="total",
        chart="Warm total duration",
        paired=True,
        sequential=True,
    ),
    GatedFigure(
        name="warm_decode_tokens_per_sec_p50",
        label="warm decode tokens/s p50",
        measure="decode_tokens_per_sec",
        percentile="p50",
        threshold_key="tokens_per_sec",
        engine_measure="engine_tokens_per_sec",
        engine_label="decode rate",
        column="decode tok/s p50",
        short="decode tok/s",
        chart="Warm decode rate",
        paired=True,
    ),
    # The tail of end-to-end latency: what the slowest calls of a user's session wait. Opt-in
    # (`thresholds: {total_p99: 0.30}`): with few runs a p99 is near the slowest call.
    GatedFigure(
        name="warm_total_p99_ms",
        label="warm total p99",
        measure="total_duration_ms",
        percentile="p99",
        threshold_key="total_p99",
        engine_measure="engine_total_ms",
        engine_label="prompt + decode time",
        column="total p99 ms",
        short="total p99",
        chart="",
        opt_in=True,
    ),
    # A reasoning model's time to its first answer token (issue 23): what its user waits for,
    # which TTFT (the first reasoning token) does not show. Judged only where the engine reasoned;
    # no engine reports a time of its own for it (a change is set beside the reasoning tokens).
    GatedFigure(
        name="warm_first_answer_p50_ms",
        label="warm time to first answer p50",
        measure="first_answer_ms",
        percentile="p50",
        threshold_key="first_answer_p50",
        engine_measure=None,
        engine_label="reasoning tokens",
        column="first answer p50 ms",
        short="first answer",
        chart="Warm time to first answer",
    ),
)


@dataclass(frozen=True)
class ValidityRate:
    """The share of a (cell, prompt)'s successful warm calls whose answer was valid for its kind
    (a measure of 1s and 0s, its samples kept). Judged absolutely against its floor (`thresholds:`
    key): below it is a regression; without a floor, a fall below the baseline's rate is one
    where it is significant (Fisher's exact test), else inconclusive."""

    name: str
    measure: str
    label: str
    threshold_key: str
    column: str


VALIDITY: tuple[ValidityRate, ...] = (
    ValidityRate(
        "warm_tool_call_valid_rate",
        "tool_call_valid",
        "warm tool call valid rate",
        "tool_call_valid_rate",
        "tool call valid",
    ),
    ValidityRate(
        "warm_schema_valid_rate",
        "schema_valid",
        "warm schema valid rate",
        "schema_valid_rate",
        "schema valid",
    ),
)

# A load point's gated figures' relative threshold by default (a load profile's `thresholds:`):
# wider than a warm figure's, as a point's p99 and throughput move more between runs.
DEFAULT_LOAD_THRESHOLD = 0.30


@dataclass(frozen=True)
class LoadFigure:
    """A gated figure of a load record (results/load_gate.py): its verdict's name and label,
    its summary field, its samples, its threshold's key under a load profile's `thresholds:`
    (config/load_profile.LoadThresholds, whose default is `default_threshold`), and which way is
    better."""

    name: str
    label: str
    field: str
    samples: str
    threshold_field: str
    higher_is_better: bool
    default_threshold: float = DEFAULT_LOAD_THRESHOLD


LOAD_GATED: tuple[LoadFigure, ...] = (
    LoadFigure(
        "load_output_tokens_per_sec", "output tokens/s", "output_tokens_per_sec",
        "output_tokens_per_sec", "throughput", True,
    ),
    LoadFigure("load_ttft_p99_ms", "TTFT p99", "ttft_ms_p99", "ttft_ms", "ttft_p99", False),
    LoadFigure("load_tpot_p99_ms", "TPOT p99", "tpot_ms_p99", "tpot_ms", "tpot_p99", False),
    LoadFigure("load_goodput_rate", "goodput", "goodput_rate", "goodput_rate", "goodput", True),
)  # fmt: skip
# A sweep's saturation rate, one figure per run, judged on the throughput threshold alone.
LOAD_SATURATION = LoadFigure(
    "load_saturation_rate", "saturation rate", "saturation_rate", "", "throughput", True
)
LOAD_DEFAULT_THRESHOLDS = {
    figure.threshold_field: figure.default_threshold for figure in LOAD_GATED
}

MEASURE_BY_NAME = {measure.name: measure for measure in MEASURES}


@dataclass(frozen=True)
class ResourceFigure:
    """A warm call's resource telemetry figure (telemetry/aggregate.py measures it per case) and
    how a (cell, prompt) sums it up over its warm calls: the peak of the per-call peaks, else the
    median. Its column in the resource table (the terminal, the Markdown and HTML reports), and
    the absolute `max_` limit cells.yaml's `thresholds:` may hold it to (config/cell.Thresholds;
    over it is a regression)."""

    name: str
    header: str
    digits: int
    peak: bool = False
    limit_key: str | None = None
    # Energy, marked `~` in the table where integrated from power draw.
    energy: bool = False


# In the resource table's order.
RESOURCES: tuple[ResourceFigure, ...] = (
    ResourceFigure("gpu_peak_memory_used_mib", "peak VRAM MiB", 0, True, "max_peak_vram_mib"),
    # The engine's own processes' VRAM (NVML on this machine); the whole GPU's is the one above.
    ResourceFigure("engine_gpu_memory_peak_mib", "engine VRAM MiB", 0, True, "max_engine_vram_mib"),
    ResourceFigure("gpu_utilization_mean_pct", "GPU util %", 1),
    ResourceFigure("gpu_power_mean_w", "power W", 1),
    ResourceFigure(
        "gpu_energy_j_per_token", "J/token", 4, limit_key="max_energy_j_per_token", energy=True
    ),
    ResourceFigure("gpu_tokens_per_j", "tokens/J", 2, energy=True),
    ResourceFigure("engine_cpu_s", "engine CPU s", 3),
    ResourceFigure(
        "engine_cpu_s_per_token", "CPU s/token", 5, limit_key="max_engine_cpu_s_per_token"
    ),
    ResourceFigure("engine_peak_rss_mib", "peak RSS MiB", 1, peak=True),
)  # fmt: skip
# The `max_` limits: the figure each holds.
RESOURCE_LIMITS = {
    figure.limit_key: figure.name for figure in RESOURCES if figure.limit_key is not None
}


def sampled() -> tuple[str, ...]:
    """The measures whose raw values are kept per (cell, prompt)."""
    return tuple(m.name for m in MEASURES if m.samples)


# NVML's clock event reasons (nvmlClocksEventReason*) that slow the engine's kernels, by bit, as a
# call record and a verdict name them; the others (idle, an application clock setting, sync
# boost, a display clock) are the GPU's or its owner's settings, not a neighbour or its state.
CLOCK_EVENTS = {
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}
