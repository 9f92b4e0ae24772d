"""The import layers (docs/architecture.md): `lint-imports` keeps the contracts in pyproject.toml,
every module of the project imports on its own, first, in a fresh interpreter, and a decode
step runs the engine's room and what lies below it."""

from __future__ import annotations

import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import policies
from jaxkv.models import init_model
from jaxkv.step import parts
from jaxkv.step.decode import StepContext, decode_step
from tests.decode_steps import policy_rows
from tests.tiny_models import tiny_config

ROOT = Path(__file__).resolve().parents[1]
# One import package: models/, pallas_kernels/, train/ and benchmarks/ are its subpackages
# (jaxkv/models etc. link to them), walked through the links.
PACKAGE = "jaxkv"

# Imports each module named on stdin first among the project's modules: before each, every
# project module already imported is dropped from sys.modules (third-party ones stay cached, so
# the loop costs one jax import), so an import cycle or a missing import shows up as the
# ImportError of the module that starts it. Importing a module runs its package's __init__
# first, so a module that __init__ imports, imported alone, is the package's own import: the
# package is named first, and those modules are not imported again.
_IMPORT_EACH = """
import importlib, sys, traceback
packages = set(sys.argv[1:])
failed = []
with_the_package = set()
for name in sys.stdin.read().split():
    if name in with_the_package:
        continue
    for loaded in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name)
        print(f"--- import {name} failed:\\n{traceback.format_exc()}")
    if name in packages:
        with_the_package |= {m for m in sys.modules if m.split(".")[0] in packages}
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


# --- What one decode step runs: the modules whose Python code executes while it is traced ----

# docs/architecture.md states these counts ("The life of one decode step").
STEP_COUNTS = re.compile(
    r"full cache runs code in (\d+) modules of (\d+) packages; H2O in (\d+) of (\d+)\..*"
    r"WG-KV and Fast KVzip .*?: (\d+) and (\d+) modules of (\d+)\."
)


def _modules_a_decode_step_runs(policy) -> set[str]:
    """The jaxkv modules with a function called while `decode_step` of `policy` is traced over
    the state `generate` leaves (a tiny model, one sequence)."""
    model = init_model(tiny_config(), 0)
    params = None
    if policy.params is not None:
        params = policy.params.init(model.config, jax.random.PRNGKey(0))
    lengths = np.array([40])
    out = jaxkv.generate(
        model, [list(range(1, 41))], max_new_tokens=2, policy=policy, policy_params=params
    )
    ctx = StepContext(
        rows=policy_rows(policy, lengths, steps=[1]), policy_params=params, policy=policy.static()
    )
    ran: set[str] = set()

    def profile(frame, event, arg):
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith(f"{PACKAGE}."):
            ran.add(name)

    step = jax.jit(lambda kv, tokens, active: decode_step(model, kv, tokens, active, ctx))
    sys.setprofile(profile)
    try:
        step.trace(out.state, jnp.array([1]), jnp.array([True]))
    finally:
        sys.setprofile(None)
    return ran


def test_a_decode_step_runs_in_the_engine_room_and_below_it():
    """The engine logic of a decode step is `jaxkv.step`'s four modules; the rest is attention,
    storage, the model's blocks, the policy's own parts (and `compile_log`, jax's logging hook):
    nothing of generation, the serving engine, benchmarks or training. The counts are the ones
    docs/architecture.md states."""
    measured = {}
    for policy in (
        policies.FullCache(),
        policies.H2O(budget=32),
        policies.WGKV(tau=0.3, window=8),
        policies.FastKVzip(ratio=0.5),
    ):
        ran = _modules_a_decode_step_runs(policy)
        packages = {module.rsplit(".", 1)[0] for module in ran}
        assert {m for m in ran if m.startswith("jaxkv.step.")} == {
            f"jaxkv.step.{m}" for m in ("rows", "parts", "layer", "forward", "decode")
        }
        gates = {"jaxkv.gates"} if policy.params is not None else set()
        # A policy's code runs only through its parts: none for the full cache.
        own = {"jaxkv.policies"} if parts.present(policy) else set()
        assert packages == {
            "jaxkv",
            "jaxkv.step",
            "jaxkv.attention",
            "jaxkv.cache",
            "jaxkv.models",
            *own,
            *gates,
        }, packages
        measured[policy.name] = (len(ran), len(packages))
    (full, full_packages), (h2o, h2o_packages) = measured["full"], measured["h2o"]
    (wgkv, gated_packages), (fastkvzip, _) = measured["wgkv"], measured["fastkvzip"]
    assert measured["fastkvzip"][1] == gated_packages
    counts = [full, full_packages, h2o, h2o_packages, wgkv, fastkvzip, gated_packages]
    stated = STEP_COUNTS.search(" ".join((ROOT / "docs" / "architecture.md").read_text().split()))
    assert stated is not None and [int(n) for n in stated.groups()] == counts


def test_the_layers_list_names_every_module_of_the_library():
    """docs/architecture.md's layers name each module of the library's packages (the mapped
    top-level folders, models, kernels, training and benchmarks, have their own pages)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    mapped = ("models", "pallas_kernels", "train", "benchmarks")
    unnamed = [
        module.name
        for module in pkgutil.walk_packages(jaxkv.__path__, f"{PACKAGE}.")
        if module.name.split(".")[1] not in mapped
        and not module.name.rsplit(".", 1)[1].startswith("_")
        and not re.search(rf"\b{module.name.rsplit('.', 1)[1]}\b", text)
    ]
    assert unnamed == []
