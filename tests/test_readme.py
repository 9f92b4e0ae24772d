"""The README's quick start runs as written: its one Python block, executed verbatim, prints the
needle it retrieves over a context compressed to about 30% of the full cache's bytes."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start_block() -> str:
    section = README.read_text().split("## Quick start\n")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the quick start holds one Python block"
    return blocks[0]


def test_the_quick_start_runs_as_written_and_prints_what_it_says():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(quick_start_block(), str(README), "exec"), {})
    answer, share = printed.getvalue().splitlines()
    assert answer.startswith("4821937")
    # The comments in the block say what it prints.
    assert "# 4821937." in quick_start_block() and "# ~0.3" in quick_start_block()
    assert 0.25 <= float(share) <= 0.35
