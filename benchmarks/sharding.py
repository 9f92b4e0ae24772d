"""What sharded inference costs: each device's KV bytes and the collectives of a decode step.

For each policy, in its own process (the XLA dump flags must be set before jax starts), this
runs `jaxkv.generate` on a (data, model) mesh and on one device (random weights, greedy,
`stop_tokens=[]`) and reports:
  tokens_equal      the mesh's tokens equal one device's;
  kv_bytes          per device at the end of decoding (pages in use x page bytes, and the ring)
                    next to one device's total divided by the devices (its share);
  collectives       counted in the compiled decode program (XLA's optimized HLO): per decode
                    step (the loop body and condition, a layer loop counted once per layer) and
                    in the branches that run only on eviction steps (policies that evict every
                    `evict_every` steps), by kind and element count.
Writes `<out>.json` and `<out>.md`.

    jaxkv bench sharding --out results/sharding/cpu/sharding      # 8 host CPU devices, ~5 min
    jaxkv bench sharding --model llama3-8b-shape --layers 4 --data 1 --model-shards 8 ...

On a CPU the devices are virtual (`--xla_force_host_platform_device_count`), so only the
counts and bytes mean anything, not the times (none are reported).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

from jaxkv.benchmarks import harness

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_COLLECTIVE = re.compile(
    r"= (\w+)\[([\d,]*)\][^=]*? (" + "|".join(COLLECTIVE_KINDS) + r")(?:-start)?\("
)
_TUPLE_COLLECTIVE = re.compile(r"= \(.*?\) (" + "|".join(COLLECTIVE_KINDS) + r")(?:-start)?\(")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_CALLS = re.compile(r"\b(body|condition|calls)=%([\w.-]+)")
# A conditional's branches: an index's (`lax.switch`) or a predicate's (`lax.cond`).
_BRANCHES = re.compile(
    r"branch_computations=\{([^}]*)\}|true_computation=%([\w.-]+), false_computation=%([\w.-]+)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
DEFAULTS = {
    "model": "cpu-small",
    "context": 384,
    "batch": 4,
    "new_tokens": 8,
    "data": 2,
    "model_shards": 4,
    "policies": ["full", "snapkv:0.25", "adakv:0.25", "h2o:0.25", "fastkvzip:0.3", "wgkv:0.5"],
}
CPU_SMALL = {
    "family": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_layers": 2,
    "num_heads": 8,
    "num_kv_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 4096,
}


# ---------------------------------------------------------------------------- HLO counting


def _decode_program() -> str:
    """The decode loop's sharded program as XLA names it (after its function)."""
    from jaxkv.generation.loop import decode_loop

    return f"sharded_{decode_loop.fn.__name__}"


def parse_hlo(text: str) -> tuple[dict[str, list[str]], str]:
    """(computation name -> its instruction lines, the entry computation's name)."""
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            computations[current].append(line)
    return computations, entry


def _collective(line: str) -> tuple[str, int] | None:
    """(kind, elements) of a collective instruction line (tuple results: elements unknown, 0)."""
    match = _COLLECTIVE.search(line)
    if match:
        dims = [int(d) for d in match.group(2).split(",") if d]
        elements = 1
        for d in dims:
            elements *= d
        return match.group(3), elements
    match = _TUPLE_COLLECTIVE.search(line)
    return (match.group(1), 0) if match else None


