"""Charts for the HTML pages: matplotlib set up once (Agg, text kept as text, stable ids) and a
figure turned into inline SVG."""

from __future__ import annotations

import io
from typing import Any

from pytest_gpubench.core.errors import GpubenchError


def inline_svg(figure: Any) -> str:
    """The figure as inline SVG: text kept as text, no date, ids stable from run to run."""
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(figure)
    text = buffer.getvalue()
    start = text.find("<svg")
    return f'<div class="chart">{text[start:]}</div>'


# The one line a user without the extra reads (gpubench exits 2, as for any usage error).
MISSING_MATPLOTLIB = (
    "the HTML report draws its charts with matplotlib, which is not installed: "
    "pip install 'pytest-gpubench[html]'"
)


def pyplot() -> Any:
    """matplotlib's pyplot, drawing off-screen (Agg) with stable SVG output; a GpubenchError
    naming the extra where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise GpubenchError(MISSING_MATPLOTLIB) from None

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "gpubench", "font.size": 9})
    import matplotlib.pyplot as plt

    return plt
