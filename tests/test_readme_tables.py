"""The result tables of the README and of docs/results.md are copies of committed results files,
not hand-edited numbers.

The measurements live in docs/results.md; the README quotes one summary table and links there. A
table of either whose header line is a table header of a markdown file under results/ or docs/
(docs/results.md itself aside) must have every row in one such file (a subset of the rows may be
quoted).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_PAGE = ROOT / "docs" / "results.md"
README_MAX_LINES = 300  # issue 59: the README is for users; measurements go to docs/results.md


def markdown_tables(text: str) -> list[list[str]]:
    """The tables of a markdown text: each a list of its lines (header, rule, rows)."""
    tables, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def test_markdown_tables_are_the_blocks_of_table_lines():
    text = "intro\n| a | b |\n| --- | --- |\n| 1 | 2 |\n\n| c |\n| --- |\nend\n"
    first, second = ["| a | b |", "| --- | --- |", "| 1 | 2 |"], ["| c |", "| --- |"]
    assert markdown_tables(text) == [first, second]


def _sources() -> dict[Path, set[str]]:
    """The lines of every markdown file a quoted table may come from: results/ and docs/, but not
    the page that quotes them (a table would otherwise be its own source)."""
    return {
        path: set(path.read_text().splitlines())
        for folder in ("results", "docs")
        for path in (ROOT / folder).rglob("*.md")
        if path != RESULTS_PAGE
    }


def _quoted_tables(page: Path) -> int:
    """Checks each table of `page` that quotes a results file; returns how many do."""
    sources = _sources()
    quoted = 0
    for table in markdown_tables(page.read_text()):
        header, rows = table[0], table[2:]
        owners = [path for path, lines in sources.items() if header in lines]
        if not owners:
            continue  # a table of the page's own (commands, policies, paths)
        quoted += 1
        assert any(all(row in sources[path] for row in rows) for path in owners), (
            f"{page.name} table {header!r} has rows in none of {[str(p) for p in owners]}: "
            f"{[row for row in rows if not any(row in sources[p] for p in owners)]}"
        )
    return quoted


def test_results_page_tables_are_rows_of_a_results_file():
    # the quality, budget, 4K, kvpress and reference-model tables (and the kernels' and the
    # 48- and 96-episode paired ones)
    assert _quoted_tables(RESULTS_PAGE) >= 5


def test_readme_result_tables_are_rows_of_a_results_file():
    assert _quoted_tables(ROOT / "README.md") >= 1  # the summary table


def test_readme_is_short_and_links_the_results_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "(docs/results.md)" in text


def _results_page_anchors() -> set[str]:
    """The anchors of docs/results.md's sections, as GitHub writes them."""
    return {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in RESULTS_PAGE.read_text().splitlines()
        if line.startswith(("## ", "### "))
    }


def test_readme_links_sections_of_the_results_page():
    links = re.findall(r"\(docs/results\.md#([^)]+)\)", (ROOT / "README.md").read_text())
    assert links
    assert set(links) <= _results_page_anchors()


def test_results_page_index_names_files_that_exist():
    """The index at the top of docs/results.md names results files and folders that exist, and
    links sections that exist."""
    index = markdown_tables(RESULTS_PAGE.read_text())[0]
    assert index[0] == "| section | results files |"
    anchors = _results_page_anchors()
    for row in index[2:]:
        section, files = row.split(" | ", 1)
        (anchor,) = re.findall(r"\(#([^)]+)\)", section)
        assert anchor in anchors, anchor
        for name in re.findall(r"`(results/[^`]+)`", files):
            assert (ROOT / name).exists(), name
