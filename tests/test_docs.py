"""The reference site (mkdocs.yml, docs/): `make docs` builds it with `mkdocs build --strict` as
`make test` does, so a broken link or anchor, or a page left out of the nav, fails the build."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
