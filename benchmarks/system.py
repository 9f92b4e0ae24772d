"""End-to-end system benchmark: prefill, decode, memory and roofline of every policy.

Every policy runs through `jaxkv.generate` as a user calls it (random weights, greedy,
`stop_tokens=[]`).

Per (context, batch, policy), each row in its own subprocess (`--one`, JSON on stdout) so that
its peak memory is its own:
  prefill     fastest wall time of `generate(max_new_tokens=1)` after one compiling call (the
              first call's time is reported separately as `first_call_s`);
  decode      ms per decode step (one token for each of the B sequences): the slope between the
              fastest of `generate(max_new_tokens=1 + s)` and `generate(max_new_tokens=1 + s + d)`,
              each timed `--repeats` times after its compiling call (`decode_method` in the JSON);
  KV bytes    `GenerateOutput.memory_bytes` after prefill and at the end, as a ratio to the full
              cache's; the decode pool's allocated bytes (pool arrays, int8 tier, ring);
  peak        `peak_bytes_in_use` of the device where the backend reports it (GPU), else null,
              and the process's peak host RSS (`ru_maxrss`), labelled as host memory;
  roofline    (weight bytes + KV bytes read per decode step) / read bandwidth, the bandwidth
              from `--bandwidth-gbs` or measured (jitted row sums, bytes read per second:
              `harness.read_bandwidth`): on a CPU in each row's process over as many bytes as
              its decode step reads (a step whose weights and KV the last-level cache holds
              reads faster than one streamed from memory), elsewhere once per run
              (`--read-mib`); an elementwise copy's rate is recorded beside it. Reported as the
              fraction reached and, per policy, the decode speed-up over the full cache next to
              the roofline's.
With `--processes N` every row runs in N processes, round-robin over the grid (drift hits all
rows alike), and keeps the process with the fastest decode, its roofline at the highest read
rate any of them probed (the strictest bar); every process's decode time and read rate stay in
the row. On a shared 2-core machine one process's minimum over repeats moved by up to 1.8x
between processes of the same row (`results/system/cpu-kv/system-4k.md`).
Rows that cannot fit (weights + KV + attention temporaries against the device memory, or the
allocator's out-of-memory error) say so with the largest size that fits; a policy that cannot
work at a context reports jaxkv's ValueError in its row. Writes `<out>.json`, `<out>.md`,
`<out>.png`.

    jaxkv bench system --model llama3-8b-shape --layers 16 --contexts 32768 131072 \\
        --batches 1 8 --policies full snapkv:0.25 streaming_llm:0.25 h2o:0.25 \\
        --backend pallas --out results/system/h100
    jaxkv bench system --cpu --out results/system/cpu/system   # 12 rows, ~10 min on 2 busy cores

Policy specs are `jaxkv.policies.from_spec`'s `name[:value][:key=value...]` (the value is the
budget for most: `tau` for wgkv, `window` for local_attention, `tight` for confkv).
Learned parameters are freshly initialised (random gates; duo_attention's retrieval heads the
first `retrieval_share` of every layer's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jaxkv
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.system_model import (
    GIB,
    ITEMSIZE,
    MIB,
    SHAPES,
    build_policy,
    does_not_fit_message,
    memory_estimate,
    model_config,
    parse_policy,
    weight_bytes,
)
from jaxkv.benchmarks.system_report import derive, markdown, ok, plot
from jaxkv.models import init_model
from jaxkv.models.configs import dtype_from_name

# Rows and the device probe run as `python -m jaxkv.benchmarks.system` in a child process.
MODULE = "jaxkv.benchmarks.system"
DECODE_METHOD = (
    "slope of the fastest generate() wall times between max_new_tokens=1+s and 1+s+d "
    "(s = --decode-start, d = --decode-tokens decode steps), each the minimum over --repeats "
    "calls (interleaved) after a compiling call (interference only adds time: on a shared "
    "2-core machine medians of whole generate() calls moved by seconds); "
    "per-request work = t(1+s) - t(1) - s x slope "
    "(set-up, repack and output between prefill and the decode loop)"
)
CPU_DEFAULTS = {
    "model": "cpu-mid",
    "contexts": [512, 1024, 2048],
    "batches": [1],
    "policies": ["full", "snapkv:0.25", "streaming_llm:0.25", "h2o:0.25"],
    "dtype": "float32",
    "decode_tokens": 32,
    "repeats": 3,
}
GPU_DEFAULTS = {
    "model": "llama3-8b-shape",
    "contexts": [32768, 131072],
    "batches": [1, 8],
    "policies": ["full", "snapkv:0.25", "streaming_llm:0.25", "h2o:0.25"],
    "dtype": "bfloat16",
    "decode_tokens": 32,
    "repeats": 5,
}

# ------------------------------------------------------------------------------ device probe


def probe(args) -> dict:
    """Device description, memory limit and (unless given) the measured copy bandwidth."""
    device = jax.devices()[0]
    stats = device.memory_stats()
    if args.memory_limit_gib is not None:
        limit, source = int(args.memory_limit_gib * GIB), "--memory-limit-gib"
    elif stats and "bytes_limit" in stats:
        limit, source = int(stats["bytes_limit"]), "device memory_stats bytes_limit"
    else:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        source = "host physical memory (no device memory stats)"
    info = {
        "device": f"{device.platform}: {device.device_kind}",
        "platform": device.platform,
        "num_devices": jax.device_count(),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "jax": jax.__version__,
        "memory_limit_bytes": limit,
        "memory_limit_source": source,
        "load_average_at_start": os.getloadavg(),
        "cpu_caches": cpu_caches(),
    }
    if args.bandwidth_gbs is not None:
        info |= {"bandwidth_gbs": args.bandwidth_gbs, "bandwidth_source": "--bandwidth-gbs"}
    else:
        read_bytes = (args.read_mib or (1024 if device.platform == "gpu" else 256)) * MIB
        cpu_rows = device.platform == "cpu"
        info |= {
            "bandwidth_gbs": harness.read_bandwidth(read_bytes, args.repeats) / 1e9,
            "bandwidth_source": f"measured: jitted row sums of {read_bytes // MIB} MiB of "
            "f32, bytes read / median time"
            + ("; each row's roofline: the same over its decode step's bytes" if cpu_rows else ""),
            "copy_bandwidth_gbs": harness.copy_bandwidth(read_bytes // 4, args.repeats) / 1e9,
        }
    return info


# ------------------------------------------------------------------------------ one row


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()  # generate returns host arrays: the call is synchronous
    return time.perf_counter() - start, out


def _pool_bytes(state) -> dict:
    pool = state.pool
    kv = pool.k_pages.nbytes + pool.v_pages.nbytes
    if pool.int8 is not None:
        kv += pool.int8.pool.k_pages.nbytes + pool.int8.pool.v_pages.nbytes
    allocated = sum(leaf.nbytes for leaf in jax.tree.leaves(pool)) + state.ring_bytes
    return {"pool_bytes_allocated": int(allocated), "pool_kv_bytes_allocated": int(kv)}


def _kv_read_per_step(policy, out, prompt_lengths) -> tuple[float, str]:
    """KV bytes one decode step reads: the mean held over the decode steps; a page-selecting
    policy reads its budget's worth of tokens plus every page's key bounds."""
    held = float(np.mean(out.memory_bytes[1:])) if len(out.memory_bytes) > 1 else 0.0
    if policy.selection is None:
        return held, "mean KV bytes held over the decode steps"
    state = out.state
    pool = state.pool
    layers, batch, heads = state.page_table.shape[:3]
    budget = np.asarray(policy.budget_tokens(prompt_lengths)).reshape(batch, -1)[:, 0]
    per_token = pool.page_bytes / pool.page_size
    selected = layers * heads * float(np.sum(budget)) * per_token
    pages = float(np.mean(out.pages_in_use[1:]))
    bounds = pages * 2 * pool.key_min.shape[-1] * pool.key_min.dtype.itemsize
    return min(held, selected + bounds), "budget tokens per head + all pages' key bounds"


def run_row(args, cfg, context: int, batch: int, spec: str) -> dict:
    """Measures one (context, batch, policy) in this process."""
    model = init_model(cfg, seed=0, dtype=dtype_from_name(args.dtype))
    policy, params = build_policy(spec, cfg)
    rng = np.random.default_rng(context * 1000 + batch)
    prompts = rng.integers(0, cfg.vocab_size, (batch, context), dtype=np.int32)
    d = args.decode_tokens

    def call(new_tokens):
        return jaxkv.generate(
            model,
            prompts,
            max_new_tokens=new_tokens,
            policy=policy,
            stop_tokens=[],
            backend=args.backend,
            prefill_chunk=args.prefill_chunk,
            cache=jaxkv.CacheConfig(page_size=args.page_size),
            policy_params=params,
        )

    start = args.decode_start
    first_call_s, short = _timed(lambda: call(1))
    kv_after_prefill = int(short.memory_bytes[0])
    del short  # an output holds its KV state: kept, it would count in the next calls' peak
    _timed(lambda: call(1 + start))
    decode_first_call_s, long = _timed(lambda: call(1 + start + d))
    if len(long.memory_bytes) != 1 + start + d:
        raise ValueError(f"generation stopped after {len(long.memory_bytes)} steps")
    kv_read, kv_read_method = _kv_read_per_step(policy, long, np.full(batch, context, np.int32))
    kv_final, pool_bytes = int(long.memory_bytes[-1]), _pool_bytes(long.state)
    del long
    prefill, starts, longs = [], [], []
    for _ in range(args.repeats):  # interleaved, so that drift hits all alike
        prefill.append(_timed(lambda: call(1))[0])
        starts.append(_timed(lambda: call(1 + start))[0])
        longs.append(_timed(lambda: call(1 + start + d))[0])
    decode_ms = 1e3 * (min(longs) - min(starts)) / d
    request_s = min(starts) - min(prefill) - start * decode_ms / 1e3
    stats = jax.devices()[0].memory_stats()
    return _step_read_bandwidth(args, cfg, kv_read) | {
        "first_call_s": first_call_s,
        "decode_first_call_s": decode_first_call_s,
        "prefill_s": float(min(prefill)),
        "prefill_times_s": prefill,
        "generate_1_plus_s_times_s": starts,
        "generate_1_plus_s_plus_d_times_s": longs,
        "decode_ms_per_step": float(decode_ms),
        # The slope's noise: the two samples' spreads over the decode steps between them.
        "decode_spread_ms_per_step": float(1e3 * (np.ptp(longs) + np.ptp(starts)) / d),
        "request_work_s": float(request_s),
        "request_work_of_prefill": float(request_s / min(prefill)),
        "decode_tokens_per_s": float(batch * 1e3 / decode_ms) if decode_ms > 0 else None,
        "kv_bytes_after_prefill": kv_after_prefill,
        "kv_bytes_final": kv_final,
        "kv_bytes_read_per_step": kv_read,
        "kv_bytes_read_method": kv_read_method,
        **pool_bytes,
        "device_peak_bytes": None if not stats else stats.get("peak_bytes_in_use"),
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def cpu_caches(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict[str, str]:
    """The first CPU's caches as Linux lists them ({"L3 Unified": "307200K", ...}; empty
    elsewhere): whether a step's bytes fit the last level decides its read rate."""
    caches = {}
    for index in sorted(sysfs.glob("index*")):
        level, kind, size = (
            (index / name).read_text().strip() for name in ("level", "type", "size")
        )
        caches[f"L{level} {kind}"] = size
    return caches


