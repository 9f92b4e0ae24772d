"""The names the README and docs/ point at exist: a reader who follows `jaxkv/cache/writes.py`,
`policies/kvzip.py::replay_attention` or `cache.eviction.evict_in_place` finds it.

A backticked span is checked when it is a path under one of the repository's folders or the
library's subpackages (with an optional `::name` defined in that file), or a dotted name rooted
at `jaxkv` or one of its modules; anything else in backticks (commands, flags, values, results
files named relative to a folder the prose gave) is left alone."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "jaxkv"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Top-level folders, and the library's subpackages and modules, that a reference may start at.
FOLDERS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
MODULES = {p.stem for p in LIBRARY.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
MODULES.discard("__init__")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "csv", "png", "toml", "sh", "npy", "gguf", "ipynb"}
PATH = re.compile(r"(?P<path>[\w.-]+(?:/[\w.-]+)+\.(?P<suffix>\w+))(?:::(?P<name>\w+))?")
DOTTED = re.compile(r"(?:jaxkv\.)?(?P<first>\w+)(?:\.\w+)+")


def spans(page: Path):
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for span in re.findall(r"`([^`]+)`", line):
            yield f"{page.relative_to(ROOT)}:{number}", span.strip()


def path_problem(span: str) -> str | None:
    """Why a path reference does not resolve (None: it does, or it is not one to check)."""
    match = PATH.fullmatch(span)
    if match is None or match["suffix"] not in FILE_SUFFIXES:
        return None
    path = match["path"]
    first = path.split("/")[0]
    if first in FOLDERS:
        target = ROOT / path
    elif first in MODULES:
        target = LIBRARY / path
    else:
        return None
    if not target.exists():
        return f"no file {target.relative_to(ROOT)}"
    name = match["name"]
    defined = rf"^\s*(?:async def|def|class)\s+{name}\b|^{name}\s*[:=]"
    if name and not re.search(defined, target.read_text(), flags=re.M):
        return f"{path} defines no {name}"
    return None


def dotted_problem(span: str) -> str | None:
    """Why a dotted name does not resolve to a module attribute (None: it does, or it is not
    one to check)."""
    match = DOTTED.fullmatch(span)
    if match is None or match["first"] not in MODULES | {"jaxkv"}:
        return None
    if span.rsplit(".", 1)[-1] in FILE_SUFFIXES:
        return None
    parts = (span if span.startswith("jaxkv.") else f"jaxkv.{span}").split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            if not hasattr(found, attribute):
                return f"{'.'.join(parts[:split])} has no {'.'.join(parts[split:])}"
            found = getattr(found, attribute)
        return None
    return "no such module"


def test_the_reference_checks_catch_what_they_are_for():
    assert path_problem("jaxkv/cache/writes.py") is None
    assert path_problem("policies/kvzip.py::replay_attention") is None
    assert path_problem("policies/kvzip.py::_replay_attention") is not None
    assert path_problem("benchmarks/continuation.py") is not None
    assert path_problem("OUT/run.json") is None  # a results file named relative to the prose
    assert dotted_problem("cache.eviction.evict_in_place") is None
    assert dotted_problem("jaxkv.step.decode.decode_step") is None
    assert dotted_problem("policies.base.after_decode_step") is not None
    assert dotted_problem("serve.png") is None and dotted_problem("--max-new-tokens") is None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_path_and_dotted_name_a_page_names_exists(page):
    problems = [
        f"{where}: `{span}`: {problem}"
        for where, span in spans(page)
        if (problem := path_problem(span) or dotted_problem(span)) is not None
    ]
    assert not problems, "\n".join(problems)
