"""How a results file or a trained artefact was made: the command with its arguments, the date,
jax's version, the source commit and the machine (`provenance`). The benchmarks open their
results with it (`jaxkv.benchmarks.harness`), the trainers their records
(`training.json`, `run.json`), so `tests/test_results_provenance.py` can refuse a file without
them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax


def source_commit() -> str | None:
    """`JAXKV_SOURCE_COMMIT` where the sender of a copied tree set it (a GPU machine's copy can
    hold a stale .git), else the git commit of the checkout this runs from, else None."""
    if os.environ.get("JAXKV_SOURCE_COMMIT"):
        return os.environ["JAXKV_SOURCE_COMMIT"]
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
        "load_average_at_start": list(os.getloadavg()),
    }


def provenance(command: str, argv: Sequence[str] | None) -> dict:
    """The block a record opens with: `command` (e.g. "jaxkv bench plan") with its arguments
    (`argv`; None: this process's), the date, jax's version, the source commit and the
    machine."""
    return {
        "command": " ".join([command, *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "jax": jax.__version__,
        "commit": source_commit(),
        "machine": machine(),
    }
