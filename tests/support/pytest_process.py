"""pytest run as a subprocess in a pytester directory, for tests that kill it mid-run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def start_pytest(pytester: pytest.Pytester) -> subprocess.Popen[str]:
    """A pytest subprocess in the test's directory, its output (stdout and stderr) piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "--force-load", "-p", "no:cacheprovider"],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
