"""The README's result tables are copies of committed results files, not hand-edited numbers.

A README table whose header line is a table header of a markdown file under results/ or docs/
must have every row in one such file (the README may quote a subset of the rows).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def test_readme_result_tables_are_rows_of_a_results_file():
    sources = {
        path: set(path.read_text().splitlines())
        for folder in ("results", "docs")
        for path in (ROOT / folder).rglob("*.md")
    }
    quoted = 0
    for table in markdown_tables((ROOT / "README.md").read_text()):
        header, rows = table[0], table[2:]
        owners = [path for path, lines in sources.items() if header in lines]
        if not owners:
            continue  # a table of the README's own (commands, policies, paths)
        quoted += 1
        assert any(all(row in sources[path] for row in rows) for path in owners), (
            f"README table {header!r} has rows in none of {[str(p) for p in owners]}: "
            f"{[row for row in rows if not any(row in sources[p] for p in owners)]}"
        )
    assert quoted >= 5  # the quality, budget, 4K, kvpress and reference-model tables
