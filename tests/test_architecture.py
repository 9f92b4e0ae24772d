"""The import layers (docs/architecture.md): `lint-imports` keeps the contracts in pyproject.toml,
and every module of the project imports on its own, first, in a fresh interpreter."""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# One import package: models/, pallas_kernels/, train/ and benchmarks/ are its subpackages
# (jaxkv/models etc. link to them), walked through the links.
PACKAGE = "jaxkv"

# Imports each module named on stdin first among the project's modules: before each, every
# project module already imported is dropped from sys.modules (third-party ones stay cached, so
# the loop costs one jax import), so an import cycle or a missing import shows up as the
# ImportError of the module that starts it.
_IMPORT_EACH = """
import importlib, sys, traceback
packages = set(sys.argv[1:])
failed = []
for name in sys.stdin.read().split():
    for loaded in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name)
        print(f"--- import {name} failed:\\n{traceback.format_exc()}")
print("FAILED:", " ".join(failed))
sys.exit(1 if failed else 0)
"""


def _modules() -> list[str]:
    path = [str(ROOT / PACKAGE)]
    return [PACKAGE] + [m.name for m in pkgutil.walk_packages(path, prefix=f"{PACKAGE}.")]


def test_import_contracts_are_kept():
    command = shutil.which("lint-imports")
    fallback = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    args = [command] if command else [sys.executable, "-c", fallback]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_every_module_imports_alone():
    modules = _modules()
    # Walked through the links too: the subpackages' modules are listed.
    for name in ("attention.paged", "models.decoder", "pallas_kernels.paged_decode.ops"):
        assert f"jaxkv.{name}" in modules, name
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, PACKAGE],
        input="\n".join(modules),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]


def test_models_import_first_in_a_fresh_interpreter():
    # The cycle this layering removed: models -> jaxkv -> policies -> models (half initialised).
    # Importing a subpackage runs jaxkv's __init__ first, which imports the library above it.
    for name in ("jaxkv.models", "jaxkv.pallas_kernels", "jaxkv"):
        result = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"import {name}:\n{result.stderr[-4000:]}"
