"""Every committed results file says how it was made: the command with its arguments, the source
commit it ran at and the machine (`jaxkv.provenance`, issue 72). The files written before the
benchmarks recorded their commit were rerun or retired (docs/results.md, "Rerun and retired
results"): none is let off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
PROVENANCE_KEYS = ("command", "commit", "machine")


def provenance_of(report) -> dict:
    """The provenance block of a results file: its `provenance` entry, or its top level (the
    older benchmarks write the keys beside their rows)."""
    if not isinstance(report, dict):
        return {}
    block = report.get("provenance", report)
    return block if isinstance(block, dict) else {}


def missing_provenance(path: Path) -> list[str]:
    """The provenance keys `path`'s JSON lacks (or leaves empty)."""
    block = provenance_of(json.loads(path.read_text()))
    return [key for key in PROVENANCE_KEYS if not block.get(key)]


def _results_files() -> list[str]:
    return sorted(str(path.relative_to(ROOT)) for path in RESULTS.rglob("*.json"))


def test_missing_provenance_names_the_keys_a_file_lacks(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"command": "jaxkv bench x", "commit": "", "rows": []}))
    assert missing_provenance(path) == ["commit", "machine"]
    path.write_text(json.dumps({"provenance": {"command": "c", "commit": "abc", "machine": {}}}))
    assert missing_provenance(path) == ["machine"]
    path.write_text(json.dumps([1, 2]))
    assert missing_provenance(path) == list(PROVENANCE_KEYS)


@pytest.mark.parametrize("name", _results_files())
def test_a_results_file_records_its_command_commit_and_machine(name):
    missing = missing_provenance(ROOT / name)
    assert not missing, (
        f"{name} lacks {missing}: write it with `jaxkv.provenance.provenance` (rerun the "
        "command that made it) or retire it"
    )