def _step_read_bandwidth(args, cfg, kv_read: float) -> dict:
    """On a CPU without `--bandwidth-gbs`: the read rate over as many bytes as a decode step
    reads (weights + KV), this row's roofline bandwidth."""
    if args.bandwidth_gbs is not None or jax.devices()[0].platform != "cpu":
        return {}
    step_bytes = int(weight_bytes(cfg, ITEMSIZE[args.dtype])["read_per_step"] + kv_read)
    return {
        "read_bandwidth_gbs": harness.read_bandwidth(step_bytes, args.repeats) / 1e9,
        "read_bandwidth_bytes": step_bytes,
    }


def _is_oom(error: BaseException) -> bool:
    text = str(error).lower()
    return "resource_exhausted" in text or "out of memory" in text or isinstance(error, MemoryError)


def guarded_row(args, cfg, row: dict, limit: int) -> dict:
    """`run_row` with jaxkv's ValueErrors and the allocator's out-of-memory reported in the row."""
    itemsize = ITEMSIZE[args.dtype]
    try:
        return run_row(args, cfg, row["context"], row["batch"], row["policy"])
    except ValueError as error:
        if _is_oom(error):
            return {
                "error": does_not_fit_message(
                    cfg, itemsize, limit, **_cb(row), args=args, reason="allocator out of memory"
                )
            }
        return {"error": f"{type(error).__name__}: {error}"}
    except Exception as error:  # noqa: BLE001 - only the allocator's OOM is turned into a row
        if not _is_oom(error):
            raise
        return {
            "error": does_not_fit_message(
                cfg, itemsize, limit, **_cb(row), args=args, reason="allocator out of memory"
            )
        }


