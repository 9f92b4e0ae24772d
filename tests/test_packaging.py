"""jaxkv installs anywhere (issue 17): one import package, its bundled files included.

The repository keeps models/, pallas_kernels/, train/, benchmarks/ and assets/ at the top; the
links in jaxkv/ give the checkout the installed layout, and the wheel built from it must run
`jaxkv generate` on the bundled reference model in a clean environment, from a directory whose
own models.py and train.py would shadow generic top-level packages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from jaxkv import bundled

ROOT = Path(__file__).resolve().parents[1]
LINKED = ("pallas_kernels", "models", "train", "benchmarks", "assets")
# The answer the reference model retrieves from the CLI's default prompt.
ANSWER = "4821937"


def test_the_checkout_has_the_installed_layout():
    for name in LINKED:
        link = ROOT / "jaxkv" / name
        assert link.is_symlink(), f"jaxkv/{name} should link to the top-level {name}/"
        assert os.readlink(link) == os.path.join("..", name)
        assert link.resolve() == (ROOT / name).resolve()


def test_bundled_paths_name_the_shipped_files():
    assert (bundled.REFERENCE_MODEL / "config.json").is_file()
    assert (bundled.REFERENCE_MODEL / "tokenizer.json").is_file()
    assert (bundled.WGKV_GATES / "lambda-0.08" / "gates.safetensors").is_file()
    assert (bundled.FASTKVZIP_GATES / "gates.safetensors").is_file()


def _run(command: list, cwd: Path, env: dict | None = None) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def _source_copy(destination: Path) -> Path:
    """The sources a wheel is built from, copied (links kept) so the build writes nothing here:
    pyproject.toml, README.md, jaxkv/ and the top-level directories its links point to."""
    destination.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, destination / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "jaxkv", destination / "jaxkv", symlinks=True, ignore=ignore)
    for link in (ROOT / "jaxkv").iterdir():
        if link.is_symlink():
            target = link.resolve()
            shutil.copytree(target, destination / target.name, symlinks=True, ignore=ignore)
    return destination


def _build_wheel(tmp_path: Path) -> Path:
    source = _source_copy(tmp_path / "source")
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = ["wheel", "--no-deps", "--no-index", "--no-build-isolation", "-w", dist, source]
    _run([*pip, *build], tmp_path)
    (wheel,) = dist.glob("jaxkv-*.whl")
    return wheel


def _site_packages() -> list[str]:
    """This interpreter's package directories (a venv's own, or the system's)."""
    return [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]


# Run in the clean environment, from the user's directory: generate through the CLI, load every
# registered `jaxkv train` / `jaxkv bench` command, and report any jaxkv module loaded from
# outside the environment (an editable install of the checkout would show up here).
_GENERATE_AND_LOAD = """
import sys
from importlib.metadata import entry_points

import jaxkv
from jaxkv import cli

assert cli.main(["generate", "--max-new-tokens", "8"]) == 0
for group in (cli.TRAIN_GROUP, cli.BENCH_GROUP):
    commands = entry_points(group=group)
    assert commands, group
    for command in commands:
        command.load()
prefix = sys.argv[1]
outside = sorted(
    name
    for name, module in list(sys.modules.items())
    if name.split(".")[0] == "jaxkv"
    and not (getattr(module, "__file__", None) or "").startswith(prefix)
)
assert not outside, f"loaded from outside {prefix}: {outside}"
print("jaxkv from", jaxkv.__file__)
"""


@pytest.mark.slow
def test_wheel_installs_and_generates_in_a_clean_environment(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == {"jaxkv"}  # no generic top-level package such as models or train
    assert "jaxkv/models/decoder.py" in names and "jaxkv/train/wgkv.py" in names
    assert "jaxkv/assets/reference-model/model.safetensors" in names

    # The running environment's packages (jax, ...) stay visible through a .pth file naming its
    # site-packages, whether that environment is the system Python or a virtual environment
    # (`venv --system-site-packages` would reach the base interpreter's, which a user who
    # installed into a venv left empty). Directories named in a .pth file do not run their own
    # .pth files, so an editable install of the checkout there stays invisible: jaxkv comes from
    # the wheel alone.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    clean_site_packages = Path(_run([python, "-c", purelib], tmp_path).strip())
    (clean_site_packages / "running-environment.pth").write_text(
        "\n".join(sorted(set(_site_packages()))) + "\n"
    )
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "--no-deps", "--no-index", "--ignore-installed", wheel], tmp_path)

    user = tmp_path / "user"
    user.mkdir()
    for name in ("models.py", "train.py", "benchmarks.py"):
        (user / name).write_text(f'raise ImportError("the user\'s own {name} was imported")\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    site_packages = _run([python, "-c", purelib], user, env).strip()
    out = _run([python, "-c", _GENERATE_AND_LOAD, site_packages], user, env)
    assert ANSWER in out and f"jaxkv from {site_packages}" in out
    # The console script, as a user runs it; the bundled model's path lies inside the environment.
    out = _run([venv / "bin" / "jaxkv", "generate", "--max-new-tokens", "8"], user, env)
    assert ANSWER in out and str(venv.resolve()) in out
