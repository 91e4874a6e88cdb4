"""The README is a front page and the docs are reference pages:

- the README holds at most 1,500 words and 40 decimal figures (counted as below), and its results table is
  exactly what `benchmarks/render_readme.py` renders from the result files under benchmarks/;
- every relative link in the README, CHANGELOG.md, benchmarks/README.md and docs/*.md resolves: the file
  exists, and a #fragment names a heading of that file (GitHub's anchor rule);
- no docs page is over 400 lines, no page says how the project was built (who reran what in which sitting,
  issue numbers), nothing refers to files outside the repository;
- every result folder is benchmarks/<suite>/<machine>-<YYYY-MM-DD>/.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md", *DOCS]
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


COMMENT = re.compile(r"<!--.*?-->", re.S)
# a decimal figure: digits, a point, digits (an exponent belongs to it; a version like 2.13.0 counts once);
# arXiv identifiers (arXiv:2305.14858) are citations, not figures
DECIMAL = re.compile(r"(?<![\w.:])\d+\.\d+(?:[eE][-+]?\d+)?")
# how a page would describe how the project was built rather than what it is
HISTORY = re.compile(r"lead's|\bs[0-9]+-[a-z]|issue [0-9]+", re.I)
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md")


def readme_budget(text: str) -> tuple[int, int]:
    """(words, decimal figures) of a page: whitespace-separated tokens and decimal numbers anywhere outside
    HTML comments, code blocks and tables included."""
    text = COMMENT.sub("", text)
    return len(text.split()), len(DECIMAL.findall(text))


def renderer():
    spec = importlib.util.spec_from_file_location("render_readme", ROOT / "benchmarks" / "render_readme.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_budget_counts_words_and_decimal_figures():
    assert readme_budget("a 1.5 b <!-- 9.9 --> `2.13.0` 3.4e-15 arXiv:2305.14858 12 x") == (8, 3)


def test_readme_is_a_front_page():
    words, figures = readme_budget((ROOT / "README.md").read_text())
    assert words <= 1500, f"README.md has {words} words; move depth into docs/"
    assert figures <= 40, f"README.md has {figures} decimal figures; one number per claim, the rest in docs/"


def test_readme_results_table_is_rendered_from_the_result_files():
    mod = renderer()
    text = (ROOT / "README.md").read_text()
    assert text == mod.replace(text, mod.render()), "run `python benchmarks/render_readme.py`"


def test_the_renderer_reads_one_key_of_one_file(tmp_path, monkeypatch):
    mod = renderer()
    bench = tmp_path / "benchmarks"
    run = bench / "demo" / "box-2026-01-02"
    run.mkdir(parents=True)
    (run / "r.csv").write_text("model,ratio,verdict\na,0.5,faster\nb,1.25,same\n")
    (run / "r.json").write_text('{"x": {"y": [3e-15]}}')
    (run / "r.machine.json").write_text('{"cpu": "CPU", "logical_cores": 4, "torch": "9"}')
    spec = tmp_path / "readme.toml"
    spec.write_text('[[row]]\nclaim = "b"\nfile = "demo/box-2026-01-02/r.csv"\nkey = "ratio"\nwhere = { model = "b" }\n'
                    'verdict = "verdict"\nformat = "{:.2f}"\ncommand = "run b"\n\n'
                    '[[row]]\nclaim = "e"\nfile = "demo/box-2026-01-02/r.json"\nkey = "x.y.0"\nformat = "{:.1e}"\n'
                    'command = "run e"\ndocs = "docs/e.md"\n')
    monkeypatch.setattr(mod, "BENCH", bench)
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    table = mod.render(spec)
    assert "| b | 1.25 (same) | [box, 2026-01-02](benchmarks/demo/box-2026-01-02/) | `run b` |" in table
    assert "| [e](docs/e.md) | 3.0e-15 |" in table and "`box`: 4-core CPU, torch 9" in table
    page = f"x\n{mod.START}\nold\n{mod.END}\ny\n"
    assert mod.replace(page, "new\n") == f"x\n{mod.START}\nnew\n{mod.END}\ny\n"


def test_no_page_describes_how_the_project_was_built():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in PAGES
            for i, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, hits


def test_docs_pages_are_at_most_400_lines():
    long = {p.name: n for p in DOCS if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these pages by topic: {long}"


def test_nothing_refers_to_files_outside_the_repository():
    files = [*PAGES, *(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.c"), *(ROOT / "src").rglob("*.h"),
             *(p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_docs.py"),
             *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, hits


def test_result_folders_are_named_by_suite_machine_and_date():
    bench = ROOT / "benchmarks"
    bad = [p.relative_to(ROOT).as_posix() for p in bench.iterdir() if p.is_dir() and p.name != "scripts"
           for run in [*p.iterdir()] if not (run.is_dir() and renderer().FOLDER.match(run.name))]
    loose = [p.name for p in bench.iterdir() if p.is_file()
             and p.name not in {"README.md", "readme.toml", "render_readme.py"}]
    assert not bad and not loose, (bad, loose)


def test_every_relative_link_resolves():
    bad = {p.relative_to(ROOT).as_posix(): broken(p) for p in PAGES}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, bad
