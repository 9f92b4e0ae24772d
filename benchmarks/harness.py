"""What every benchmark shares: the provenance block its results open with, and how they are saved.

A benchmark measures; this module records how (`provenance`: the command, date, jax version,
source commit and machine) and writes the JSON and markdown next to each other (`save`), so
every number in the README and `docs/` traces back to a command and a file.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import jax


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
