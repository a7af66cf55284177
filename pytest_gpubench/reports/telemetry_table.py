"""The warm calls' resource telemetry as a table (GPU memory, energy, the engine's CPU), for
the terminal and the Markdown document. Pure: summaries in, text out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pytest_gpubench.reports.formatting import NONE, fixed, table
from pytest_gpubench.telemetry.aggregate import TelemetrySummary

# -- resource telemetry --------------------------------------------------------------------------

TELEMETRY_HEADERS = (
    "cell",
    "prompt",
    "peak VRAM MiB",
    "engine VRAM MiB",
    "GPU util %",
    "power W",
    "J/token",
    "tokens/J",
    "engine CPU s",
    "CPU s/token",
    "peak RSS MiB",
)


def telemetry_rows(summaries: Iterable[TelemetrySummary]) -> list[list[str]]:
    """One row per (cell, prompt) whose warm calls were sampled (medians; peaks of peaks). Energy
    integrated from power, for GPUs without an energy counter, is marked `~`."""
    rows = []
    for summary in summaries:
        figures = (
            summary.gpu_peak_memory_used_mib,
            summary.engine_gpu_memory_peak_mib,
            summary.gpu_utilization_mean_pct,
            summary.gpu_power_mean_w,
            summary.gpu_energy_j_per_token,
            summary.gpu_tokens_per_j,
            summary.engine_cpu_s,
            summary.engine_cpu_s_per_token,
            summary.engine_peak_rss_mib,
        )
        if all(figure is None for figure in figures):
            continue
        integrated = "~" if summary.gpu_energy_source == "integrated_power" else ""
        peak, engine_peak, util, power, joules, per_joule, cpu, cpu_per_token, rss = figures
        rows.append(
            [
                summary.cell_id,
                summary.prompt_id,
                fixed(peak, 0),
                fixed(engine_peak, 0),
                fixed(util, 1),
                fixed(power, 1),
                integrated + fixed(joules, 4) if joules is not None else NONE,
                integrated + fixed(per_joule, 2) if per_joule is not None else NONE,
                fixed(cpu, 3),
                fixed(cpu_per_token, 5),
                fixed(rss, 1),
            ]
        )
    return rows


def telemetry_section(telemetry: Sequence[TelemetrySummary]) -> str:
    rows = telemetry_rows(telemetry)
    if not rows:
        return ""
    return "\n\n".join(
        [
            "## Resource telemetry (warm calls)",
            "Medians per call; peak VRAM and RSS are the highest seen. Peak VRAM is the whole "
            "GPU's, engine VRAM the engine's own processes' (NVML). `~`: energy integrated "
            "from power draw (no energy counter on the GPU, or one too coarse for the call).",
            table(rows, TELEMETRY_HEADERS, markdown=True),
        ]
    )
