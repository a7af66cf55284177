"""A (cell, prompt)'s machine while it ran, against the baseline's runs (pure): the control call's
and the CPU readings' movement (`Steadiness`), and what they make of a verdict: drifted (unsteady),
busy, which way the machine leaned, and how far the engine's own wait may have moved a figure.
Read from the samples and summaries by results/machine_steadiness.py; applied by the decision
core (results/decision.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# How far the control may move (on a log scale) before the machine counts as unsteady when its
# history is too short to say: 25 %. With history, three standard deviations of the control's own
# between-run spread, but never less than STEADY_FLOOR_MIN (a quiet machine still jitters).
DEFAULT_STEADY_FLOOR = math.log(1.25)
STEADY_FLOOR_MIN = math.log(1.15)


# How far the CPU pressure (the share of a call's time in which some task on the machine waited
# for a CPU, measure/control.py) may move, against the baseline's runs or between the halves of
# this run, before the machine counts as unsteady, and the level over which the machine counts as
# busy: 10 points (measured: 0.005 on a quiet 2-core machine, 0.52 beside two busy processes).
PRESSURE_LIMIT = 0.10
# Where the engine is a local process its own threads' run-queue wait per ms of the CPU they got
# (measure/engine_wait.py) stands in for the machine's pressure, with the same limit: 0.10 ms per
# ms is CPU work taking a tenth longer than on a free CPU. Measured beside the real llama-server
# (one thread) on a 2-core machine (benchmarks_dev/steadiness_signals.py): 0.10-0.11 while two
# other engineers' test suites ran, 0.94 beside two busy processes, 0.74 beside one copying
# 512 MiB over and over; 0.17 with its replies paced by a slower proxy, where the machine's pressure
# reads whatever the proxy and the client add. The engine's is the engine's alone: a slower
# engine waits in proportion to its longer running, a slower path around it changes neither.
# Where the engine's own wait is not read (a remote engine, one in a container), the neighbours'
# share of the machine's CPU time over the call, the engine's (where read) and the client's own
# taken out (measure/control.MachineCpu), stands in for the pressure, with the same limit: the
# pressure counts the engine and the client waiting for each other (issue 43: an idle 2-core
# machine read 34-36 % with an engine started by hand). A hypervisor's steal (a VM's CPU time the
# host gave to others, which no in-guest pressure sees) past the limit is a busy machine too.
PressureSource = Literal["machine", "engine", "neighbours"]
# Which way the machine leaned in this run against the baseline's runs (Steadiness.lean).
Lean = Literal["busier", "quieter"]
# How far a pressure reading (its p50) must move against the baseline's before it says which way
# the machine leaned: half the limit (two p50s of one machine's pressure a few points apart say
# nothing about which run its neighbours slowed more).
LEAN_MARGIN = PRESSURE_LIMIT / 2


@dataclass(frozen=True)
class Steadiness:
    """What the control call and the CPU pressure showed about the machine while this (cell,
    prompt) ran.

    `against_baseline`: the control's p50 in this run / in the baseline's runs (the machine as a
    whole faster or slower than when the baseline was measured); `within_run`: the control's p50
    over the later half of the calls / over the earlier half (the machine drifted during the run).
    `floor`: how far either may move (log scale) before the machine counts as unsteady.
    `pressure`, `baseline_pressure`: the CPU pressure's p50 in this run and in the baseline's runs
    (the share of each call's time in which some task on the machine waited for a CPU);
    `pressure_halves`: its p50 over the earlier and the later half of this run, when they differ
    significantly.
    """

    against_baseline: float | None
    within_run: float | None
    floor: float = DEFAULT_STEADY_FLOOR
    pressure: float | None = None
    baseline_pressure: float | None = None
    pressure_halves: tuple[float, float] | None = None
    # The busiest of the baseline's runs (its history's highest pressure p50): a between-run
    # spread learned while the machine was busy in some runs is the machine's, not the engine's.
    baseline_pressure_max: float | None = None
    # False where the pressure includes the run's own load (a load point's concurrent requests
    # keep tasks waiting by design): then only its change against the baseline counts.
    contention_counts: bool = True
    # The time the pressure was read over, for the messages.
    pressure_window: str = "the calls' time"
    # What `pressure` is: the share of the time in which some task on the machine waited for a
    # CPU ("machine"), or the engine's own threads' wait per ms of CPU they got ("engine").
    pressure_source: PressureSource = "machine"
    # The harness's own threads' wait per ms they ran, p50 over this run's calls (None where not
    # read): a client that waited for a CPU read the engine's bytes late, whatever the engine's.
    client_wait: float | None = None
    # The share of the CPUs' time the hypervisor stole, p50 over this run's calls (None: not read).
    steal: float | None = None
    # What the GPU's own signals showed beside the engine during this run's calls, where they
    # moved against the baseline's (another process on it, clocks held down), or None.
    gpu: str | None = None
    # The other processes' share of the machine's CPU time (the benchmark's own engine and
    # client taken out), the busiest p50 of this run's and the baseline's runs, where both read
    # it; None where not. At or under the limit nothing but the benchmark ran: an engine's or a
    # client's wait is then for the benchmark's own threads (an engine with more compute threads
    # than CPUs, the client beside it on two cores), which no re-run removes, and neither makes
    # the machine busy or unsteady (issue 43). Over it, the waits count as before.
    neighbours: float | None = None

    @property
    def own_waits_only(self) -> bool:
        """Whether the other processes took no more than the limit of the CPUs' time in this run
        and the baseline's: a wait read then is the benchmark's own."""
        return self.neighbours is not None and self.neighbours <= PRESSURE_LIMIT

    @property
    def engine_waited_for_itself(self) -> bool:
        """Whether `pressure` is a local engine's own wait and nothing but the benchmark ran: it
        waited for its own threads, as its build does, and its wait says nothing of the machine."""
        return self.pressure_source == "engine" and self.own_waits_only

    def _waited(self, value: float) -> str:
        if self.pressure_source == "engine":
            return f"the engine's threads waited {value:.2f} ms for a CPU per ms they ran"
        if self.pressure_source == "neighbours":
            return f"other processes used {value:.0%} of the CPUs' time during the calls"
        return f"tasks waited for a CPU {value:.0%} of {self.pressure_window}"

    def _level(self, value: float) -> str:
        return f"{value:.2f}" if self.pressure_source == "engine" else f"{value:.0%}"

    @property
    def drift(self) -> str | None:
        """Why the machine counts as unsteady, or None when it held."""
        reasons = []
        limit = f"±{math.exp(self.floor) - 1.0:.0%}"
        if self.against_baseline and abs(math.log(self.against_baseline)) > self.floor:
            ran = signed_percent(self.against_baseline)
            reasons.append(f"the control call ran {ran} against the baseline's (beyond {limit})")
        if self.within_run and abs(math.log(self.within_run)) > self.floor:
            reasons.append(
                f"the control call drifted {signed_percent(self.within_run)} during the run "
                f"(beyond {limit})"
            )
        now, then = self.pressure, self.baseline_pressure
        own_engine = self.engine_waited_for_itself
        if own_engine:
            now = then = None
        if now is not None and then is not None and abs(now - then) > PRESSURE_LIMIT:
            limit = (
                f"±{PRESSURE_LIMIT:.2f}"
                if self.pressure_source == "engine"
                else f"±{PRESSURE_LIMIT * 100:.0f} points"
            )
            reasons.append(
                f"{self._waited(now)} against {self._level(then)} in the baseline's runs "
                f"(beyond {limit})"
            )
        if self.pressure_halves is not None and not own_engine:
            early, late = self.pressure_halves
            if abs(late - early) > PRESSURE_LIMIT:
                what = {
                    "engine": "the engine's wait per ms of CPU",
                    "neighbours": "the other processes' CPU share",
                }.get(self.pressure_source, "the CPU pressure")
                reasons.append(
                    f"{what} went from {self._level(early)} to {self._level(late)} "
                    + (
                        "during the run"
                        if self.pressure_source == "engine"
                        else f"of {self.pressure_window} during the run"
                    )
                )
        if self.gpu is not None:
            reasons.append(self.gpu)
        return "; ".join(reasons) if reasons else None

    @property
    def lean(self) -> Lean | None:
        """Which way the machine leaned in this run against the baseline's runs, where every
        reading that compares the two agrees: "busier" (the control call slower, the engine or
        the machine waiting more than in the baseline's runs) or "quieter". None where they
        disagree, where none compares the two, or where a reading has nothing of the baseline's
        to compare with (the control drifting during the run, the client's wait, steal, the
        GPU's signals): then which way the machine moved the figure is not known.

        A busier machine only slows a run: a figure that came out within the threshold or better
        on it is not worse on a quiet one; a quieter machine cannot have made a run slower
        (decide)."""
        if self.gpu is not None or (self.steal is not None and self.steal > PRESSURE_LIMIT):
            return None
        own = self.own_waits_only
        if self.client_wait is not None and self.client_wait > PRESSURE_LIMIT and not own:
            return None
        if self.within_run and abs(math.log(self.within_run)) > self.floor:
            return None
        signs: list[int] = []
        # The control call counts where it moved beyond the floor (within it, it held).
        if self.against_baseline and abs(math.log(self.against_baseline)) > self.floor:
            signs.append(1 if self.against_baseline > 1.0 else -1)
        then = self.baseline_pressure
        if then is not None and not self.engine_waited_for_itself:
            readings = self.pressure_halves or (
                (self.pressure, self.pressure) if self.pressure is not None else None
            )
            if readings is not None:
                low, high = min(readings), max(readings)
                if low - then > LEAN_MARGIN:
                    signs.append(1)
                elif then - high > LEAN_MARGIN:
                    signs.append(-1)
                else:
                    return None
        if not signs or len(set(signs)) > 1:
            return None
        return "busier" if signs[0] > 0 else "quieter"

    def machine_factor(self) -> tuple[float, str]:
        """How far the machine alone may have moved this run's figures against the baseline's
        runs within the steadiness limits, as a factor of a time (0.92: 8 % faster, 1.08: 8 %
        slower, 1.0: not at all), and the reading that says so: a local engine's own wait, where
        a ms of its CPU work took 1 + wait ms of the call's time, so (1 + now) / (1 + then). A
        quiet machine's few hundredths of wait move a figure by a few per cent; a run that a
        drift within the limit sped up by 8 % can pass a 30 % slowdown as +19 % (issue 43: an
        on/off neighbour's off phase against a baseline taken in its on phase)."""
        now, then = self.pressure, self.baseline_pressure
        engine = self.pressure_source == "engine" and not self.engine_waited_for_itself
        if not engine or now is None or then is None:
            return 1.0, ""
        said = (
            f"the engine's threads waited {now:.2f} ms for a CPU per ms they ran against "
            f"{then:.2f} in the baseline's runs"
        )
        return (1.0 + now) / (1.0 + then), said

    @property
    def contended(self) -> str | None:
        """How busy the machine was when it was busy beyond PRESSURE_LIMIT in this run or in any
        of the baseline's runs (steadily: a drift is `drift`), or None. On such a machine the
        engine's speed is partly its neighbours' to decide: a verdict that cannot tell (blind,
        inconclusive) is `unsteady` there, never a silent pass."""
        if not self.contention_counts:
            return None
        readings = (self.pressure, self.baseline_pressure, self.baseline_pressure_max)
        busiest = max((p for p in readings if p is not None), default=None)
        waits = []
        own = self.own_waits_only
        if busiest is not None and busiest > PRESSURE_LIMIT and not self.engine_waited_for_itself:
            waits.append(self._waited(busiest))
        if self.client_wait is not None and self.client_wait > PRESSURE_LIMIT and not own:
            waits.append(
                f"the client's threads waited {self.client_wait:.2f} ms for a CPU per ms they ran"
            )
        if self.steal is not None and self.steal > PRESSURE_LIMIT:
            waits.append(f"the hypervisor took {self.steal:.0%} of the CPUs' time (steal)")
        return f"the machine was busy: {' and '.join(waits)}" if waits else None


def signed_percent(ratio: float) -> str:
    """A ratio as the change every verdict and report writes: 1.352 -> "+35.2%"."""
    return f"{ratio - 1.0:+.1%}"
