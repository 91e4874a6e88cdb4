"""The README is a front page (at most 300 lines) and every relative link in it and in docs/*.md resolves:
the file exists, and a #fragment names a heading of that file (GitHub's anchor rule). Issue 27."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, markup and punctuation dropped (letters, digits, '_' and '-'
    stay), spaces to '-', repeats numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} +(.*?) *#*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target} (no heading #{fragment} in {dest.name})")
    return bad


def test_the_checker_sees_a_missing_file_and_a_missing_anchor(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A title: here\n\n## A title: here\n\n[ok](#a-title-here-1) [a](q.md) [b](#nowhere) "
                    "[c](https://example.org)\n\n```\n[not a link](nowhere.md)\n```\n")
    assert anchors(page) == {"a-title-here", "a-title-here-1"}
    assert broken(page) == ["q.md (no such file)", "#nowhere (no heading #nowhere in p.md)"]


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move depth into docs/"


def test_every_relative_link_resolves():
    bad = {p.relative_to(ROOT).as_posix(): broken(p) for p in PAGES}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, bad
