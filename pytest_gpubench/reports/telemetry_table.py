"""The warm calls' resource telemetry as a table (GPU memory, energy, the engine's CPU), for
the terminal and the Markdown document: a column per figure of config/metrics.RESOURCES. Pure:
summaries in, text out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pytest_gpubench.config.metrics import RESOURCES
from pytest_gpubench.reports.formatting import fixed, table
from pytest_gpubench.telemetry.aggregate import TelemetrySummary

# -- resource telemetry --------------------------------------------------------------------------

TELEMETRY_HEADERS = ("cell", "prompt", *(figure.header for figure in RESOURCES))


def telemetry_rows(summaries: Iterable[TelemetrySummary]) -> list[list[str]]:
    """One row per (cell, prompt) whose warm calls were sampled (medians; peaks of peaks). Energy
    integrated from power, for GPUs without an energy counter, is marked `~`."""
    rows = []
    for summary in summaries:
        figures = [getattr(summary, figure.name) for figure in RESOURCES]
        if all(value is None for value in figures):
            continue
        integrated = "~" if summary.gpu_energy_source == "integrated_power" else ""
        rows.append(
            [
                summary.cell_id,
                summary.prompt_id,
                *(
                    integrated + fixed(value, figure.digits)
                    if figure.energy and value is not None
                    else fixed(value, figure.digits)
                    for figure, value in zip(RESOURCES, figures, strict=True)
                ),
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