def count_collectives(
    computations, name: str, memo=None
) -> tuple[collections.Counter, collections.Counter]:
    """(collectives run every time `name` runs, those inside its conditionals' branches (the
    most of any branch)), as Counters of (kind) and ("kind elements"), loops multiplied by their
    known trip counts."""
    memo = {} if memo is None else memo
    if name in memo:
        return memo[name]
    always, branches = collections.Counter(), collections.Counter()
    for line in computations.get(name, []):
        found = _collective(line)
        if found:
            always[found[0]] += 1
            always[f"{found[0]} elements"] += found[1]
            continue
        branch_list = _BRANCHES.search(line)
        if branch_list:
            listed, on_true, on_false = branch_list.groups()
            names = [b.strip().lstrip("%") for b in listed.split(",")] if listed else []
            names += [b for b in (on_true, on_false) if b]
            for branch in names:
                inner_always, inner_branches = count_collectives(computations, branch, memo)
                branches |= inner_always + inner_branches  # the largest branch, kind by kind
            continue
        trips = _TRIP_COUNT.search(line)
        repeat = int(trips.group(1)) if trips else 1
        # A loop of unknown trip count inside a step is `cache.eviction.run_if`: a branch.
        maybe_once = " while(" in line and not trips
        for kind, called in _CALLS.findall(line):
            inner_always, inner_branches = count_collectives(computations, called, memo)
            if maybe_once and kind == "body":
                branches |= inner_always + inner_branches
                continue
            for key, value in inner_always.items():
                always[key] += repeat * value
            for key, value in inner_branches.items():
                branches[key] += repeat * value
    memo[name] = (always, branches)
    return always, branches


def decode_step_collectives(hlo_text: str) -> dict:
    """Collectives of one step of the decode loop (the entry's while loop without a known trip
    count: its body and condition) and of its eviction branches."""
    computations, entry = parse_hlo(hlo_text)
    loops = [
        line for line in computations[entry] if " while(" in line and not _TRIP_COUNT.search(line)
    ]
    if len(loops) != 1:
        raise ValueError(f"expected one decode loop in the entry computation, found {len(loops)}")
    per_step, on_eviction = collections.Counter(), collections.Counter()
    for _, called in _CALLS.findall(loops[0]):
        always, branches = count_collectives(computations, called)
        per_step.update(always)
        on_eviction.update(branches)
    return {"per_step": dict(per_step), "eviction_branch": dict(on_eviction)}


# ---------------------------------------------------------------------------- one policy


def run_row(args, spec: str, dump_dir: str) -> dict:
    """Runs in the child: one device, then the mesh; the dump holds the mesh's programs."""
    import jax
    import numpy as np

    import jaxkv
    from jaxkv import sharding
    from jaxkv.benchmarks.system_model import build_policy

    cfg = model_config(args)
    from jaxkv.models import init_model

    model = init_model(cfg, seed=0, scale=0.05)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.context)).astype(np.int32)
    policy, params = build_policy(spec, cfg)
    mesh = sharding.InferenceMesh(sharding.make_inference_mesh(args.data, args.model_shards))
    kwargs = dict(
        max_new_tokens=args.new_tokens, policy=policy, stop_tokens=[], policy_params=params
    )
    one = jaxkv.generate(model, prompts, **kwargs)
    sharded = jaxkv.generate(model, prompts, mesh=mesh.mesh, **kwargs)
    state = sharded.state
    per_device_pages = sharding.to_host(state.pages_in_use())
    ring_per_device = state.ring_bytes // mesh.num_shards
    kv_bytes = [int(p) * state.pool.page_bytes + ring_per_device for p in per_device_pages]
    decode_files = sorted(Path(dump_dir).glob(f"*{_decode_program()}*after_optimizations.txt"))
    hlo = decode_files[-1].read_text()
    return {
        "policy": spec,
        "tokens_equal": bool(np.array_equal(one.tokens, sharded.tokens)),
        "kv_bytes_per_device": kv_bytes,
        "kv_bytes_one_device": int(one.memory_bytes[-1]),
        "share_of_one_device": int(one.memory_bytes[-1]) / mesh.num_shards,
        "collectives": decode_step_collectives(hlo),
        "devices": [str(d) for d in mesh.mesh.devices.flat],
        "jax": jax.__version__,
    }