def _cb(row):
    return {"context": row["context"], "batch": row["batch"]}


def fastest_process(results: list[dict]) -> dict:
    """One row from its processes' results: the fastest decode's, with the highest read rate
    probed by any of them (the strictest roofline) and every process's decode time and rate.
    An error in any process is the row's."""
    failed = [result for result in results if not ok(result)]
    if failed:
        return failed[0]
    row = dict(min(results, key=lambda result: result["decode_ms_per_step"]))
    row["decode_ms_per_step_processes"] = [result["decode_ms_per_step"] for result in results]
    rates = [result.get("read_bandwidth_gbs") for result in results]
    if None not in rates:
        row["read_bandwidth_gbs"] = max(rates)
        row["read_bandwidth_gbs_processes"] = rates
    return row


def row_in_subprocess(argv: list[str], row: dict, limit: int, cfg, args) -> dict:
    """Runs one row in a fresh Python process (`--one`): its result, or why there is none."""
    child = harness.run_child(
        MODULE, [*argv, "--one", json.dumps(row), "--memory-limit-gib", str(limit / GIB)]
    )
    if child.result is not None:
        return child.result
    if child.returncode < 0:  # killed: on a host, most likely by the kernel's OOM killer
        reason = f"process killed by signal {-child.returncode}, likely out of memory"
        return {
            "error": does_not_fit_message(
                cfg, ITEMSIZE[args.dtype], limit, **_cb(row), args=args, reason=reason
            )
        }
    return {"error": f"subprocess exited with {child.returncode}: {child.tail}"}


