"""Each benchmark is the measurement itself: a module of benchmarks/ with a `main` is imported by
no other module there. Benchmarks share the harness (`harness.py`) and the measurement modules
(byte_tasks, needles, teacher_forced, ...), which have no `main`; `lint-imports` keeps the same
rule, indirect imports included, through the independence contract that lists every benchmark."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "jaxkv.benchmarks"


def _trees() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text()) for path in (ROOT / "benchmarks").glob("*.py")}


def _benchmarks(trees: dict[str, ast.Module]) -> set[str]:
    """The modules that define a top-level `main`."""
    return {
        name
        for name, tree in trees.items()
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)
    }


def _imported(tree: ast.Module) -> set[str]:
    """The modules of jaxkv.benchmarks a module imports, at any depth of its code."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(PACKAGE + ".")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:
                found |= {f"{PACKAGE}.{a.name}" for a in node.names}
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module)
    return {name.split(".")[2] for name in found}


def test_no_benchmark_imports_another():
    trees = _trees()
    benchmarks = _benchmarks(trees)
    assert {"quality", "real_quality", "confkv", "kernels", "system"} <= benchmarks
    assert not {"harness", "byte_tasks", "needles", "teacher_forced"} & benchmarks
    offending = {
        name: sorted(_imported(tree) & (benchmarks - {name})) for name, tree in trees.items()
    }
    assert {name: found for name, found in offending.items() if found} == {}


def test_the_import_contract_lists_every_benchmark():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (independent,) = [c for c in contracts["contracts"] if c["type"] == "independence"]
    listed = {name.removeprefix(PACKAGE + ".") for name in independent["modules"]}
    assert listed == _benchmarks(_trees())


def test_every_benchmark_is_a_jaxkv_bench_command_that_writes_provenance():
    """`jaxkv bench NAME` reaches each benchmark (the entry points name its `main`), and each
    one that writes a results file opens it with `harness.provenance`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    registered = project["entry-points"]["jaxkv.bench"]
    benchmarks = _benchmarks(_trees())
    assert registered == {name: f"{PACKAGE}.{name}:main" for name in sorted(benchmarks)}
    writers = {
        name
        for name in benchmarks
        if "harness.save" in (text := (ROOT / "benchmarks" / f"{name}.py").read_text())
        or "write_text" in text
    }
    assert {"real_quality", "serve", "sharding", "wgkv_pareto"} <= writers
    without = sorted(
        name
        for name in writers
        if "harness.provenance(" not in (ROOT / "benchmarks" / f"{name}.py").read_text()
    )
    assert without == []
