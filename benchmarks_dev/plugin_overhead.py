"""What the plugin costs a pytest session that collects no benchmark, as a new user meets it: in an
empty folder with one trivial test, `python -m pytest -q` against `python -m pytest -q -p
no:gpubench`, in alternating pairs (the order flipped every pair), and the median differences
of wall-clock and of CPU time (user and system: less moved by a busy machine), with the load
average before and after (the wall-clock figure moves with it):

    PYTHONPATH=. python benchmarks_dev/plugin_overhead.py [--pairs 25]

The interpreter is this one; the plugin is the one it imports (check `pytest_gpubench.__file__`).
`python -X importtime -c 'import pytest_gpubench.plugin'` is the load-independent companion.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRIVIAL = "def test_one():\n    assert 1 + 1 == 2\n"


def _wall(folder: Path, *extra: str) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds: user and system) of one session."""
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *extra],
        cwd=folder,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=25)
    args = parser.parse_args()
    import pytest_gpubench

    print(f"plugin: {pytest_gpubench.__file__}")
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        (folder / "test_trivial.py").write_text(TRIVIAL)
        _wall(folder)  # bytecode written, files in the page cache
        _wall(folder, "-p", "no:gpubench")
        with_plugin: list[tuple[float, float]] = []
        without: list[tuple[float, float]] = []
        for pair in range(args.pairs):
            if pair % 2:
                without.append(_wall(folder, "-p", "no:gpubench"))
                with_plugin.append(_wall(folder))
            else:
                with_plugin.append(_wall(folder))
                without.append(_wall(folder, "-p", "no:gpubench"))
    print(f"load average after: {os.getloadavg()}")
    for index, what in enumerate(("wall", "CPU")):
        plugged = [sample[index] for sample in with_plugin]
        plain = [sample[index] for sample in without]
        differences = [a - b for a, b in zip(plugged, plain, strict=True)]
        print(
            f"{args.pairs} pairs, {what}: with the plugin {statistics.median(plugged) * 1000:.0f} "
            f"ms, without {statistics.median(plain) * 1000:.0f} ms (medians); the median pair's "
            f"difference {statistics.median(differences) * 1000:+.0f} ms, ratio "
            f"{statistics.median(plugged) / statistics.median(plain):.2f}"
        )


if __name__ == "__main__":
    main()
