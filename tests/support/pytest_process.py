"""pytest run as a subprocess in a pytester directory, for tests that kill it mid-run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# For a run whose subject is not the machine's speed: no control call before each warm call
# (tens of ms each) and no hypothesis pytest plugin (this suite's; about a second to import).
LEAN = ("-p", "no:hypothesispytest", "--gpubench-steadiness", "off")


def start_pytest(pytester: pytest.Pytester, *args: str) -> subprocess.Popen[str]:
    """A pytest subprocess in the test's directory, its output (stdout and stderr) piped; `args`
    are added to its command line."""
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "--force-load", "-p", "no:cacheprovider", *args],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
