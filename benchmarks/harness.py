"""What every benchmark shares: the provenance block its results open with, how they are saved,
and how a row runs in a process of its own.

A benchmark measures; this module records how (`provenance`: the command, date, jax version,
source commit and machine), writes the JSON and markdown next to each other (`save`), so every
number in the README and `docs/` traces back to a command and a file, and runs rows that need a
fresh process (their own memory peak, device count or XLA flags) through `run_child` and
`print_row`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax

import jaxkv

# The line a child process prints its result on: this marker, then the result as JSON.
ROW_MARKER = "JAXKV_ROW_JSON "
# Where children run: the directory that holds the jaxkv package (a checkout or site-packages).
CHILD_CWD = Path(jaxkv.__file__).resolve().parents[1]


def source_commit() -> str | None:
    """The git commit of the checkout this runs from (None outside one)."""
    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return found.stdout.strip()


def machine() -> dict:
    """The first device, the host and its load when the run starts."""
    device = jax.devices()[0]
    return {
        "device": f"{device.platform}: {device.device_kind}",
        "num_devices": jax.device_count(),
        "host": f"{platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_at_start": os.getloadavg(),
    }


def provenance(command: str, argv: Sequence[str]) -> dict:
    """The block a results file opens with: `command` (e.g. "jaxkv bench plan") with its
    arguments, the date, jax's version, the source commit and the machine."""
    return {
        "command": " ".join([command, *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "jax": jax.__version__,
        "commit": source_commit(),
        "machine": machine(),
    }


def save(
    out: Path, stem: str, report: dict, markdown: str | None = None, indent: int | None = 2
) -> None:
    """Writes `out/stem.json` (and `out/stem.md` with `markdown`), creating `out`; `indent`
    None keeps long per-step traces on one line."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=indent, default=str) + "\n")
    if markdown is not None:
        (out / f"{stem}.md").write_text(markdown)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (the `bench` extra; a named error
    without it)."""
    try:
        import matplotlib
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "the benchmarks' plots need matplotlib: pip install 'jaxkv[bench]'"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def print_row(result: dict) -> None:
    """A child's result, on the marked line `run_child` reads."""
    print(ROW_MARKER + json.dumps(result, default=str), flush=True)


@dataclasses.dataclass(frozen=True)
class ChildRun:
    """A finished child process: its marked result (None if it printed none), exit status
    (negative: killed by that signal) and last lines of output."""

    result: dict | None
    returncode: int
    tail: str


def run_child(module: str, argv: Sequence[str], env: dict | None = None) -> ChildRun:
    """Runs `python -m module *argv` in a fresh process and reads its last `print_row` line."""
    done = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=CHILD_CWD,
        env=env,
        capture_output=True,
        text=True,
    )
    result = None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(ROW_MARKER):
            result = json.loads(line[len(ROW_MARKER) :])
            break
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
    return ChildRun(result=result, returncode=done.returncode, tail=tail)
