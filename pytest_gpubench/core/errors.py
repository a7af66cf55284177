"""The one exception type for errors a user can cause (bad files, options, unreachable cells)."""

from __future__ import annotations


class GpubenchError(Exception):
    """A user-facing error: the message names the file, key or cell and what to do."""
