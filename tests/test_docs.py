"""The README stays a front page a newcomer reads in a minute, and every page it points to exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_readme_stays_under_8_kib():
    size = (REPO / "README.md").stat().st_size
    assert size <= 8 * 1024, f"README.md is {size} bytes: move detail to docs/ and link it"


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in _pages():
        for target, _ in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).resolve().exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, f"links to nothing: {broken}"


def test_every_guide_is_reachable_from_the_readme():
    linked = {(REPO / t).resolve() for t, _ in LINK.findall((REPO / "README.md").read_text())}
    orphans = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not orphans, f"docs/ pages the README does not link: {orphans}"
