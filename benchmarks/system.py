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
  roofline    (weight bytes + KV bytes read per decode step) / bandwidth, the bandwidth from
              `--bandwidth-gbs` or measured in the same run (a jitted elementwise copy of a
              large array, bytes read + written per second, as `jaxkv.benchmarks.kernels`); reported
              as the fraction reached and, per policy, the decode speed-up over the full cache
              next to the roofline's.
Rows that cannot fit (weights + KV + attention temporaries against the device memory, or the
allocator's out-of-memory error) say so with the largest size that fits; a policy that cannot
work at a context reports jaxkv's ValueError in its row. Writes `<out>.json`, `<out>.md`,
`<out>.png`.

    jaxkv bench system --model llama3-8b-shape --layers 16 --contexts 32768 131072 \\
        --batches 1 8 --policies full snapkv:0.25 streaming_llm:0.25 h2o:0.25 \\
        --backend pallas --out results/system/h100
    jaxkv bench system --cpu --out results/system/cpu/system   # 12 rows, ~10 min on 2 busy cores

Policy specs are `jaxkv.policies.from_spec`'s `name[:value][:key=value...]` (the value is the
budget for most: `tau` for wgkv, `window` for local_attention, `tight` for confkv), and
duo_attention's `retrieval_heads=N` heads per layer. Learned parameters are freshly initialised
(random gates).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jaxkv
from jaxkv import policies
from jaxkv.benchmarks.kernels import copy_bandwidth
from jaxkv.gates import fastkvzip as fastkvzip_gates
from jaxkv.gates.wgkv import init_write_gates
from jaxkv.models import configs, init_model
from jaxkv.models.configs import dtype_from_name
from jaxkv.models.decoder import param_shapes

ROW_MARKER = "SYSTEM_ROW_JSON "
# Rows and the device probe run as `python -m jaxkv.benchmarks.system` in a child process, from
# the directory that holds the jaxkv package imported here (a checkout or site-packages), so the
# child runs the same code.
CHILD_CWD = Path(jaxkv.__file__).resolve().parents[1]
GIB = 2**30
MIB = 2**20
DECODE_METHOD = (
    "slope of the fastest generate() wall times between max_new_tokens=1+s and 1+s+d "
    "(s = --decode-start, d = --decode-tokens decode steps), each the minimum over --repeats "
    "calls (interleaved) after a compiling call (interference only adds time: on a shared "
    "2-core machine medians of whole generate() calls moved by seconds); "
    "per-request work = t(1+s) - t(1) - s x slope "
    "(set-up, repack and output between prefill and the decode loop)"
)
# Random weights with Llama-3.1-8B layer shapes; vocabulary and depth can be cut by flags.
LLAMA3_8B_SHAPE = {
    "family": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
}
CPU_SHAPE = {
    "family": "llama",
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 2,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
}
# KV-heavy: 8 KV heads x 128 per layer (no GQA), a small MLP and vocabulary, so a decode step
# reads far more KV than weights at 4K+ tokens (issue 27's shape).
CPU_KV_SHAPE = {
    "family": "llama",
    "vocab_size": 512,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "max_position_embeddings": 16384,
}
SHAPES = {"llama3-8b-shape": LLAMA3_8B_SHAPE, "cpu-mid": CPU_SHAPE, "cpu-kv": CPU_KV_SHAPE}
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

# --------------------------------------------------------------------------- model and policies


def model_config(args):
    """The ModelConfig of `--model` (a built-in shape, a models preset, or an HF config.json)
    with `--layers` / `--vocab-size` applied and positions raised to the longest request."""
    if args.model in SHAPES:
        shape = dict(SHAPES[args.model])
        cfg = configs.ModelConfig(**{**shape, "family": configs.Family(shape["family"])})
    elif args.model in configs.PRESETS:
        cfg = configs.preset(args.model)
    else:
        path = Path(args.model)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise SystemExit(
                f"--model {args.model!r}: not a built-in shape {sorted(SHAPES)}, a preset "
                f"{sorted(configs.PRESETS)}, nor an existing config.json"
            )
        cfg = configs.from_hf_config(json.loads(path.read_text()))
    overrides = {"num_layers": args.layers, "vocab_size": args.vocab_size}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    longest = max(args.contexts) + args.decode_start + args.decode_tokens + 1
    if cfg.max_position_embeddings < longest:  # random weights: any position is as good
        cfg = dataclasses.replace(cfg, max_position_embeddings=longest)
    return cfg


