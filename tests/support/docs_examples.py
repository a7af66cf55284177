"""The examples of a docs page, as a new user would copy them: each fenced or indented code block
that is a prompts.yaml (top-level `prompts:`), a cells.yaml (top-level `cells:`) or commands
(`pytest ...`, `gpubench ...`), with what the page says of it in a marker comment on the line
before the block:

    <!-- example: exit 4 -->                          the documented exit status (default 0)
    <!-- example: shows "a line the output holds" -->  a line the output must hold (with exit)
    <!-- example: not here: why -->                   it cannot run here, and why

Pure: a page's text in, its examples out (tests/test_docs_examples.py runs them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import yaml

ExampleKind = Literal["prompts", "cells", "commands"]
# A code block's first word that makes it commands a user runs.
COMMAND_WORDS = ("pytest", "gpubench", "python", "git", "cd", "make", "pip")
MARKER = re.compile(r"^<!-- example: (.*?) -->$")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Example:
    """One example of a page: its kind, its text, where it starts, what the page says of it."""

    page: str
    line: int
    kind: ExampleKind
    text: str
    exit_status: int = 0
    shows: tuple[str, ...] = ()
    not_here: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def yaml(self) -> dict[str, Any]:
        loaded = yaml.safe_load(self.text)
        assert isinstance(loaded, dict)
        return loaded

    def commands(self) -> list[str]:
        """The block's command lines, `$ ` and trailing `# comments` cut. In a block that shows a
        session (lines with a `$ ` prompt), only those: the rest is what they print."""
        raw_lines = self.text.splitlines()
        prompted = [line for line in raw_lines if line.strip().startswith("$ ")]
        lines = []
        for raw in prompted or raw_lines:
            line = raw.strip().removeprefix("$ ")
            if line.split(" ", 1)[0] in COMMAND_WORDS:
                lines.append(re.sub(r"\s+#\s.*$", "", line).strip())
        return lines


def _blocks(text: str) -> list[tuple[int, str, str]]:
    """(first line number, language, text) of each code block: fenced, or indented by 4 spaces
    after a blank line (not inside a list item's paragraph)."""
    lines = text.splitlines()
    blocks: list[tuple[int, str, str]] = []
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence:
            end = index + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            blocks.append((index + 1, fence.group(1), "\n".join(lines[index + 1 : end])))
            index = end + 1
            continue
        if lines[index].startswith("    ") and (index == 0 or not lines[index - 1].strip()):
            end = index
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            body = "\n".join(line[4:] for line in lines[index:end]).rstrip("\n")
            blocks.append((index + 1, "", body))
            index = end
            continue
        index += 1
    return blocks


def _kind(language: str, text: str) -> ExampleKind | None:
    if language in ("yaml", "yml", ""):
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError:
            loaded = None
        if isinstance(loaded, dict) and isinstance(loaded.get("prompts"), dict):
            return "prompts"
        if isinstance(loaded, dict) and isinstance(loaded.get("cells"), list):
            return "cells"
    if language in ("", "bash", "sh", "console", "shell"):
        first = text.strip().removeprefix("$ ").split(" ", 1)[0]
        if first in COMMAND_WORDS:
            return "commands"
    return None


def page_examples(page: str, text: str) -> list[Example]:
    """Every example of the page, in order, with its marker's word."""
    lines = text.splitlines()
    examples = []
    for number, language, body in _blocks(text):
        kind = _kind(language, body)
        if kind is None:
            continue
        before = number - 2  # the line before the block (numbers count from 1)
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = MARKER.match(lines[before].strip()) if before >= 0 else None
        exit_status, shows, not_here = 0, (), None
        if marker is not None:
            word = marker.group(1)
            if word.startswith("not here:"):
                not_here = word.removeprefix("not here:").strip()
            for status in re.findall(r"\bexit (\d+)", word):
                exit_status = int(status)
            shows = tuple(re.findall(r'shows "([^"]+)"', word))
        examples.append(Example(page, number, kind, body, exit_status, shows, not_here))
    return examples