# ------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxkv bench system",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cpu", action="store_true", help="a mid-size model and small sizes")
    parser.add_argument("--model", help=f"{sorted(SHAPES)}, a models preset, or a config.json")
    parser.add_argument("--layers", type=int, help="override the number of layers")
    parser.add_argument("--vocab-size", type=int, help="override the vocabulary (saves memory)")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--policies", nargs="+", help="name[:value][:key=value] (module doc)")
    parser.add_argument("--backend", choices=("auto", "xla", "pallas", "interpret"), default="xla")
    parser.add_argument("--dtype", choices=sorted(ITEMSIZE))
    parser.add_argument("--decode-tokens", type=int, help="d: decode steps of the slope")
    parser.add_argument(
        "--decode-start",
        type=int,
        default=16,
        help="s: the slope starts after this many decode steps (past the first, costlier ones)",
    )
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--bandwidth-gbs", type=float, help="skip measuring the bandwidth")
    parser.add_argument(
        "--read-mib", type=int, help="size of the read-bandwidth array (256 MiB; GPU 1 GiB)"
    )
    parser.add_argument("--memory-limit-gib", type=float, help="pretend the device has this")
    parser.add_argument(
        "--skip-fit-check",
        action="store_true",
        help="run rows the (conservative) estimate refuses; the allocator's OOM still reports",
    )
    parser.add_argument(
        "--in-process", action="store_true", help="no subprocesses (peaks are cumulative)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run each row in this many processes, round-robin; keep the fastest decode",
    )
    parser.add_argument("--out", default="system", help="output prefix: .json, .md, .png")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return parser