def parse_policy(spec: str):
    """(the policy of `spec`, duo_attention's retrieval heads per layer or None): a named
    SystemExit for a bad spec, before anything is measured."""
    parts = spec.split(":")
    heads = [part for part in parts if part.startswith("retrieval_heads=")]
    if heads and parts[0] != "duo_attention":
        raise SystemExit(f"policy {spec!r}: only duo_attention takes retrieval_heads=")
    try:
        policy = policies.from_spec(":".join(p for p in parts if p not in heads))
        retrieval = int(heads[-1].partition("=")[2]) if heads else None
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return policy, retrieval


def build_policy(spec: str, cfg, seed: int = 0):
    """(policy, policy_params) for a spec; learned parameters freshly initialised."""
    policy, retrieval = parse_policy(spec)
    key = jax.random.PRNGKey(seed)
    params = None
    if policy.name == "wgkv":
        params = init_write_gates(cfg, key)
    elif policy.name == "fastkvzip":
        params = fastkvzip_gates.init_params(cfg, key)
    elif policy.name == "duo_attention":
        retrieval = 1 if retrieval is None else retrieval
        if not 0 <= retrieval <= cfg.num_kv_heads:
            raise ValueError(f"retrieval_heads={retrieval}: 0..{cfg.num_kv_heads} heads per layer")
        params = np.zeros((cfg.num_layers, cfg.num_kv_heads), bool)
        params[:, :retrieval] = True
    return policy, params


# ------------------------------------------------------------------------- memory estimates


def weight_bytes(cfg, itemsize: int) -> dict:
    """Parameter bytes and the bytes one decode step reads (an untied embedding: B rows only)."""
    shapes = param_shapes(cfg)
    total = sum(math.prod(s) for s in _leaves(shapes)) * itemsize
    embed = math.prod(shapes["embed"]) * itemsize
    read = total if cfg.tie_word_embeddings else total - embed
    return {"total": total, "read_per_step": read}


def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    else:
        yield tree


