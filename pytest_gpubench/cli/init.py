"""`gpubench init`: the files a repository needs to run its first benchmark and gate CI on it,
written from the templates shipped in the package (templates/), never over an existing file."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

from pytest_gpubench.core.errors import GpubenchError

DISTRIBUTION = "pytest-gpubench"
IGNORED_LINE = "runs/"
# Lines that already keep runs/ (the ledgers) out of git.
IGNORES_RUNS = {"runs", "runs/", "/runs", "/runs/", "runs/*", "/runs/*"}
REQUIREMENT_MARK = "__GPUBENCH_REQUIREMENT__"
VERSION_MARK = "__GPUBENCH_VERSION__"


@dataclass(frozen=True)
class Template:
    """A file `gpubench init` writes: where, from which template."""

    path: str
    template: str


TEMPLATES = (
    Template("cells.yaml", "cells.yaml"),
    Template("prompts.yaml", "prompts.yaml"),
    Template("benchmarks/test_inference.py", "test_inference.py.txt"),
    Template(".github/workflows/gpubench.yml", "gpubench.yml"),
)


def template_text(name: str) -> str:
    """A shipped template as text (the embedded default cells.yaml, the canonical prompts, ...)."""
    return (resources.files("pytest_gpubench.cli") / "templates" / name).read_text(encoding="utf-8")


def _version() -> str | None:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def _rendered(template: Template) -> str:
    """The template with the installed version pinned (the CI workflow installs that one)."""
    text = template_text(template.template)
    version = _version()
    requirement = f"{DISTRIBUTION}=={version}" if version else DISTRIBUTION
    return text.replace(REQUIREMENT_MARK, requirement).replace(VERSION_MARK, version or "any")


def init_project(directory: Path, *, force: bool = False) -> list[str]:
    """Write the starter files into `directory`; one line per file saying what was done."""
    if directory.exists() and not directory.is_dir():
        raise GpubenchError(f"{directory}: not a directory")
    lines: list[str] = []
    for template in TEMPLATES:
        target = directory / template.path
        if target.exists() and not force:
            lines.append(f"kept {template.path} (it exists; --force overwrites it)")
            continue
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(_rendered(template), encoding="utf-8")
        except OSError as exc:
            raise GpubenchError(f"{target}: cannot write: {exc.strerror}") from None
        lines.append(f"wrote {template.path}")
    lines.append(_ignore_runs(directory / ".gitignore"))
    return lines


def _ignore_runs(gitignore: Path) -> str:
    """Add `runs/` to .gitignore unless a line already ignores it."""
    try:
        text = gitignore.read_text(encoding="utf-8") if gitignore.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise GpubenchError(f"{gitignore}: cannot read: {exc}") from None
    if any(line.strip() in IGNORES_RUNS for line in text.splitlines()):
        return "kept .gitignore (it already ignores runs/)"
    separator = "" if not text or text.endswith("\n") else "\n"
    comment = "# pytest-gpubench ledgers (kept as CI artifacts, not committed)\n"
    try:
        gitignore.write_text(f"{text}{separator}{comment}{IGNORED_LINE}\n", encoding="utf-8")
    except OSError as exc:
        raise GpubenchError(f"{gitignore}: cannot write: {exc.strerror}") from None
    return f"added {IGNORED_LINE} to .gitignore"


NEXT_STEPS = """\
next:
  git add -A && git commit -m "Benchmarks with pytest-gpubench"
  pytest benchmarks/                      # measure; the first run has no baseline (verdict new)
  pytest benchmarks/ --baseline-update    # ratify the numbers, then commit baselines/
  pytest --gpubench-skip                  # the other tests, without the benchmarks"""
