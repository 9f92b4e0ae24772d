"""Many requests, one pool: `jaxkv.Engine` under a Poisson trace, per policy, pool size and
count of prefill rows.

    jaxkv bench serve --model smollm2-135m-instruct --policies full snapkv:0.3 fastkvzip:0.3 \
        --requests 16 --rate 0.5 --pool-requests 2 4 8 --out results/serve

The trace: prose prompts of `--min-prompt`..`--max-prompt` tokens (`jaxkv.prose`, the model's
tokens) with `--min-new`..`--max-new` new tokens each (stop tokens off, so every request runs
its length), arriving as a Poisson process of `--rate` requests per second of wall time (a
large rate: a burst, every request at once); the same trace for every policy. The pool holds
`--pool-requests` full-cache requests of the longest prompt and generation (the full cache's
own limit; several values: one run each, and a plot of decode throughput and requests running
against the pool size), the engine `--max-slots` slots and `--max-prefills` prefill rows
(several values: one run each; one row reads one request's chunk a step, four batch four
requests' chunks in one forward pass) under `--max-batched-tokens`. A learned policy runs with
`--params NAME=PATH`, or the parameters jaxkv ships for --model (`jaxkv.bundled.SHIPPED_PARAMS`).
Per run: mean and peak requests running (sampled after every step), tokens per second over the
whole run and over decode-only steps (the steady state: no prefill chunk in the step), prompt
tokens per second of the steps taken while a request waited (prompt tokens served over those
steps' seconds), time to first token and time per output token (p50, p99), preemptions,
requests refused as too large for the pool, end-to-end requests per second, and where the time
goes: seconds of the steps taken while a request waited (queued, reading its prompt or waiting
for a slot: they run the prefill chunks besides the decode step) and of the steps with none
waiting (decode only, whose tokens per second are the steady state's). The step programs are
compiled before the trace (`Engine.warm_up`: every width of the prefill program, 1, 2, 4, ...
requests' chunks, at every chunk bucket); a program the trace meets first (a compression that
reads the prompt, at another prompt bucket) compiles inside it, and its seconds are
reported and left out of the step seconds (and so of the tokens per second), not of TTFT or
the run's wall time. Run on one machine in one process: ratios between runs are the
measurement.

`--random-weights` times the engine at the shape of `--model` (a name in
`jaxkv.models.configs.MODEL_SHAPES`) with random weights and the byte-level tokenizer, for a
machine that lacks the model file (a GPU lent for minutes): the same programs, the same work a
token, other prompts and tokens (stop tokens are off, so every request still runs its length).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import policies
from jaxkv.benchmarks import harness
from jaxkv.compile_log import counting_compiles
from jaxkv.engine import TooLargeForPoolError
from jaxkv.model_sources import load_model
from jaxkv.models import byte_tokenizer, init_model
from jaxkv.models.configs import MODEL_SHAPES, model_shape
from jaxkv.policies import spec as spec_lib
from jaxkv.prose import prose
from jaxkv.sharding import mesh_from_text


def build_trace(tokenizer, args) -> list[dict]:
    """[{arrival seconds, prompt ids, max_new_tokens}] (deterministic in --seed)."""
    rng = np.random.default_rng(args.seed)
    gaps = rng.exponential(1.0 / args.rate, args.requests)
    trace, arrival = [], 0.0
    for index, gap in enumerate(gaps):
        arrival += float(gap) if index else 0.0
        length = int(rng.integers(args.min_prompt, args.max_prompt + 1))
        ids = tokenizer.encode(prose(length * 8, seed=args.seed + index))[:length]
        trace.append(
            {
                "arrival": arrival,
                "prompt": ids,
                "max_new_tokens": int(rng.integers(args.min_new, args.max_new + 1)),
            }
        )
    return trace


def served_model(args):
    """(model, tokenizer) of --model, or its shape with random weights (--random-weights)."""
    if not args.random_weights:
        return load_model(args.model)
    if args.model not in MODEL_SHAPES:
        raise ValueError(
            f"--model {args.model!r} with --random-weights: give a shape of {sorted(MODEL_SHAPES)}"
        )
    return init_model(model_shape(args.model), seed=args.seed, dtype=jnp.float32), byte_tokenizer()


def pool_pages(model, args, requests: int, page_size: int) -> int:
    """Pages that hold `requests` full-cache requests of the longest prompt + output."""
    cfg = model.config
    per_head = -(-(args.max_prompt + args.max_new) // page_size)
    return requests * cfg.num_layers * cfg.num_kv_heads * per_head


def run_policy(
    model, policy, trace: list[dict], args, num_pages: int, params, max_prefills: int
) -> dict:
    engine = jaxkv.Engine(
        model,
        policy,
        cache=jaxkv.CacheConfig(num_pages=num_pages),
        max_slots=args.max_slots,
        max_prefills=max_prefills,
        max_batched_tokens=args.max_batched_tokens,
        mesh=None if args.mesh is None else mesh_from_text(args.mesh),
        max_context=args.max_prompt + args.max_new,
        policy_params=params,
    )
    engine.warm_up()  # every prefill width and chunk bucket: the trace times steady work
    start = time.perf_counter()
    pending = list(enumerate(trace))
    submitted, indices, first, last, counts, too_large = {}, {}, {}, {}, {}, set()
    refused = 0  # at submit: more pages than the pool holds, planned
    running, decode_tokens, decode_seconds, prefill_seconds = [], 0, 0.0, 0.0
    compile_seconds = 0.0  # programs of shapes the warm-up did not meet (left out of the rates)
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][1]["arrival"] <= now:
            index, request = pending.pop(0)
            try:
                rid = engine.submit(
                    request["prompt"], max_new_tokens=request["max_new_tokens"], stop_tokens=()
                )
            except TooLargeForPoolError:
                refused += 1
                continue
            submitted[rid] = start + request["arrival"]
            indices[rid] = index
        if not engine.has_work():
            time.sleep(max(0.0, pending[0][1]["arrival"] - now))
            continue
        prefilling = engine.stats()["waiting"] > 0
        step_start = time.perf_counter()
        with counting_compiles() as compiled:
            events = engine.step()
        step_end = time.perf_counter()
        compile_seconds += compiled.seconds
        step_seconds = step_end - step_start - compiled.seconds
        produced = 0
        for event in events:
            if event.token < 0:
                if event.reason == "too_large":
                    too_large.add(event.request_id)
                continue
            produced += 1
            first.setdefault(event.request_id, step_end)
            last[event.request_id] = step_end
            counts[event.request_id] = counts.get(event.request_id, 0) + 1
        if prefilling:
            prefill_seconds += step_seconds
        else:
            decode_seconds += step_seconds
            decode_tokens += produced
        running.append(engine.stats()["running"])
    elapsed = time.perf_counter() - start
    served = [rid for rid in submitted if rid not in too_large]
    prompt_tokens = sum(
        len(trace[index]["prompt"]) for rid, index in indices.items() if rid in served
    )
    ttft = [first[rid] - submitted[rid] for rid in served] or [np.nan]
    tpot = [(last[rid] - first[rid]) / max(counts[rid] - 1, 1) for rid in served] or [np.nan]
    return {
        "num_pages": num_pages,
        "requests": len(submitted) + refused,
        "too_large": len(too_large) + refused,
        "running_mean": float(np.mean(running)),
        "running_peak": int(np.max(running)),
        "tokens_per_second": sum(counts.values()) / elapsed,
        "prompt_tokens_per_second": prompt_tokens / max(prefill_seconds, 1e-9),
        "decode_tokens_per_second": decode_tokens / max(decode_seconds, 1e-9),
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "tpot_p50": float(np.percentile(tpot, 50)),
        "tpot_p99": float(np.percentile(tpot, 99)),
        "preemptions": engine.preemptions,
        "requests_per_second": (len(submitted) + refused) / elapsed,
        "seconds": elapsed,
        "seconds_in_prefill_steps": prefill_seconds,
        "seconds_in_decode_steps": decode_seconds,
        "compile_seconds": compile_seconds,
    }


def markdown(report: dict) -> str:
    head = (
        "| policy | pool (full requests): pages | prefill rows | running mean / peak | tok/s "
        "| decode tok/s | prompt tok/s | TTFT p50 / p99 s | TPOT p50 / p99 s | preemptions "
        "| too large | req/s | prefill / decode s | compile s |"
    )
    rows = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        rows.append(
            f"| {row['policy']} | {row['pool_requests']}: {row['num_pages']} "
            f"| {row['max_prefills']} "
            f"| {row['running_mean']:.2f} / {row['running_peak']} "
            f"| {row['tokens_per_second']:.2f} | {row['decode_tokens_per_second']:.2f} "
            f"| {row['prompt_tokens_per_second']:.1f} "
            f"| {row['ttft_p50']:.1f} / {row['ttft_p99']:.1f} "
            f"| {row['tpot_p50']:.2f} / {row['tpot_p99']:.2f} | {row['preemptions']} "
            f"| {row['too_large']} "
            f"| {row['requests_per_second']:.3f} "
            f"| {row['seconds_in_prefill_steps']:.0f} / {row['seconds_in_decode_steps']:.0f} "
            f"| {row['compile_seconds']:.1f} |"
        )
    weights = ", random weights" if report["trace"].get("random_weights") else ""
    title = f"# Serving a Poisson trace ({report['model']}{weights})"
    if len(report["trace"]["pool_requests"]) > 1:
        title += "\n\n![decode throughput and requests running against pool size](serve.png)"
    return (
        f"{title}\n\n{harness.provenance_line(report['provenance'])}\n\n" + "\n".join(rows) + "\n"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="jaxkv bench serve", description=__doc__, formatter_class=harness.HelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help=harness.MODEL_HELP)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["full", "snapkv:0.3", "kvzip:0.3"],
        help="policy specs, a run each over the same trace",
    )
    parser.add_argument("--requests", type=int, default=16, help="requests in the trace")
    parser.add_argument("--rate", type=float, default=0.5, help="arrivals per second")
    parser.add_argument("--min-prompt", type=int, default=1024, help="shortest prompt, tokens")
    parser.add_argument("--max-prompt", type=int, default=2048, help="longest prompt, tokens")
    parser.add_argument("--min-new", type=int, default=64, help="fewest new tokens a request")
    parser.add_argument("--max-new", type=int, default=256, help="most new tokens a request")
    parser.add_argument(
        "--pool-requests",
        type=int,
        nargs="+",
        default=[4],
        help="pool sizes, in full-cache requests of the longest prompt + output (one run each)",
    )
    harness.add_params_option(parser)
    parser.add_argument("--max-slots", type=int, default=16, help="requests decoded at once")
    parser.add_argument(
        "--max-prefills",
        type=int,
        nargs="+",
        default=[4],
        help="requests whose prompts are read at once, the engine's prefill rows (one run each)",
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="tokens one engine step runs (default: the engine's, every slot and row's chunk)",
    )
    parser.add_argument(
        "--mesh",
        default=None,
        metavar="DATAxMODEL",
        help="run the engine over a (data, model) mesh, e.g. 2x3 (on a CPU, make the devices "
        "with XLA_FLAGS=--xla_force_host_platform_device_count=N); default one device",
    )
    parser.add_argument("--seed", type=int, default=0, help="the trace's prompts and arrivals")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="--model's shape (a name in MODEL_SHAPES) with random weights and byte-level tokens",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results/serve"),
        help="where the report goes: serve.json, serve.md (and serve.png) in a folder per model",
    )
    args = parser.parse_args(argv)
    if min(args.pool_requests) < 1:
        raise ValueError(f"--pool-requests {args.pool_requests}: each must be >= 1")
    given = spec_lib.parse_params(args.params)
    model, tokenizer = served_model(args)
    trace = build_trace(tokenizer, args)
    specs = {spec: policies.from_spec(spec).for_tokenizer(tokenizer) for spec in args.policies}
    params = {
        spec: harness.learned_params(policy, model, args.model, given)
        for spec, policy in specs.items()
    }
    rows = []
    for requests in args.pool_requests:
        num_pages = pool_pages(model, args, requests, jaxkv.CacheConfig().page_size)
        for spec, policy in specs.items():
            for prefills in args.max_prefills:
                result = run_policy(model, policy, trace, args, num_pages, params[spec], prefills)
                row = {"policy": spec, "pool_requests": requests, "max_prefills": prefills}
                row |= result
                harness.print_row(row)
                rows.append(row)
    report = {
        "provenance": harness.provenance("jaxkv bench serve", argv),
        "model": args.model,
        "trace": {key: value for key, value in vars(args).items() if key != "out"},
        "rows": rows,
    }
    out = args.out / Path(args.model).stem
    harness.save(out, "serve", report, markdown(report))
    if len(args.pool_requests) > 1:
        plot(report, out / "serve.png")
    print(markdown(report))
    return report


def plot(report: dict, path: Path) -> None:
    """Decode tokens per second and mean requests running against the pool size, a line per
    policy."""
    plt = harness.pyplot()
    fig, (throughput, running) = plt.subplots(1, 2, figsize=(10, 4))
    several = len(report["trace"]["max_prefills"]) > 1
    for key in dict.fromkeys((row["policy"], row["max_prefills"]) for row in report["rows"]):
        rows = [row for row in report["rows"] if (row["policy"], row["max_prefills"]) == key]
        label = f"{key[0]}, {key[1]} prefill rows" if several else key[0]
        pools = [row["pool_requests"] for row in rows]
        throughput.plot(pools, [r["decode_tokens_per_second"] for r in rows], "o-", label=label)
        running.plot(pools, [r["running_mean"] for r in rows], "o-", label=label)
    for axis, label in ((throughput, "decode tokens / s"), (running, "requests running (mean)")):
        axis.set_xlabel("pool size (full-cache requests)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    throughput.legend()
    fig.suptitle(f"{report['model']}: one pool, a Poisson trace")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
