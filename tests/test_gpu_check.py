"""`benchmarks/gpu_check.sh --dry-run`: what a device session would run, checked without a GPU.

The dry run prints each step's command, parses the benchmarks' arguments with their own parsers,
collects the GPU tests and runs tests/test_lowering.py (so this file is separate from it).
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("tests", "system-32k", "system-128k", "kernels", "plan", "tuning", "serve")
MODULES = (
    "pytest",
    "jaxkv.benchmarks.system",
    "jaxkv.benchmarks.kernels",
    "jaxkv.benchmarks.plan",
    "jaxkv.benchmarks.kernel_tuning",
    "jaxkv.benchmarks.serve",
)
COMMANDS = len(STEPS) + 1  # `serve` runs two: prompts of 1024 and of 128 tokens


def _dry_run(*steps: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    # The script calls `python3`: this interpreter's, with the project installed.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--dry-run", *steps],
        cwd=ROOT,
        env=os.environ | {"PATH": path} | env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_dry_run_prints_every_step_and_passes_its_checks(tmp_path):
    result = _dry_run(OUT=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    would_run = [line for line in out.splitlines() if line.startswith("would run")]
    assert len(would_run) == COMMANDS
    for module in MODULES:
        assert any(f"python3 -m {module} " in line for line in would_run), module
    assert "--backend pallas" in out and f"--out {tmp_path}/plan" in out
    assert out.count("arguments accepted: jaxkv.benchmarks.") == COMMANDS - 1
    assert "--random-weights" in out
    assert "tests collected" in out
    assert "lowering every Pallas path for CUDA" in out and " passed" in out
    assert f"dry run passed: {' '.join(STEPS)}" in out
    assert not (tmp_path / "env.log").exists()  # nothing ran: no device environment logged


def test_dry_run_fails_on_a_bad_step_or_bad_arguments():
    result = _dry_run("tests", "bogus", timeout=60)
    assert result.returncode == 2 and "unknown step bogus" in result.stderr
    assert "would run" not in result.stdout  # names are checked before any step
    result = _dry_run("system-32k", timeout=120, LAYERS="four")
    assert result.returncode != 0
    assert "jaxkv.benchmarks.system refused its arguments" in result.stderr
    assert "argument --layers: invalid int value: 'four'" in result.stderr
    assert "lowering every Pallas path" not in result.stdout
