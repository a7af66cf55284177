"""Replacing a file: a reader sees the old file or the new one, and a failed write leaves neither
a temporary file nor half a file behind."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pytest_gpubench.core.files import atomic_file, atomic_write


class WriteFailed(Exception):
    """What the write below raises half-way."""


def test_a_write_replaces_the_file_with_its_mode_and_leaves_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "baseline.json"
    atomic_write(path, "old\n")
    atomic_write(path, b"new\n", mode=0o600)
    assert path.read_text(encoding="utf-8") == "new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [entry.name for entry in path.parent.iterdir()] == ["baseline.json"]


def test_a_write_that_fails_half_way_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.json"
    atomic_write(path, "old\n")
    with pytest.raises(WriteFailed), atomic_file(path) as temporary:
        temporary.write_text("half of the ne", encoding="utf-8")
        raise WriteFailed
    assert path.read_text(encoding="utf-8") == "old\n"
    assert [entry.name for entry in tmp_path.iterdir()] == ["journal.json"]


def test_a_first_write_that_fails_leaves_no_file_at_all(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    with pytest.raises(WriteFailed), atomic_file(path, durable=False) as temporary:
        temporary.write_bytes(b"GGUF")
        raise WriteFailed
    assert list(tmp_path.iterdir()) == []


def test_a_rename_that_fails_removes_the_temporary_file(tmp_path: Path) -> None:
    """The place is taken by a folder that is not empty: the rename itself fails."""
    path = tmp_path / "report.csv"
    (path / "in-the-way").mkdir(parents=True)
    with pytest.raises(OSError):
        atomic_write(path, "a,b\n")
    assert [entry.name for entry in tmp_path.iterdir()] == ["report.csv"]
    assert path.is_dir()
