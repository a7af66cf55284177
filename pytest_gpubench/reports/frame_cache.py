"""The columnar cache written beside a ledger as the ledger is written: its lines gathered as
they are appended, and a frame of their columns (reports/frame.py) added every few thousand
lines, so that no report and no session end has to read a large ledger again.

Light on purpose: a session builds one, and a session of a few hundred calls never imports the
columnar reader (numpy, pandas); only a ledger that grows past SMALL_LEDGER_LINES pays for it.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from pytest_gpubench.core.errors import GpubenchError

log = logging.getLogger(__name__)

# Lines gathered before a frame is added: about 16 MB of realistic call records held, and a
# tenth of a second on the session's main thread, between two tests, to turn them into columns.
FRAME_LINES = 8_192
# A ledger that ends with fewer lines gets no cache: read as it is, it takes well under a second,
# and its session does not pay the columnar reader's imports.
SMALL_LEDGER_LINES = 10_000


class ColumnCacheWriter:
    """Watches a ledger being written (ledger.writer.Ledger's observer): each line as written,
    then the ledger closed. `cache_for` is the ledger the cache belongs to, where the lines go
    to another file first (a merged ledger written beside its final name)."""

    def __init__(
        self,
        cache_for: Path,
        *,
        start: int = 0,
        frame_lines: int | None = None,
        small_ledger_lines: int | None = None,
    ) -> None:
        self.cache_for = cache_for
        self.frame_lines = frame_lines or FRAME_LINES
        self.small_ledger_lines = small_ledger_lines or SMALL_LEDGER_LINES
        self.lines: list[bytes] = []
        # Where the gathered lines begin in the ledger, and where the next one will.
        self.start = start
        self.position = start
        # The cache file's bytes written so far (its first frame starts it anew).
        self.cache_bytes = 0
        self.frames = 0
        self.failed = False

    def written(self, line: bytes) -> None:
        """One whole line, as written to the ledger (scrubbed, with its newline)."""
        self.lines.append(line)
        self.position += len(line)
        if len(self.lines) >= self.frame_lines:
            self._add_frame()

    def closed(self) -> None:
        """The ledger is closed: the lines gathered since the last frame become the last one,
        unless the whole ledger is small."""
        if self.frames or len(self.lines) >= self.small_ledger_lines:
            self._add_frame()

    def _add_frame(self) -> None:
        lines, self.lines = self.lines, []
        start, self.start = self.start, self.position
        if self.failed or not lines:
            return
        from pytest_gpubench.reports.frame import (
            append_frames,
            cache_path,
            frame_bytes,
            parse_lines,
        )

        target = cache_path(self.cache_for)
        try:
            part = parse_lines(lines, start, self.position)
            tail = b"".join(lines[-4:])[-64:]
            self.cache_bytes = append_frames(target, [frame_bytes(part, tail)], at=self.cache_bytes)
            self.frames += 1
        except (OSError, ValueError, GpubenchError) as exc:
            # A cache is never worth a failed run: the report reads the ledger instead.
            self.failed = True
            log.warning("the ledger's columnar cache was not written: %s", exc)
            with contextlib.suppress(OSError):
                target.unlink()