def memory_estimate(cfg, itemsize: int, context: int, batch: int, args) -> dict:
    """Bytes a full-cache `generate` needs (an upper bound for every policy): weights, the prefill
    pool and the repacked decode pool (alive together), and the largest attention temporaries
    (XLA backend: a chunk's f32 scores and probabilities over the whole context, and the
    gathered f32 keys/values of one layer)."""
    page = args.page_size
    tokens = -(-(context + args.decode_start + args.decode_tokens) // page) * page
    per_token_head = 2 * cfg.head_dim * itemsize + 8  # K, V + position and score metadata
    kv = cfg.num_layers * batch * cfg.num_kv_heads * tokens * per_token_head
    chunk = min(args.prefill_chunk, context)
    temporaries = 2 * batch * cfg.num_kv_heads * tokens * cfg.head_dim * 4
    if args.backend == "xla":
        temporaries += 2 * batch * cfg.num_heads * chunk * tokens * 4
    hidden = batch * chunk * (cfg.intermediate_size * 3 + cfg.vocab_size) * 4
    weights = weight_bytes(cfg, itemsize)["total"]
    total = weights + 2 * kv + temporaries + hidden
    return {"weights": weights, "kv_full": kv, "temporaries": temporaries + hidden, "total": total}


def largest_fitting(cfg, itemsize: int, limit: int, context: int, batch: int, args) -> dict:
    """The largest context at this batch and the largest batch at this context that fit."""

    def fits(c, b):
        return memory_estimate(cfg, itemsize, c, b, args)["total"] <= limit

    def search(test, high):
        low = 0
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if test(mid) else (low, mid - 1)
        return low

    step = args.page_size
    best_context = step * search(lambda n: fits(n * step, batch), max(context // step, 1))
    best_batch = search(lambda b: fits(context, b), batch)
    return {"largest_context": best_context, "largest_batch": best_batch}


def does_not_fit_message(cfg, itemsize, limit, context, batch, args, reason: str) -> str:
    est = memory_estimate(cfg, itemsize, context, batch, args)
    best = largest_fitting(cfg, itemsize, limit, context, batch, args)
    return (
        f"does not fit ({reason}): context {context} x batch {batch} needs ~"
        f"{est['total'] / GIB:.2f} GiB (weights {est['weights'] / GIB:.2f} + 2 x full KV "
        f"{est['kv_full'] / GIB:.2f} + temporaries {est['temporaries'] / GIB:.2f}) of "
        f"{limit / GIB:.2f} GiB; largest context that fits at batch {batch}: "
        f"~{best['largest_context']} tokens; largest batch at context {context}: "
        f"{best['largest_batch']}"
    )


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
    }
    if args.bandwidth_gbs is not None:
        info |= {"bandwidth_gbs": args.bandwidth_gbs, "bandwidth_source": "--bandwidth-gbs"}
    else:
        copy_bytes = (args.copy_mib or (1024 if device.platform == "gpu" else 64)) * MIB
        info |= {
            "bandwidth_gbs": copy_bandwidth(copy_bytes, args.repeats) / 1e9,
            "bandwidth_source": f"measured: jitted elementwise copy of {copy_bytes // MIB} MiB, "
            "(read + written bytes) / median time",
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
    _timed(lambda: call(1 + start))
    decode_first_call_s, long = _timed(lambda: call(1 + start + d))
    prefill, starts, longs = [], [], []
    for _ in range(args.repeats):  # interleaved, so that drift hits all alike
        prefill.append(_timed(lambda: call(1))[0])
        starts.append(_timed(lambda: call(1 + start))[0])
        longs.append(_timed(lambda: call(1 + start + d))[0])
    if len(long.memory_bytes) != 1 + start + d:
        raise ValueError(f"generation stopped after {len(long.memory_bytes)} steps")
    decode_ms = 1e3 * (min(longs) - min(starts)) / d
    request_s = min(starts) - min(prefill) - start * decode_ms / 1e3
    kv_read, kv_read_method = _kv_read_per_step(policy, long, np.full(batch, context, np.int32))
    stats = jax.devices()[0].memory_stats()
    return {
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
        "kv_bytes_after_prefill": int(short.memory_bytes[0]),
        "kv_bytes_final": int(long.memory_bytes[-1]),
        "kv_bytes_read_per_step": kv_read,
        "kv_bytes_read_method": kv_read_method,
        **_pool_bytes(long.state),
        "device_peak_bytes": None if not stats else stats.get("peak_bytes_in_use"),
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
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


def row_in_subprocess(argv: list[str], row: dict, limit: int, cfg, args) -> dict:
    """Runs one row in a fresh Python process (`--one`) and parses its JSON line."""
    command = [sys.executable, "-m", "jaxkv.benchmarks.system", *argv, "--one", json.dumps(row)]
    command += ["--memory-limit-gib", str(limit / GIB)]
    done = subprocess.run(command, cwd=CHILD_CWD, capture_output=True, text=True)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(ROW_MARKER):
            return json.loads(line[len(ROW_MARKER) :])
    if done.returncode < 0:  # killed: on a host, most likely by the kernel's OOM killer
        itemsize = ITEMSIZE[args.dtype]
        reason = f"process killed by signal {-done.returncode}, likely out of memory"
        return {
            "error": does_not_fit_message(
                cfg, itemsize, limit, **_cb(row), args=args, reason=reason
            )
        }
    tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
    return {"error": f"subprocess exited with {done.returncode}: " + " | ".join(tail)}


# ------------------------------------------------------------------------- derived columns


def derive(rows: list[dict], cfg, args, bandwidth_gbs: float) -> None:
    """Adds ratios to the full cache of the same (context, batch) and the roofline columns."""
    read_weights = weight_bytes(cfg, ITEMSIZE[args.dtype])["read_per_step"]
    full = {(r["context"], r["batch"]): r for r in rows if r["policy"] == "full" and ok(r)}
    for row in rows:
        if not ok(row):
            continue
        step_bytes = read_weights + row["kv_bytes_read_per_step"]
        row["weight_bytes_read_per_step"] = read_weights
        row["roofline_ms_per_step"] = 1e3 * step_bytes / (bandwidth_gbs * 1e9)
        if row["decode_ms_per_step"] > 0:
            row["fraction_of_roofline"] = row["roofline_ms_per_step"] / row["decode_ms_per_step"]
        base = full.get((row["context"], row["batch"]))
        if base is None:
            continue
        row["prefill_ratio"] = row["prefill_s"] / base["prefill_s"]
        row["decode_ratio"] = row["decode_ms_per_step"] / base["decode_ms_per_step"]
        row["decode_speedup_vs_full"] = base["decode_ms_per_step"] / row["decode_ms_per_step"]
        row["roofline_speedup_vs_full"] = base["roofline_ms_per_step"] / row["roofline_ms_per_step"]
        for key in ("kv_bytes_after_prefill", "kv_bytes_final", "pool_bytes_allocated"):
            row[key.replace("bytes", "ratio")] = row[key] / base[key]


def ok(row: dict) -> bool:
    return "error" not in row


COLUMNS = (
    ("context", "context", "{}"),
    ("batch", "batch", "{}"),
    ("policy", "policy", "{}"),
    ("first call s", "first_call_s", "{:.2f}"),
    ("prefill s", "prefill_s", "{:.3f}"),
    ("prefill x", "prefill_ratio", "{:.2f}"),
    ("request work of prefill", "request_work_of_prefill", "{:.3f}"),
    ("decode ms/step", "decode_ms_per_step", "{:.2f}"),
    ("+- ms", "decode_spread_ms_per_step", "{:.2f}"),
    ("decode x", "decode_ratio", "{:.2f}"),
    ("KV MiB prefill", "kv_bytes_after_prefill", "mib"),
    ("KV MiB end", "kv_bytes_final", "mib"),
    ("KV of full", "kv_ratio_final", "{:.3f}"),
    ("pool MiB", "pool_bytes_allocated", "mib"),
    ("device peak MiB", "device_peak_bytes", "mib"),
    ("host RSS peak MiB", "host_peak_rss_bytes", "mib"),
    ("roofline ms", "roofline_ms_per_step", "{:.3f}"),
    ("of roofline", "fraction_of_roofline", "{:.2f}"),
    ("speed-up", "decode_speedup_vs_full", "{:.2f}"),
    ("roofline speed-up", "roofline_speedup_vs_full", "{:.2f}"),
)


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    return f"{value / MIB:.1f}" if fmt == "mib" else fmt.format(value)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# System benchmark: {report['model']['name']}",
        "",
        f"{env['device']} ({env['host']}), jax {env['jax']}, {report['date']}; "
        f"copy bandwidth {env['bandwidth_gbs']:.1f} GB/s ({env['bandwidth_source']}).",
        "",
        f"`{report['command']}`",
        "",
    ]
    if env["platform"] == "cpu":
        lines += ["**CPU numbers** (no accelerator): times and peaks say little about a GPU.", ""]
    if report.get("note"):
        lines += [report["note"], ""]
    lines += [
        "| " + " | ".join(name for name, _, _ in COLUMNS) + " |",
        "|" + " --- |" * len(COLUMNS),
    ]
    for row in report["rows"]:
        if ok(row):
            cells = [_cell(row, key, fmt) for _, key, fmt in COLUMNS]
        else:
            cells = [str(row["context"]), str(row["batch"]), row["policy"], row["error"]]
            cells += [""] * (len(COLUMNS) - len(cells))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Decode: {report['decode_method']}; +- ms: the two samples' spreads "]
    lines[-1] += "over the decode steps between them."
    lines += ["", report["peak_memory_note"], ""]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device_peak = any(r.get("device_peak_bytes") for r in report["rows"])
    peak_key = "device_peak_bytes" if device_peak else "host_peak_rss_bytes"
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = sorted({(r["policy"], r["batch"]) for r in report["rows"]})
    for policy, batch in series:
        rows = [r for r in report["rows"] if (r["policy"], r["batch"]) == (policy, batch)]
        rows = sorted((r for r in rows if ok(r)), key=lambda r: r["context"])
        if not rows:
            continue
        contexts = [r["context"] for r in rows]
        label = f"{policy} (batch {batch})"
        ax_time.plot(contexts, [r["decode_ms_per_step"] for r in rows], "o-", label=label)
        peaks = [(r.get(peak_key) or np.nan) / MIB for r in rows]
        ax_mem.plot(contexts, peaks, "o-", label=label)
    for ax in (ax_time, ax_mem):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
    ax_time.set_ylabel("decode ms per step (one token per sequence)")
    ax_mem.set_ylabel(("device peak" if device_peak else "host peak RSS") + " MiB")
    if ax_time.lines:
        ax_time.legend(fontsize=7)
    fig.suptitle(f"{report['model']['name']} on {report['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------ main

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    parser.add_argument("--backend", choices=("xla", "pallas", "interpret"), default="xla")
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
    parser.add_argument("--copy-mib", type=int, help="size of the bandwidth copy")
    parser.add_argument("--memory-limit-gib", type=float, help="pretend the device has this")
    parser.add_argument(
        "--skip-fit-check",
        action="store_true",
        help="run rows the (conservative) estimate refuses; the allocator's OOM still reports",
    )
    parser.add_argument(
        "--in-process", action="store_true", help="no subprocesses (peaks are cumulative)"
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
    print(ROW_MARKER + json.dumps(result), flush=True)
    return 0


def _environment(args, argv) -> dict:
    if args.in_process:
        return probe(args)
    result = None
    command = [sys.executable, "-m", "jaxkv.benchmarks.system", *argv, "--probe"]
    done = subprocess.run(command, cwd=CHILD_CWD, capture_output=True, text=True)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(ROW_MARKER):
            result = json.loads(line[len(ROW_MARKER) :])
            break
    if result is None:
        raise SystemExit(f"device probe failed:\n{done.stderr[-3000:]}")
    return result


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
    rows = []
    grid = [
        {"context": c, "batch": b, "policy": p}
        for c in args.contexts
        for b in args.batches
        for p in args.policies
    ]
    for row in tqdm(grid, desc="system benchmark", unit="row"):
        c, b = row["context"], row["batch"]
        estimate = memory_estimate(cfg, itemsize, c, b, args)["total"]
        if estimate > limit and not args.skip_fit_check:
            result = {"error": does_not_fit_message(cfg, itemsize, limit, c, b, args, "estimate")}
        elif args.in_process:
            result = guarded_row(args, cfg, row, limit)
        else:
            result = row_in_subprocess(argv, row, limit, cfg, args)
        rows.append({**row, **result})
    derive(rows, cfg, args, env["bandwidth_gbs"])
    report = {
        "benchmark": "system",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "jaxkv bench system " + " ".join(argv),
        "environment": env,
        "cpu_numbers": env["platform"] == "cpu",
        "model": {
            "name": args.model,
            "config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()},
            "dtype": args.dtype,
            "weight_bytes": weight_bytes(cfg, itemsize)["total"],
            "weights": "random (init_model, seed 0)",
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("one", "probe")},
        "decode_method": DECODE_METHOD,
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
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(text)
    plot(report, str(out.with_suffix(".png")))
    print(text)
    return report


if __name__ == "__main__":
    main()
