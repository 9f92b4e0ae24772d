"""Quality of every registered policy on the reference model, against the KV memory it holds.

Tasks (episodes from `jaxkv.tasks` on the held-out corpus split, seeds disjoint from training):
  needle, multikey, multivalue, vartrack  `generate` (greedy, the policy's prefill compression
      and decode hooks), scored by exact match of the answer;
  multiquestion  the context alone is compressed once, then several multikey questions are asked
      of that same cache (copies of it), so the cache must serve questions it never saw;
  bpb  bits per byte of a held-out continuation read over the compressed context.
Multiquestion and bpb continue from `compress_prompt`'s state with full-cache decoding (the
policy's decode-time hooks do not run there).

Policies with a `budget` run at every budget of the sweep (ratios of the prompt); the others
(full, gvote, confkv) choose their own and run once. Memory is what the cache actually holds
after prefill and compression (`memory_bytes`), per sequence, not the nominal ratio.

    jaxkv bench quality --out results/quality                 # the full sweep (hours on a CPU)
    jaxkv bench quality --fast --out /tmp/quality             # the harness in a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tqdm import tqdm

from jaxkv import bundled, policies
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.byte_tasks import TASKS, run_task
from jaxkv.benchmarks.quality_report import render
from jaxkv.models import load_hf_checkpoint
from jaxkv.policies import spec
from jaxkv.train import corpus as corpus_lib

REFERENCE_MODEL = bundled.REFERENCE_MODEL


@dataclasses.dataclass(frozen=True)
class Sweep:
    policies: tuple[str, ...]
    budgets: tuple[float, ...]
    lengths: tuple[int, ...]
    samples: int
    tasks: tuple[str, ...] = TASKS


def _runs_by_default(name: str) -> bool:
    """A policy without parameters, or whose parameters ship for the reference model; the
    others (calibrated heads) run when given theirs, and those that need settings with no
    default (per_layer's shares of each layer, DMS's threshold) when given them."""
    try:
        policy = policies.get(name)
        policy.thresholds(1)
    except ValueError:
        return False
    return policy.params is None or policy.params.shipped_path(bundled.REFERENCE) is not None


FULL = Sweep(
    policies=tuple(n for n in policies.registered() if _runs_by_default(n)),
    budgets=(0.1, 0.2, 0.3, 0.5, 1.0),
    lengths=(2048, 4096),
    samples=16,
)
FAST = Sweep(
    policies=("full", "sliding_window", "streaming_llm"),
    budgets=(0.5,),
    lengths=(512,),
    samples=2,
)


def check_sweep(sweep: Sweep, policy_params: dict | None = None) -> None:
    """Names the bad value before anything runs."""
    known = policies.registered()
    for name in sweep.policies:
        if name not in known:
            raise ValueError(f"policy={name!r}: registered policies are {known}")
        part = policies.get(name).params
        if (
            part is not None
            and name not in (policy_params or {})
            and part.shipped_path(bundled.REFERENCE) is None
        ):
            raise ValueError(f"policy={name!r} needs policy_params: --params {name}=PATH")
    for budget in sweep.budgets:
        if not 0 < budget <= 1:
            raise ValueError(f"budget={budget}: a ratio of the prompt in (0, 1]")
    for task in sweep.tasks:
        if task not in TASKS:
            raise ValueError(f"task={task!r}: allowed are {TASKS}")
    for length in sweep.lengths:
        if length < 512:
            raise ValueError(f"length={length}: contexts must hold at least 512 bytes")
    if sweep.samples < 1:
        raise ValueError(f"samples={sweep.samples} must be >= 1")


def policy_runs(sweep: Sweep):
    """(policy name, budget or None) pairs."""
    for name in sweep.policies:
        if spec.takes_budget(name):
            yield from ((name, budget) for budget in sweep.budgets)
        else:
            yield name, None


def run_sweep(model, sweep: Sweep, corpus, *, log=print, policy_params=None) -> list[dict]:
    """`policy_params` maps a policy name to its parameters (e.g. {"wgkv": gates})."""
    policy_params = dict(policy_params or {})
    check_sweep(sweep, policy_params)
    rows = []
    cells = [
        (name, budget, length, task)
        for name, budget in policy_runs(sweep)
        for length in sweep.lengths
        for task in sweep.tasks
    ]
    for name in sweep.policies:
        part = policies.get(name).params
        path = None if part is None else part.shipped_path(bundled.REFERENCE)
        if name not in policy_params and path is not None:
            policy_params[name] = part.load(path, model.config)
    for name, budget, length, task in tqdm(cells, desc="quality", unit="cell"):
        policy = harness.build_policy(name, budget)
        params = policy_params.get(name)
        result = run_task(model, policy, corpus, task, length, sweep.samples, params)
        row = {"policy": name, "budget": budget, "length": length, "task": task}
        rows.append({**row, "samples": sweep.samples, **result})
        log(json.dumps(rows[-1]))
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench quality", description=__doc__)
    parser.add_argument("--model", type=Path, default=REFERENCE_MODEL)
    parser.add_argument("--fast", action="store_true", help="the CI sweep: 3 policies, 2 samples")
    parser.add_argument("--policies", nargs="*", help="policy names (default: every registered)")
    parser.add_argument("--budgets", type=float, nargs="*", help="ratios of the prompt in (0, 1]")
    parser.add_argument("--lengths", type=int, nargs="*", help="context lengths in bytes")
    parser.add_argument("--tasks", nargs="*", help=f"a subset of {TASKS}")
    parser.add_argument("--samples", type=int)
    parser.add_argument(
        "--params",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="saved parameters of a learned policy (default: those jaxkv ships for the "
        "reference model, e.g. wgkv=assets/wgkv-gates/lambda-0.08)",
    )
    parser.add_argument("--out", type=Path, default=Path("quality"))
    parser.add_argument(
        "--render",
        type=Path,
        help="a quality.json: rewrite its table and plot beside it, run nothing",
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        return render(args.render)
    sweep = FAST if args.fast else FULL
    overrides = {
        "policies": tuple(args.policies) if args.policies else None,
        "budgets": tuple(args.budgets) if args.budgets else None,
        "lengths": tuple(args.lengths) if args.lengths else None,
        "tasks": tuple(args.tasks) if args.tasks else None,
        "samples": args.samples,
    }
    sweep = dataclasses.replace(sweep, **{k: v for k, v in overrides.items() if v is not None})
    paths = {name: found[-1] for name, found in spec.parse_params(args.params).items()}
    check_sweep(sweep, paths)
    model = load_hf_checkpoint(args.model, dtype="float32")
    params = {
        name: policies.get(name).params.load(path, model.config) for name, path in paths.items()
    }
    heldout = corpus_lib.load_corpus("heldout")
    rows = run_sweep(model, sweep, heldout, policy_params=params)
    report = {
        **harness.provenance("jaxkv bench quality", argv),
        "model": str(args.model),
        "params": {
            name: str(paths.get(name, policies.get(name).params.shipped_path(bundled.REFERENCE)))
            for name in sweep.policies
            if policies.get(name).params is not None
        },
        "sweep": dataclasses.asdict(sweep),
        "rows": rows,
    }
    harness.save(args.out, "quality", report)
    return render(args.out / "quality.json")


if __name__ == "__main__":
    main()
