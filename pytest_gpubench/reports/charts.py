"""Charts for the HTML pages: matplotlib set up once (Agg, text kept as text, stable ids) and a
figure turned into inline SVG."""

from __future__ import annotations

import io
from typing import Any


def inline_svg(figure: Any) -> str:
    """The figure as inline SVG: text kept as text, no date, ids stable from run to run."""
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(figure)
    text = buffer.getvalue()
    start = text.find("<svg")
    return f'<div class="chart">{text[start:]}</div>'


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "gpubench", "font.size": 9})
    import matplotlib.pyplot as plt

    return plt