def model_config(args):
    from jaxkv.benchmarks.system_model import SHAPES
    from jaxkv.models import configs

    shapes = {**SHAPES, "cpu-small": CPU_SMALL}
    if args.model not in shapes:
        raise SystemExit(f"--model {args.model!r}: built-in shapes are {sorted(shapes)}")
    shape = dict(shapes[args.model])
    shape["max_position_embeddings"] = max(
        shape["max_position_embeddings"], args.context + args.new_tokens + 1
    )
    cfg = configs.ModelConfig(**{**shape, "family": configs.Family(shape["family"])})
    if args.layers is not None:
        cfg = configs.ModelConfig(**{**cfg.__dict__, "num_layers": args.layers})
    return cfg


def _child_env(args, dump_dir: str) -> dict:
    flags = [
        f"--xla_dump_to={dump_dir}",
        "--xla_dump_hlo_as_text",
        f"--xla_dump_hlo_module_re=.*{_decode_program()}.*",
    ]
    if args.cpu_devices:
        flags.insert(0, f"--xla_force_host_platform_device_count={args.cpu_devices}")
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
    return env


def row_in_subprocess(argv: list[str], spec: str) -> dict:
    """One policy's row in a fresh process (its own device count and HLO dump)."""
    with tempfile.TemporaryDirectory() as dump_dir:
        child = harness.run_child(
            "jaxkv.benchmarks.sharding",
            [*argv, "--one", spec, "--dump-dir", dump_dir],
            env=_child_env(parse_args(argv), dump_dir),
        )
    if child.result is not None:
        return child.result
    return {"policy": spec, "error": f"exited with {child.returncode}: {child.tail}"}


# ---------------------------------------------------------------------------- report


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"# Sharded inference: data={cfg['data']} x model={cfg['model_shards']} "
        f"({cfg['model']}, context {cfg['context']}, batch {cfg['batch']})",
        "",
        harness.provenance_line(report),
        "",
        "| policy | tokens = one device | KV bytes per device (min..max) | one device / devices "
        "| all-reduce per step | all-gather per step | on eviction steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| {row['policy']} | error: {row['error']} | | | | | |")
            continue
        step = row["collectives"]["per_step"]
        evict = row["collectives"]["eviction_branch"]
        evict_text = (
            ", ".join(f"{evict[k]} {k}" for k in COLLECTIVE_KINDS if evict.get(k)) or "none"
        )
        per_device = row["kv_bytes_per_device"]
        lines.append(
            f"| {row['policy']} | {row['tokens_equal']} | {min(per_device):,}..{max(per_device):,} "
            f"| {row['share_of_one_device']:,.0f} | {step.get('all-reduce', 0)} "
            f"| {step.get('all-gather', 0)} | {evict_text} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxkv bench sharding", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=DEFAULTS["model"], help="built-in shape")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--context", type=int, default=DEFAULTS["context"])
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    parser.add_argument("--new-tokens", type=int, default=DEFAULTS["new_tokens"])
    parser.add_argument("--data", type=int, default=DEFAULTS["data"])
    parser.add_argument("--model-shards", type=int, default=DEFAULTS["model_shards"])
    parser.add_argument("--policies", nargs="+", default=DEFAULTS["policies"])
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="virtual host CPU devices (0: the machine's own devices, e.g. 8 GPUs)",
    )
    parser.add_argument("--out", default="results/sharding/cpu/sharding")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dump-dir", default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.one is not None:
        harness.print_row(run_row(args, args.one, args.dump_dir))
        return {}
    from tqdm.auto import tqdm

    rows = [row_in_subprocess(argv, spec) for spec in tqdm(args.policies, desc="policies")]
    jax_versions = {row["jax"] for row in rows if "jax" in row}
    report = {
        **harness.provenance("jaxkv bench sharding", argv),
        "virtual_cpu_devices": args.cpu_devices,
        "jax_in_rows": ", ".join(sorted(jax_versions)),
        "config": {k: v for k, v in vars(args).items() if k not in ("one", "dump_dir", "out")},
        "rows": rows,
    }
    out = Path(args.out)
    harness.save(out.parent, out.stem, report, markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
