"""The reference site (mkdocs.yml, docs/): `make docs` builds it with `mkdocs build --strict` as
`make test` does, so a broken link or anchor, or a page left out of the nav, fails the build; one
page is served on 127.0.0.1 and opened in a real headless Chromium (as the HTML report is)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import typing
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from test_html_report import chromium, console_problems, needs_chromium

REPO = Path(__file__).resolve().parent.parent
# What the site is built from: docs/architecture.md includes ARCHITECTURE.md (pymdownx.snippets).
SITE_SOURCES = ("Makefile", "mkdocs.yml", "ARCHITECTURE.md", "docs")


def site_sources(tmp_path: Path) -> Path:
    """A copy of what the site is built from, to break on purpose."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in SITE_SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, root / name)
        else:
            shutil.copy2(source, root / name)
    return root


def make_docs(root: Path) -> subprocess.CompletedProcess[str]:
    """`make docs` with this interpreter's environment (`-o python`: the venv is not remade)."""
    return subprocess.run(
        ["make", "-o", "python", "docs", f"BIN={Path(sys.executable).parent}"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,  # the tests read the status: a failed build is what some of them want
    )


def nav_pages(root: Path) -> list[str]:
    """The pages mkdocs.yml's nav lists (`Title: page.md` lines)."""
    return re.findall(r":\s+([\w./-]+\.md)\s*$", (root / "mkdocs.yml").read_text(), flags=re.M)


def test_make_docs_builds_every_page_and_the_nav_lists_them_all(tmp_path: Path) -> None:
    root = site_sources(tmp_path)
    result = make_docs(root)
    assert result.returncode == 0, result.stdout + result.stderr
    pages = sorted(path.name for path in (root / "docs").glob("*.md"))
    assert sorted(nav_pages(root)) == pages
    for page in pages:
        built = "index.html" if page == "index.md" else f"{page.removesuffix('.md')}/index.html"
        assert (root / "site" / built).is_file(), page
    # docs/architecture.md shows ARCHITECTURE.md itself: one copy of it.
    architecture = (root / "site" / "architecture" / "index.html").read_text()
    assert "Folders by layer" in architecture and "Where a change goes" in architecture


def test_the_readme_links_to_pages_of_the_site() -> None:
    """GitHub renders README.md, not mkdocs: its links into docs/ are checked here."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", readme)
    assert len(links) >= 10
    nav = set(nav_pages(REPO))
    for target, anchor in links:
        assert (REPO / target).is_file(), target
        assert Path(target).name in nav, f"{target} is not in mkdocs.yml's nav"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (REPO / target).read_text(), flags=re.M)
            slugs = {re.sub(r"[^\w -]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{target}#{anchor}"


def test_the_readme_starts_with_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text().splitlines()
    commands = [line.split("#")[0].strip() for line in readme[:12] if line.startswith("    make ")]
    assert commands == ["make bench", "make test"]
    assert len(readme) <= 250


def test_a_page_left_out_of_the_nav_fails_make_docs(tmp_path: Path) -> None:
    root = site_sources(tmp_path)
    (root / "docs" / "orphan.md").write_text("# A page nobody can reach\n")
    result = make_docs(root)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert 'not included in the "nav"' in output and "orphan.md" in output, output


@pytest.mark.parametrize(
    ("link", "named"),
    [
        ("[gone](no-such-page.md)", "no-such-page.md"),
        ("[gone](gate.md#no-such-anchor)", "#no-such-anchor"),
    ],
    ids=["page", "anchor"],
)
def test_a_broken_link_fails_make_docs(tmp_path: Path, link: str, named: str) -> None:
    root = site_sources(tmp_path)
    with (root / "docs" / "ci.md").open("a") as page:
        page.write(f"\nSee {link}.\n")
    result = make_docs(root)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "ci.md" in output and named in output, output


class _Site(SimpleHTTPRequestHandler):
    """Serves the built site and notes every request with its status."""

    requests: list[tuple[str, int]]

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.requests.append((self.path, int(code)))

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def served_site(tmp_path: Path) -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """The site built by `make docs`, on a loopback port; yields its URL and the requests made."""
    root = site_sources(tmp_path)
    result = make_docs(root)
    assert result.returncode == 0, result.stdout + result.stderr
    requests: list[tuple[str, int]] = []
    handler = type("Handler", (_Site,), {"requests": requests})
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(root / "site")))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


@needs_chromium
@pytest.mark.browser
def test_chromium_renders_a_docs_page_with_its_nav_and_no_console_errors(
    served_site: tuple[str, list[tuple[str, int]]], tmp_path: Path
) -> None:
    url, requests = served_site
    screenshot = tmp_path / "gate.png"
    page = f"{url}/gate/"
    shot = chromium(
        page,
        tmp_path / "profile-1",
        "--window-size=1280,1600",
        "--hide-scrollbars",
        f"--screenshot={screenshot}",
    )
    dom = chromium(page, tmp_path / "profile-2", "--dump-dom")

    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 50_000  # a styled page of text, not a blank one
    assert console_problems(shot.stderr + dom.stderr) == []
    html = dom.stdout
    assert re.search(r"<h1[^>]*>The regression gate", html)
    assert 'id="how-far-to-trust-it"' in html
    # The site's navigation (sections nest their own <nav>s), up to the page's content.
    nav = re.search(r'<nav class="md-nav md-nav--primary".*?class="md-content"', html, flags=re.S)
    assert nav is not None
    for entry in (
        "Getting started",
        "cells.yaml and prompts.yaml",
        "Exit statuses",
        "Architecture",
    ):
        assert f">{entry}<" in re.sub(r">\s+", ">", re.sub(r"\s+<", "<", nav.group(0))), entry
    # The theme's stylesheet and script came from the site itself, and nothing was missing.
    paths = [path for path, _ in requests]
    assert any(re.match(r"/assets/stylesheets/main\.\w+\.min\.css", p) for p in paths), paths
    assert any(re.match(r"/assets/javascripts/bundle\.\w+\.min\.js", p) for p in paths), paths
    assert [(path, code) for path, code in requests if code != 200] == []


def test_every_exit_status_is_in_the_docs_table_its_precedence_and_the_readme() -> None:
    """core/status.py is the one place the statuses live; exit status 10 (unsteady) was missing
    from docs/exit-statuses.md and README's one-line list (issue 37)."""
    from pytest_gpubench.core.status import MEANINGS, SEVERITY

    page = (REPO / "docs" / "exit-statuses.md").read_text()
    table = set(re.findall(r"^\| ([\d, ]+) \|", page, flags=re.M))
    in_table = {int(number) for row in table for number in row.split(",")}
    assert in_table == set(MEANINGS)
    (precedence,) = re.findall(r"^When several apply: (.*)$", page, flags=re.M)
    named = [int(number) for number in re.findall(r"\b(\d+)\b", precedence)]
    # pytest's own statuses are named as one; the plugin's, each in the order of SEVERITY.
    ours = [status for status in SEVERITY if status > int(pytest.ExitCode.NO_TESTS_COLLECTED)]
    assert named == ours, precedence
    readme = (REPO / "README.md").read_text()
    (line,) = re.findall(r"## Exit statuses in one line\n\n(.*?)\n\n", readme, flags=re.S)
    listed = {int(number) for number in re.findall(r"(?:^|[;,] )(\d+)", line.replace("\n", " "))}
    assert listed == set(MEANINGS), line


def test_every_key_of_a_cell_is_documented() -> None:
    """`stall_s` was in no page (issue 37): each key a cell takes is named on the site, as
    `key` or `key:`."""
    from pytest_gpubench.config.cell import CellSpec

    site = "\n".join(page.read_text() for page in (REPO / "docs").glob("*.md"))
    undocumented = [
        name for name in CellSpec.model_fields if not re.search(rf"(`{name}\b|\b{name}:)", site)
    ]
    assert undocumented == []


def test_no_page_calls_a_verdict_that_holds_the_run_back_a_pass() -> None:
    """docs/gate.md's table says what each verdict word exits with; docs/gate-noise.md said
    "`blind` never fails a run: it is a pass", while blind exits 10 (issue 44). No page may
    call a verdict that exits non-zero a pass, or say it never fails a run."""
    table = (REPO / "docs" / "gate.md").read_text()
    exits = {
        word: int(status)
        for word, status in re.findall(r"^\| `(\w+)` \|.*\| (\d+)[^|]*\|$", table, flags=re.M)
    }
    assert exits["blind"] == 10 and exits["ok"] == 0, exits
    held_back = [word for word, status in exits.items() if status != 0]
    claims = [
        (page.name, word, found.group(0))
        for page in sorted((REPO / "docs").glob("*.md"))
        for word in held_back
        for found in re.finditer(
            rf"`{word}` (never fails a run|is a pass|passes)[^.]*", page.read_text()
        )
    ]
    assert claims == []


def _models_in(annotation: Any) -> Iterator[type[Any]]:
    """The pydantic models an annotation holds (itself, or inside Optional, list, dict, ...)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for argument in typing.get_args(annotation):
        yield from _models_in(argument)


def _dotted_keys(model: type[Any], prefix: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """Every key a YAML mapping of `model` takes, as a path, its nested models' keys too."""
    for name, field in model.model_fields.items():
        path = (*prefix, field.alias or name)
        yield path
        for nested in _models_in(field.annotation):
            yield from _dotted_keys(nested, path)


def test_every_dotted_key_of_cells_yaml_is_documented_beside_its_parent() -> None:
    """The top-level check above let `load.dataset`'s length filters and `column`, and a
    provider node's `api_token_env`, `min_vram_gb`, ... go undocumented (issue 44). Every key of
    every model of cells.yaml (a cell, `settings:`, each node kind, and every model nested in
    them: `load.dataset.min_input_words`, `provider.api_token_env`, `slurm.login.port`) is named
    on the site as `key` or `key:`, in a paragraph or block that also names its parent key (or
    the node's kind)."""
    from pytest_gpubench.config.cell import CellDefaults, CellSpec
    from pytest_gpubench.config.nodes import ProviderNode, SlurmNode, SshNode

    paths = {*_dotted_keys(CellSpec, ()), *_dotted_keys(CellDefaults, ())}
    for model, kind in ((SshNode, "ssh"), (ProviderNode, "provider"), (SlurmNode, "slurm")):
        paths.update(_dotted_keys(model, (kind,)))
    assert ("load", "dataset", "min_input_words") in paths and ("provider", "api") in paths
    blocks = [
        block
        for page in (REPO / "docs").glob("*.md")
        for block in re.split(r"\n\s*\n", page.read_text())
    ]

    def named(key: str, block: str) -> bool:
        return re.search(rf"(`{re.escape(key)}\b|\b{re.escape(key)}:)", block) is not None

    def documented(path: tuple[str, ...]) -> bool:
        if len(path) == 1:
            return any(named(path[0], block) for block in blocks)
        parent = re.compile(rf"\b{re.escape(path[-2])}\b")
        return any(named(path[-1], block) and parent.search(block) for block in blocks)

    assert sorted(".".join(path) for path in paths if not documented(path)) == []
