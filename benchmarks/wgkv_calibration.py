"""WG-KV's thresholds matched to kvpress's compression ratios, for the RULER suites.

WG-KV has a threshold, not a budget: its tau for each ratio is calibrated on one sample's
context (its kept share of the full cache's bytes measured at a grid of taus, then bisected in
log tau until within 0.02 of 1 - ratio). Where its share jumps past 1 - ratio (heads whose
gates are one value switch at once), the tau past the jump: never more bytes than the ratio
allows; a ratio that gets a larger ratio's tau is run at the larger one only
(`superseded_ratios`). Each `--policies` entry has its own file in the run's directory
(`calibration_path`), every measurement saved as it comes and reused by a rerun on the same
sample (the run's directory holds one model, length and seed: `jaxkv bench ruler` checks).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from tqdm import tqdm

import jaxkv
from jaxkv import policies
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.ruler_tasks import Sample

TAUS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 0.6, 0.9)
KEPT_TOLERANCE = 0.02  # of the full cache's bytes, for a calibrated tau
BISECTION_STEPS = 12
TAU_RESOLUTION = 1e-3  # in log tau: a bracket this narrow is a jump in the kept share


def calibration_path(out: Path, entry: str) -> Path:
    """OUT/wgkv-calibration.json for the entry `wgkv`; OUT/wgkv-calibration-OPTIONS.json for an
    entry with options (`wgkv:window=64` -> `wgkv-calibration-window-64.json`)."""
    options = entry.partition(":")[2]
    suffix = "-" + re.sub(r"[^A-Za-z0-9.]+", "-", options) if options else ""
    return out / f"wgkv-calibration{suffix}.json"


def saved_taus(path: Path, ratios) -> dict[float, float]:
    """{ratio: tau} of a calibration file, for each of `ratios`; SystemExit when the file or a
    ratio's tau is missing."""
    if not path.exists():
        raise SystemExit(f"wgkv: its taus come from {path}; run `jaxkv bench ruler` with it first")
    per_ratio = {float(r): tau for r, tau in json.loads(path.read_text())["tau_per_ratio"].items()}
    missing = [r for r in ratios if float(r) not in per_ratio]
    if missing:
        raise SystemExit(
            f"--ratios {missing}: {path} calibrates wgkv at {sorted(per_ratio)} only; run "
            "`jaxkv bench ruler` at those ratios first"
        )
    return per_ratio


def tau_for_kept_share(measure, measured: dict, target: float) -> float:
    """The tau whose kept share `measure(tau)` is within KEPT_TOLERANCE of `target`: bisection
    in log tau between the two measured taus that bracket `target` (the kept share falls as
    tau rises; a learned gate's taus crowd into a decade, so a grid alone misses). Where the
    share jumps past `target` (whole heads whose gates are one value switch at once), the tau
    past the jump: the largest share below `target`, never more bytes than the ratio allows.
    `measured` ({tau: kept share}) gains every new measurement. ValueError when every share
    measured is above `target`."""
    for _ in range(BISECTION_STEPS):
        nearest = min(measured, key=lambda tau: abs(measured[tau] - target))
        if abs(measured[nearest] - target) <= KEPT_TOLERANCE:
            return nearest
        keeps_more = [tau for tau, kept in measured.items() if kept > target]
        keeps_less = [tau for tau, kept in measured.items() if kept < target]
        if not keeps_more or not keeps_less:
            break
        low, high = max(keeps_more), min(keeps_less)
        if np.log(high / low) < TAU_RESOLUTION:
            break
        tau = float(np.exp((np.log(low) + np.log(high)) / 2))
        measured[tau] = measure(tau)
    below = [tau for tau, kept in measured.items() if kept <= target]
    if not below:
        raise ValueError(
            f"WG-KV calibration: every tau measured keeps more than {target:.3f} of the full "
            f"cache (the least: {min(measured.values()):.3f}): give a larger tau grid"
        )
    return max(below, key=lambda tau: (measured[tau], -tau))


def taus_for_ratios(measure, measured: dict, ratios) -> dict:
    """{ratio: tau} by `tau_for_kept_share` at each ratio's kept share (1 - ratio), chosen
    from every measurement (a second pass measures nothing: a later ratio's bisection may
    land nearer an earlier one's jump)."""
    for ratio in ratios:
        tau_for_kept_share(measure, measured, 1.0 - ratio)
    return {float(r): tau_for_kept_share(measure, measured, 1.0 - r) for r in ratios}


def superseded_ratios(taus: dict) -> dict:
    """{ratio: the larger ratio with the same tau} for calibrated `taus` ({ratio: tau}): a
    ratio whose share the gates cannot hold keeps what the larger one keeps, so its records
    would be the larger one's (run once, at the larger ratio)."""
    return {
        ratio: max(r for r, t in taus.items() if t == tau)
        for ratio, tau in taus.items()
        if any(r > ratio and t == tau for r, t in taus.items())
    }


def calibrate(
    model, params, sample: Sample, ratios, out: Path, entry: str, options: dict, provenance
) -> dict:
    """{ratio: tau} for `--policies` entry `entry` (WG-KV with `options`) on `sample`'s
    context (`taus_for_ratios` from TAUS); every measurement saved to its
    `calibration_path` as it comes (opening with the run's `provenance`) and reused from it
    when it measured the same sample."""
    path = calibration_path(out, entry)
    record = json.loads(path.read_text()) if path.exists() else {}
    same = (record.get("sample"), record.get("entry")) == ([sample.task, sample.index], entry)
    measured = dict(zip(record["taus"], record["kept"], strict=True)) if same else {}
    context = [list(sample.context_ids)]
    full_bytes = []

    def save(taus: dict) -> None:
        order = sorted(measured)
        harness.save(
            out,
            path.stem,
            {
                "provenance": provenance,
                "entry": entry,
                "sample": [sample.task, sample.index],
                "taus": order,
                "kept": [measured[tau] for tau in order],
                "tau_per_ratio": {str(r): tau for r, tau in taus.items()},
                "kept_per_ratio": {str(r): measured[tau] for r, tau in taus.items()},
            },
        )

    def measure(tau: float) -> float:
        if not full_bytes:
            full_bytes.append(float(jaxkv.prefill(model, context, "full").memory_bytes()))
        policy = policies.get("wgkv", tau=tau, **options)
        session = jaxkv.prefill(model, context, policy, policy_params=params)
        measured[tau] = float(session.memory_bytes()) / full_bytes[0]
        save({})
        return measured[tau]

    for tau in tqdm([t for t in TAUS if t not in measured], desc="wgkv grid", unit="tau"):
        measure(tau)
    taus = taus_for_ratios(measure, measured, ratios)
    save(taus)
    return taus