def parse_args(argv) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    defaults = CPU_DEFAULTS if args.cpu else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.contexts) < 1 or min(args.batches) < 1 or args.decode_tokens < 1:
        raise SystemExit("contexts, batches and --decode-tokens must be >= 1")
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.decode_start < 0:
        raise SystemExit("--decode-start must be >= 0")
    if args.processes < 1 or (args.in_process and args.processes > 1):
        raise SystemExit("--processes must be >= 1, and 1 with --in-process")
    if not any(spec.split(":")[0] == "full" for spec in args.policies):
        args.policies = ["full", *args.policies]  # every ratio is to the full cache
    return args


def _child(args) -> int:
    """`--one ROW` / `--probe`: one measurement, printed as a marked JSON line."""
    if args.probe:
        result = probe(args)
    else:
        cfg = model_config(args)
        row = json.loads(args.one)
        result = guarded_row(args, cfg, row, int(args.memory_limit_gib * GIB))
    harness.print_row(result)
    return 0


def _processes_method(processes: int) -> str:
    if processes == 1:
        return ""
    return (
        f"; each row ran in {processes} processes, round-robin over the rows, and kept the "
        "fastest decode, its roofline at the highest read rate any of them probed"
    )


def _environment(args, argv) -> dict:
    if args.in_process:
        return probe(args)
    child = harness.run_child(MODULE, [*argv, "--probe"])
    if child.result is None:
        raise SystemExit(f"device probe failed ({child.returncode}): {child.tail}")
    return child.result


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one is not None or args.probe:
        return _child(args)
    from tqdm import tqdm

    cfg = model_config(args)
    for spec in args.policies:
        parse_policy(spec)  # unknown names fail before any measurement
    env = _environment(args, argv)
    limit = env["memory_limit_bytes"]
    itemsize = ITEMSIZE[args.dtype]
    grid = [
        {"context": c, "batch": b, "policy": p}
        for c in args.contexts
        for b in args.batches
        for p in args.policies
    ]
    results = [[] for _ in grid]
    runs = [(index, row) for _ in range(args.processes) for index, row in enumerate(grid)]
    out = Path(args.out)
    for index, row in tqdm(runs, desc="system benchmark", unit="row"):
        c, b = row["context"], row["batch"]
        estimate = memory_estimate(cfg, itemsize, c, b, args)["total"]
        if estimate > limit and not args.skip_fit_check:
            result = {"error": does_not_fit_message(cfg, itemsize, limit, c, b, args, "estimate")}
        elif args.in_process:
            result = guarded_row(args, cfg, row, limit)
        else:
            result = row_in_subprocess(argv, row, limit, cfg, args)
        results[index].append(result)
        # The rows finished so far are saved as they come, so that a run cut short keeps them.
        report = build_report(args, argv, cfg, env, grid, results)
        harness.save(out.parent, out.stem, report, markdown(report))
    plot(report, str(out.with_suffix(".png")))
    print(markdown(report))
    return report


def build_report(args, argv, cfg, env: dict, grid: list[dict], results: list[list]) -> dict:
    """The report of the grid's rows whose every process has finished."""
    rows = [
        {**row, **fastest_process(found)}
        for row, found in zip(grid, results, strict=True)
        if len(found) == args.processes
    ]
    derive(rows, cfg, args, env["bandwidth_gbs"])
    return {
        "benchmark": "system",
        **harness.provenance("jaxkv bench system", argv),
        "environment": env,
        "cpu_numbers": env["platform"] == "cpu",
        "model": {
            "name": args.model,
            "config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()},
            "dtype": args.dtype,
            "weight_bytes": weight_bytes(cfg, ITEMSIZE[args.dtype])["total"],
            "weights": "random (init_model, seed 0)",
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("one", "probe")},
        "decode_method": DECODE_METHOD + _processes_method(args.processes),
        "peak_memory_note": (
            "Peaks: device_peak_bytes is the device's peak_bytes_in_use (null where the backend "
            "has no memory stats, e.g. CPU); host_peak_rss_bytes is the process's peak host RSS "
            "(ru_maxrss), which on CPU includes the Python/JAX runtime. "
            + (
                "In-process run: both are cumulative over the rows run before."
                if args.in_process
                else "Each row ran in its own process."
            )
        ),
        "rows": rows,
        "rows_planned": len(grid),
    }


if __name__ == "__main__":
    main()
