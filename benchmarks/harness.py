"""What every benchmark shares: the provenance block its results open with, how they are saved, how
a row runs in a process of its own, and the probes and statistics several of them use.

A benchmark measures; this module records how (`provenance`, `jaxkv.provenance`'s, which the
trainers share: the command, date, jax version, source commit and machine), writes the JSON and
markdown next to each other (`save`), so every number in the README and `docs/` traces back to a
command and a file, and runs rows that need a fresh process (their own memory peak, device count
or XLA flags) through `run_child` and `print_row`. Shared by several benchmarks: their options'
help (`HelpFormatter`, `MODEL_HELP`), the timing and bandwidth probe (`seconds_per_call`,
`copy_bandwidth`), a sweep cell's policy (`build_policy`), a learned policy's parameters
(`learned_params`), the Wilson interval of a share of correct answers (`wilson_interval`) and
the interval of one policy's correct answers over another's on the same episodes
(`paired_ratio_interval`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import policies
from jaxkv.model_sources import shipped_name
from jaxkv.policies import spec
from jaxkv.provenance import provenance as provenance

# The line a child process prints its result on: this marker, then the result as JSON.
ROW_MARKER = "JAXKV_ROW_JSON "
# Where children run: the directory that holds the jaxkv package (a checkout or site-packages).
CHILD_CWD = Path(jaxkv.__file__).resolve().parents[1]


# --model's help: what `jaxkv.model_sources.load_model` takes.
MODEL_HELP = (
    "a fetched model's name (`jaxkv fetch NAME`), a checkpoint directory, a .gguf file or a "
    "preset name"
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """A benchmark's `-h`: its module docstring as written, each option's default after its
    help."""


def provenance_line(provenance: dict) -> str:
    """One markdown line of a `provenance` block: command, commit, date, host, jax."""
    return (
        f"`{provenance['command']}` at {provenance['commit']}, {provenance['date']}, "
        f"{provenance['machine']['host']}, jax {provenance['jax']}."
    )


def commands_so_far(run_path: Path, command: str) -> list[str]:
    """The distinct commands a resumable run's `run_path` (JSON) lists under `commands`, in
    the order they first ran, with `command` last unless listed already."""
    previous = json.loads(run_path.read_text()) if run_path.exists() else {}
    listed = list(dict.fromkeys(previous.get("commands", [])))
    return listed if command in listed else [*listed, command]


def check_same_run(run_path: Path, run: dict, identity: dict[str, str]) -> None:
    """SystemExit when the resumable run at `run_path` (JSON) has, under a key of `identity`
    ({key: the option that sets it}), another value than `run`: its records would be taken
    as this command's and skipped. A key the file lacks (written before it was kept) passes."""
    previous = json.loads(run_path.read_text()) if run_path.exists() else {}
    for key, option in identity.items():
        if key in previous and previous[key] != run[key]:
            raise SystemExit(
                f"{option}: {run_path.parent} holds a run with {key} {previous[key]!r}, this "
                f"command {run[key]!r}; give another --out"
            )


