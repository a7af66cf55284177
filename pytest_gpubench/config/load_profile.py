"""The `load:` profile of cells.yaml (in `settings:` and per cell): which load points a cell is
measured at, how each is bounded, what it sends and the SLO its goodput is counted against."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from pytest_gpubench.config.datasets import Dataset
from pytest_gpubench.config.metrics import LOAD_DEFAULT_THRESHOLDS
from pytest_gpubench.config.traces import Trace

ARRIVALS = ("constant", "poisson", "gamma")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Slo(_Strict):
    """Per-request limits (vLLM's goodput definition): a request meets the SLO when each set
    limit holds. A load point meets it when at least `attainment` of its requests do (0.99:
    the p99 is within the limit)."""

    ttft_ms: PositiveFloat | None = None
    tpot_ms: PositiveFloat | None = None
    e2e_ms: PositiveFloat | None = None
    attainment: Annotated[float, Field(gt=0.0, le=1.0)] = 0.99

    @property
    def limits(self) -> dict[str, float]:
        """{call record field: limit} of the limits that are set."""
        fields = {"first_delta_ms": self.ttft_ms, "tpot_ms": self.tpot_ms}
        fields["total_duration_ms"] = self.e2e_ms
        return {name: limit for name, limit in fields.items() if limit is not None}


class LoadThresholds(_Strict):
    """The gate on a load point (relative changes, 0.30 = 30 %): output tokens/s and goodput
    lower, TTFT and TPOT p99 higher; the defaults are config/metrics.LOAD_GATED's."""

    throughput: PositiveFloat = LOAD_DEFAULT_THRESHOLDS["throughput"]
    ttft_p99: PositiveFloat = LOAD_DEFAULT_THRESHOLDS["ttft_p99"]
    tpot_p99: PositiveFloat = LOAD_DEFAULT_THRESHOLDS["tpot_p99"]
    goodput: PositiveFloat = LOAD_DEFAULT_THRESHOLDS["goodput"]


class Prefix(_Strict):
    """Shared-prefix prompts (vLLM `bench serve`'s prefix repetition, SGLang's generated shared
    prefix): `groups` prefixes of `tokens` tokens each; every prompt starts with its group's
    prefix, then its own `input_tokens`. A prefix cache serves the shared part."""

    tokens: PositiveInt
    groups: Annotated[int, Field(ge=1, le=1024)] = 1


class Synthetic(_Strict):
    """Prompts given by token counts of the model's own tokenizer (vLLM `bench serve`'s
    `random`, guidellm's `prompt_tokens`): a seeded text of exactly `input_tokens` tokens,
    counted through the engine (engines/tokenizer.py), asking for `output_tokens` (ignore_eos).
    `input_tokens` may be a list of sizes, or a mean with `spread` (a standard deviation in
    tokens, `count` sizes drawn with `seed`): each size is one prompt, sent in turn under load."""

    input_tokens: int | list[int]
    output_tokens: PositiveInt
    seed: int = 0
    spread: Annotated[float, Field(ge=0.0)] | None = None
    # Distinct prompts: the sizes drawn with `spread`, or (when set) this many different texts
    # of each size; with `prefix`, spread over its groups.
    count: Annotated[int, Field(ge=1, le=1024)] = 8
    prefix: Prefix | None = None

    @field_validator("input_tokens", mode="before")
    @classmethod
    def _counts(cls, value: Any) -> Any:
        # One message for both spellings (a union would report each branch on a line of its own).
        def positive(item: Any) -> bool:
            return isinstance(item, int) and not isinstance(item, bool) and item > 0

        if positive(value) or (isinstance(value, list) and value and all(map(positive, value))):
            return value
        raise ValueError("a positive token count, or a non-empty list of them")

    @model_validator(mode="after")
    def _spread_of_one_mean(self) -> Synthetic:
        if isinstance(self.input_tokens, list) and self.spread is not None:
            raise ValueError("spread: only with one input_tokens mean, not a list of sizes")
        return self

    @property
    def sizes(self) -> tuple[int, ...]:
        """The input sizes in tokens, in the order they are sent."""
        if isinstance(self.input_tokens, list):
            return tuple(self.input_tokens)
        if self.spread is None or self.spread == 0:
            return (self.input_tokens,)
        chooser = random.Random(f"{self.seed}:{self.input_tokens}:{self.spread}")
        mean = self.input_tokens
        return tuple(max(1, round(chooser.gauss(mean, self.spread))) for _ in range(self.count))

    @property
    def variants(self) -> tuple[tuple[int, int], ...]:
        """(size, seed) of each distinct prompt, in the order they are sent: one per size, or
        `count` texts of each size where `count` is set or a prefix is shared."""
        sizes = self.sizes
        repeat = "count" in self.model_fields_set or self.prefix is not None
        if self.spread or not repeat:
            return tuple((size, self.seed + i) for i, size in enumerate(sizes))
        return tuple(
            (size, self.seed + i * len(sizes) + j)
            for i in range(self.count)
            for j, size in enumerate(sizes)
        )

    @property
    def prompt_id(self) -> str:
        """The id its cases and records carry in place of a prompts.yaml id."""
        prefix = f"-prefix{self.prefix.tokens}x{self.prefix.groups}" if self.prefix else ""
        if isinstance(self.input_tokens, list):
            sizes = "_".join(str(size) for size in self.input_tokens)
            return f"synthetic-in{sizes}-out{self.output_tokens}{prefix}"
        spread = f"sd{self.spread:g}" if self.spread else ""
        return f"synthetic-in{self.input_tokens}{spread}-out{self.output_tokens}{prefix}"


# `clients.coordinator: tunnel`: the tasks on an ssh node reach this machine through a remote
# port forward over the SSH connection, not by an address of this machine.
TUNNEL = "tunnel"


class Clients(_Strict):
    """Client tasks on another node for each load point (run/load/clients.py): an
    `srun` step of `tasks` tasks on a Slurm node of cells.yaml, or `tasks` SSH sessions on an
    ssh node, each sending its share, started at one barrier time, their clocks' offsets to
    this process measured and their requests merged raw. `coordinator`: this machine's address
    as the node reaches it, or `tunnel` (an ssh node: a port on the node's loopback carried back
    over the SSH connection, for a node that cannot reach this machine); `python`: the Python
    with pytest-gpubench that runs each task there (default: this one's path)."""

    node: str
    tasks: Annotated[int, Field(ge=1, le=256)]
    coordinator: str = "127.0.0.1"
    python: str | None = None


class Sweep(_Strict):
    """One request at a time, then as fast as the engine takes (closed loop at
    `max_concurrency`), then `rates` rates evenly between (with the profile's arrival): the
    saturation point is the highest of them that meets the SLO."""

    rates: Annotated[int, Field(ge=1, le=20)] = 3
    max_concurrency: Annotated[int, Field(ge=2, le=1024)] = 16
    # The open-loop rates reach up to this multiple of the closed loop's achieved rate (above 1:
    # past what the engine took at max_concurrency); the sweep stops rising at the first rate
    # that over-saturates the engine (run/load/sweep.py).
    up_to: Annotated[float, Field(ge=1.0, le=100.0)] = 1.0


class LoadProfile(_Strict):
    """A cell's load points and how each is run. Every key is optional here: `settings.load`
    gives the defaults, a cell's `load:` overrides them key by key (merged_profile)."""

    concurrency: list[Annotated[int, Field(ge=1, le=4096)]] | None = None
    rate: list[PositiveFloat] | None = None
    arrival: Literal["constant", "poisson", "gamma"] = "poisson"
    # The gamma distribution's shape: below 1 burstier than Poisson, above 1 more regular.
    burstiness: PositiveFloat = 1.0
    sweep: Sweep | None = None
    duration_s: PositiveFloat | None = None
    requests: PositiveInt | None = None
    warmup_s: Annotated[float, Field(ge=0.0)] = 0.0
    cooldown_s: Annotated[float, Field(ge=0.0)] = 0.0
    # The frozen prompts sent (ids of prompts.yaml; default: the cell's), or synthetic ones.
    prompts: list[str] | None = None
    synthetic: Synthetic | None = None
    # Prompts sampled from a dataset file (config/datasets.py), sent in turn.
    dataset: Dataset | None = None
    # Multi-turn sessions: each send is a session of `turns` requests, each with the history
    # and the previous answer, `think_time_s` between an answer and the next turn; `requests`
    # then counts sessions.
    turns: Annotated[int, Field(ge=1, le=64)] | None = None
    think_time_s: Annotated[float, Field(ge=0.0)] = 0.0
    # A trace replayed on its own schedule (config/traces.py): a point `trace-x<speedup>` per
    # speed-up, each request its own prompt and output length.
    trace: Trace | None = None
    # The arrival times' seed (poisson, gamma): the same schedule on every run.
    seed: int = 0
    # A case whose requests went out later than this after their scheduled time (p99) is
    # invalid: the client could not keep the schedule, and its figures would understate latency.
    max_send_lag_ms: PositiveFloat = 10.0
    # Client processes sharing each point (one process may not keep up with a fast engine):
    # each sends its share (streams, or rate/N) and reports its own send lag.
    processes: Annotated[int, Field(ge=1, le=64)] = 1
    # The measured window cut into slices this long, each with its own throughput and
    # percentiles in the load record (results/load_over_time.time_slices).
    slice_s: PositiveFloat | None = None
    # Client tasks on a Slurm or ssh node instead of processes here (Clients).
    clients: Clients | None = None
    # A ramp before the point's warm-up and measured window (run/load/ramp.py): its rate (an
    # open loop) or concurrency (a closed loop) rises from `ramp_from` of the point's own to all
    # of it over `ramp_s`, linearly or exponentially; its requests are left out of the figures.
    ramp_s: PositiveFloat | None = None
    ramp: Literal["linear", "exponential"] = "linear"
    ramp_from: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    slo: Slo | None = None
    thresholds: LoadThresholds = LoadThresholds()
    # A cell that chooses LoRA adapters per request (`lora:` a list or mapping): each request's
    # adapter in turn (`round_robin`) or drawn from `seed` (`random`), each adapter as often as
    # its weight (`lora_weights`: every adapter's, all alike when not given).
    lora_choice: Literal["round_robin", "random"] = "round_robin"
    lora_weights: dict[str, PositiveInt] | None = None

    @model_validator(mode="before")
    @classmethod
    def _sweep_shorthand(cls, data: Any) -> Any:
        # `sweep: true` is a sweep with the default steps.
        if isinstance(data, dict) and data.get("sweep") is True:
            data = {**data, "sweep": {}}
        # `prefix:` beside `synthetic:` (the peers' spelling) is the synthetic prompts' prefix.
        if isinstance(data, dict) and "prefix" in data:
            synthetic = data.get("synthetic")
            if not isinstance(synthetic, dict):
                raise ValueError("prefix: shares a prefix among synthetic prompts: add synthetic:")
            rest = {key: value for key, value in data.items() if key != "prefix"}
            return {**rest, "synthetic": {**synthetic, "prefix": data["prefix"]}}
        return data

    @model_validator(mode="after")
    def _ramp_keys(self) -> LoadProfile:
        if self.ramp_s is None and ({"ramp", "ramp_from"} & self.model_fields_set):
            raise ValueError("ramp, ramp_from: a ramp needs ramp_s (how long it lasts)")
        if self.ramp == "exponential" and self.ramp_from == 0:
            raise ValueError("ramp_from: an exponential ramp cannot start at 0 (e.g. 0.05)")
        if self.clients is not None and self.processes > 1:
            raise ValueError("clients, processes: give one (tasks on a node, or processes here)")
        return self

    @property
    def points(self) -> list[str]:
        """The load points in run order: `c<N>` closed loops, `r<rate>` open loops, `sweep`."""
        points = [f"c{n}" for n in dict.fromkeys(self.concurrency or [])]
        points += [f"r{rate_text(rate)}" for rate in dict.fromkeys(self.rate or [])]
        if self.trace is not None:
            points += [f"trace-x{rate_text(x)}" for x in dict.fromkeys(self.trace.speedup)]
        return points + (["sweep"] if self.sweep is not None else [])

    def prompt_ids(self, cell_prompts: tuple[str, ...]) -> tuple[str, ...]:
        """The prompts a load point sends, one case each: the synthetic one, the profile's
        frozen prompts, or the cell's."""
        if self.synthetic is not None:
            return (self.synthetic.prompt_id,)
        if self.dataset is not None:
            return (dataset_prompt_id(self.dataset),)
        if self.trace is not None:
            return (f"trace-{Path(self.trace.path).stem}",)
        return tuple(self.prompts) if self.prompts else cell_prompts

    @property
    def bounded(self) -> bool:
        # A trace ends with its last request.
        return self.duration_s is not None or self.requests is not None or self.trace is not None

    @property
    def longest_s(self) -> float:
        """How long one load point may run at most, for the case's timeout (a sweep runs
        `rates + 2` points)."""
        span = self.warmup_s + self.cooldown_s + (self.duration_s or 0.0) + (self.ramp_s or 0.0)
        if self.duration_s is None and self.requests is not None:
            span += float(self.requests)  # one request a second at the slowest, then the cap
        steps = (self.sweep.rates + 2) if self.sweep is not None else 1
        if self.trace is not None and self.duration_s is None:
            span += 600.0  # the trace's own length, not known before it is read
        return span * steps

    def shaping(self, *, open_loop: bool, sweep: bool, adapters: bool) -> dict[str, Any]:
        """The settings that shape a point's figures beyond its request (prompt_sha256) and its
        concurrency or rate (its name): a baseline measured under others is not comparable
        (results/load_gate.settings_changes). Not among them: how long the point runs (requests,
        duration_s: its sample's size), the arrivals' seed (another draw of the same process),
        its ramp and cool-down (left out of its figures), who sends it (processes, clients) and
        how it is reported or judged. `open_loop`: a point at a rate; `sweep`: the sweep's own
        record or one of its open-loop steps (whose rates its settings place); `adapters`: a
        cell that chooses LoRA adapters per request."""
        found: dict[str, Any] = {
            "warmup_s": self.warmup_s,
            "slo": self.slo.model_dump() if self.slo is not None else None,
        }
        if open_loop:
            found["arrival"] = self.arrival
            if self.arrival == "gamma":
                found["burstiness"] = self.burstiness
        if self.turns is not None:
            found |= {"turns": self.turns, "think_time_s": self.think_time_s}
        if sweep and self.sweep is not None:
            found["sweep"] = self.sweep.model_dump()
        if adapters:
            found |= {"lora_choice": self.lora_choice, "lora_weights": self.lora_weights}
        return found


def dataset_prompt_id(dataset: Dataset) -> str:
    """The id a dataset load case carries: `dataset-<file stem>`."""
    return f"dataset-{Path(dataset.path).stem}"


def rate_text(rate: float) -> str:
    """A rate as a point id writes it: 5 -> `5`, 0.5 -> `0.5`."""
    return f"{rate:g}" if math.isfinite(rate) else "inf"


LoadSetting = LoadProfile | Literal[False]


def merged_profile(default: LoadProfile | None, own: LoadSetting | None) -> LoadProfile | None:
    """A cell's effective profile: `settings.load` with the cell's keys on top; `load: false`
    (or `off`) turns load off for the cell; None when the cell has no load points."""
    if own is False:
        return None
    keys: dict[str, Any] = default.model_dump(exclude_unset=True) if default is not None else {}
    if own is not None:
        keys.update(own.model_dump(exclude_unset=True))
    profile = LoadProfile(**keys)
    return profile if profile.points else None