def save(
    out: Path, stem: str, report: dict | list, markdown: str | None = None, indent: int | None = 2
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


def parameter_count(tree) -> int:
    """How many numbers the arrays of a pytree hold."""
    return sum(int(np.size(leaf)) for leaf in jax.tree.leaves(tree))


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


# ------------------------------------------------------------------------------ device probe


READ_ROW = 1024  # floats per row of the read-bandwidth array (4 KiB read per output float)


def seconds_per_call(fn, *args, repeats: int, calls: int = 10) -> float:
    """Median over `repeats` of the wall time of `calls` back-to-back calls, per call, after one
    compiling call. Dispatch is asynchronous, so the launches of one batch overlap the work."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second moved by an elementwise op that reads and writes `num_bytes` each."""
    x = jnp.ones(num_bytes // 4, jnp.float32)
    return 2 * num_bytes / seconds_per_call(jax.jit(lambda x: x + 1), x, repeats=repeats)


def read_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second read by row sums of an f32 array of `num_bytes` (READ_ROW wide): the
    memory-read roofline of a decode step, which reads weights and KV and writes little. On a
    CPU column sums of the same array run slower, and an elementwise copy, which also writes a
    fresh output buffer each call, far slower. The rate depends on the size: an array the
    last-level cache holds reads faster than one streamed from memory."""
    x = jnp.ones((max(1, num_bytes // (4 * READ_ROW)), READ_ROW), jnp.float32)
    row_sums = jax.jit(lambda x: jnp.sum(x, axis=1))
    return x.size * 4 / seconds_per_call(row_sums, x, repeats=repeats)


# ------------------------------------------------------------------------------ sweeps


def build_policy(name: str, budget: float | None, **options):
    """Policy `name` at a budget ratio (None: its defaults; `policies.get` maps the budget to
    KVzip's `ratio=`), with other fields set by `options`."""
    return (
        policies.get(name, **options)
        if budget is None
        else policies.get(name, budget=budget, **options)
    )


def parse_ratio_policies(entries: list[str]) -> dict[str, tuple[str, dict]]:
    """A sweep over compression ratios' --policies entries `NAME[:KEY=VALUE...]` -> {entry:
    (name, options)}, the budget from --ratios; SystemExit for a name not registered, or one
    that takes no budget (but the full cache, and WG-KV, whose ratios are thresholds)."""
    parsed = {}
    for entry in entries:
        name, *pairs = entry.split(":")
        if name not in policies.registered():
            raise SystemExit(f"--policies {entry}: registered are {policies.registered()}")
        if not spec.takes_budget(name) and name not in ("full", "wgkv"):
            raise SystemExit(f"--policies {entry}: takes no budget, so no compression ratio")
        parsed[entry] = (name, spec.policy_kwargs(name, pairs, None, pair_option=entry))
    return parsed


def check_ratios(ratios) -> None:
    """SystemExit for a --ratios value outside (0, 1): kvpress's compression ratio, the share
    of the prompt evicted."""
    for ratio in ratios:
        if not 0 < ratio < 1:
            raise SystemExit(f"--ratios {ratio}: the share evicted, in (0, 1)")


def policy_at_ratio(name: str, options: dict, ratio: float, tau: float | None = None):
    """Policy `name` (with `options`) at kvpress's compression `ratio`: budget 1 - ratio; the
    full cache whatever the ratio; WG-KV, whose knob is a threshold, at `tau` (the one
    calibrated for the ratio)."""
    if name == "full":
        return policies.get("full")
    if name == "wgkv":
        if tau is None:
            raise ValueError(f"wgkv at ratio {ratio}: its tau is calibrated, not a budget")
        return policies.get("wgkv", tau=tau, **options)
    return build_policy(name, 1.0 - ratio, **options)


def shipped_params_of(parsed: dict, model, model_arg: str) -> dict:
    """{entry: its learned parameters (`learned_params`: the ones jaxkv ships for
    `model_arg`), or None} for `parse_ratio_policies`'s {entry: (name, options)}."""
    return {
        entry: learned_params(policies.get(name, **options), model, model_arg, {})
        for entry, (name, options) in parsed.items()
    }


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = (
        z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    )
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_ratio_interval(
    correct: Sequence[bool],
    baseline_correct: Sequence[bool],
    resamples: int = 20_000,
    seed: int = 0,
) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of sum(correct) / sum(baseline_correct) over the
    same episodes (both [E], episode e's outcome at index e): episodes are resampled together,
    so what the two share does not count as noise. Resamples in which the baseline answers
    nothing are left out; (nan, nan) if it answers no episode at all."""
    correct, baseline = (np.asarray(a, dtype=bool) for a in (correct, baseline_correct))
    if correct.shape != baseline.shape or correct.ndim != 1:
        raise ValueError(
            f"correct {correct.shape} and baseline_correct {baseline.shape}: one outcome per "
            "episode, the same episodes"
        )
    if not baseline.any():
        return math.nan, math.nan
    picks = np.random.default_rng(seed).integers(0, len(correct), (resamples, len(correct)))
    found, found_by_baseline = correct[picks].sum(axis=1), baseline[picks].sum(axis=1)
    defined = found_by_baseline > 0
    ratios = found[defined] / found_by_baseline[defined]
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def add_params_option(parser: argparse.ArgumentParser) -> None:
    """--params NAME=PATH ... (`learned_params` reads them, parsed by `spec.parse_params`)."""
    parser.add_argument(
        "--params",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="a learned policy's parameters (without: the ones jaxkv ships for --model)",
    )


def learned_params(policy, model, model_arg: str, given: dict):
    """A learned policy's parameters: `given` (--params NAME=PATH, parsed), else the ones jaxkv
    ships for `model_arg` (--model); None for a policy that learns nothing."""
    if policy.params is None:
        return None
    path = given.get(policy.name, [None])[-1]
    path = path or policy.params.shipped_path(shipped_name(model_arg))
    if path is None:
        raise ValueError(
            f"--policies {policy.name}: jaxkv ships no trained parameters of it for --model "
            f"{model_arg}; give them, --params {policy.name}=PATH"
        )
    return policy.params.load(path, model.config)
