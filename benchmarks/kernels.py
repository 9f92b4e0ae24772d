"""Kernel benchmarks: paged decode bandwidth and block-sparse prefill throughput.

Decode: Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, H 128), every (sequence, KV
head) holding `tokens` tokens in randomly placed 16-token pages of one shared pool. Reported: the
bytes of K/V (and int8 scales) the kernel reads over its time, in GB/s and as a fraction of the
device's measured copy bandwidth (bytes read + written by an elementwise op over a large array),
and the speed-up over a dense XLA decode over the same tokens held contiguously (bf16).

Prefill: block lists keeping a random `density` fraction of each KV head's causal blocks (a query
block's own diagonal block always kept). Reported: TFLOP/s of the visited blocks (4 * block_q *
block_k * H flops per listed block and query head) and the speed-up over the dense causal
`jax.nn.dot_product_attention` (cuDNN on a GPU; the implementation used is recorded).

WG-KV prefill: the vertical-slash attention of one chunk to itself
(`jaxkv.attention.vertical_slash_chunk_attention`: band blocks through the block-sparse kernel,
the admitted columns compacted and read by the paged kernel) at admission rates `admission` with
band `window`, against dense causal attention through the same block-sparse kernel and the dense
`jax.nn.dot_product_attention`; `work_fraction` is the share of causal (query, key) pairs the
pattern admits.

Without a GPU the kernels run in the Pallas interpreter; `--quick` shrinks every size so the
script runs end to end anywhere. Interpreted times say nothing about a GPU.

    jaxkv bench kernels --out kernels.json           # on a GPU
    jaxkv bench kernels --quick --out kernels.json   # anywhere
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import attention
from jaxkv import pallas_kernels as pk
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.harness import copy_bandwidth, seconds_per_call
from jaxkv.benchmarks.kernel_inputs import FULL, QUICK, decode_inputs, prefill_lists
from jaxkv.pallas_kernels.paged_decode.ops import offsets_would_wrap


def _dense_decode(q, k, v, sm_scale: float):
    """XLA decode over contiguous keys: q [B, N, H], k, v [B, K, S, H] -> [B, N, H]."""
    b, n, h = q.shape
    qg = q.reshape(b, k.shape[1], -1, h)
    scores = jnp.einsum("bkgh,bksh->bkgs", qg, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores * sm_scale, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgs,bksh->bkgh", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, n, h)


def bench_decode(sweep, batch, tokens, int8, copy_bps, *, interpret, repeats) -> dict:
    row = {"batch": batch, "tokens_per_head": tokens, "pages": "int8" if int8 else "bf16"}
    kv_itemsize = 1 if int8 else 2
    pool_bytes = 2 * batch * sweep.kv_heads * tokens * sweep.head_dim * kv_itemsize
    if pool_bytes > sweep.max_kv_bytes:
        return {**row, "skipped": f"pool of {pool_bytes / 2**30:.0f} GiB > --max-kv-gib"}
    pool = jax.ShapeDtypeStruct((batch * sweep.kv_heads * tokens, sweep.head_dim), jnp.int8)
    if int8 and offsets_would_wrap(pool):
        return {**row, "skipped": "int8 pool in the Triton lowering's int32-offset gap"}
    q, k_pages, v_pages, table, lengths, quant = decode_inputs(
        sweep, batch, tokens, int8, jax.random.key(batch * tokens)
    )
    sm_scale = sweep.head_dim**-0.5
    kernel = jax.jit(
        functools.partial(
            pk.paged_decode_attention, sm_scale=sm_scale, interpret=interpret, **quant
        )
    )
    seconds = seconds_per_call(kernel, q, k_pages, v_pages, table, lengths, repeats=repeats)
    del k_pages, v_pages
    dense_shape = (batch, sweep.kv_heads, tokens, sweep.head_dim)
    dense_keys = jax.random.split(jax.random.key(tokens), 2)
    k_dense, v_dense = (jax.random.normal(key, dense_shape, jnp.bfloat16) for key in dense_keys)
    dense = jax.jit(functools.partial(_dense_decode, sm_scale=sm_scale))
    dense_seconds = seconds_per_call(dense, q, k_dense, v_dense, repeats=repeats)
    scale_bytes = 2 * batch * sweep.kv_heads * tokens * 4 if int8 else 0
    read_bytes = pool_bytes + scale_bytes
    return {
        **row,
        "kernel_ms": seconds * 1e3,
        "dense_xla_ms": dense_seconds * 1e3,
        "kv_bytes_read": read_bytes,
        "achieved_gbs": read_bytes / seconds / 1e9,
        "fraction_of_copy_bandwidth": read_bytes / seconds / copy_bps,
        "speedup_vs_dense": dense_seconds / seconds,
    }


def _dense_attention(implementation):
    def attend(q, k, v, sm_scale):
        return jax.nn.dot_product_attention(
            q, k, v, scale=sm_scale, is_causal=True, implementation=implementation
        )

    return jax.jit(attend, static_argnames="sm_scale")


def bench_prefill(sweep, tokens, densities, *, interpret, repeats) -> list[dict]:
    keys = jax.random.split(jax.random.key(tokens), 3)
    q = jax.random.normal(keys[0], (1, sweep.heads, tokens, sweep.head_dim), jnp.bfloat16)
    kv_shape = (1, sweep.kv_heads, tokens, sweep.head_dim)
    k, v = (jax.random.normal(key, kv_shape, jnp.bfloat16) for key in keys[1:])
    sm_scale = sweep.head_dim**-0.5
    # The dense baseline takes [B, T, N, H].
    q_t, k_t, v_t = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
    try:
        dense_ms = 1e3 * seconds_per_call(
            _dense_attention(implementation), q_t, k_t, v_t, sm_scale, repeats=repeats
        )
        dense = {"dense_ms": dense_ms}
    except (ValueError, NotImplementedError, RuntimeError) as error:
        # Recorded, not replaced: the XLA fallback would materialise T x T scores.
        dense = {"dense_ms": None, "dense_error": f"{type(error).__name__}: {error}"[:300]}
    del q_t, k_t, v_t
    kernel = jax.jit(
        functools.partial(
            pk.block_sparse_attention,
            sm_scale=sm_scale,
            block_q=sweep.block_q,
            block_k=sweep.block_k,
            interpret=interpret,
        )
    )
    group = sweep.heads // sweep.kv_heads
    rows = []
    for density in densities:
        idx, cnt, visited = prefill_lists(sweep, tokens, density, seed=tokens)
        seconds = seconds_per_call(kernel, q, k, v, idx, cnt, repeats=repeats)
        flops = 4 * visited * group * sweep.block_q * sweep.block_k * sweep.head_dim
        row = {
            "tokens": tokens,
            "density": density,
            "visited_blocks": visited,
            "kernel_ms": seconds * 1e3,
            "visited_tflops": flops / seconds / 1e12,
            "dense_implementation": implementation,
            **dense,
        }
        if dense["dense_ms"] is not None:
            row["speedup_vs_dense"] = dense["dense_ms"] / row["kernel_ms"]
        rows.append(row)
    return rows


def _admitted_pairs(admitted: np.ndarray, window: int) -> int:
    """Causal (query, key) pairs with i - j < window or admitted[j], summed over heads."""
    tokens = admitted.shape[-1]
    band = sum(min(window, i + 1) for i in range(tokens))
    # Admitted key j is also seen, outside the band, by the queries i >= j + window.
    outside = np.maximum(tokens - window - np.arange(tokens), 0)
    return int(admitted.shape[0] * band + np.sum(admitted * outside))


def bench_wgkv_prefill(sweep, tokens, *, backend, repeats) -> list[dict]:
    keys = jax.random.split(jax.random.key(tokens + 1), 3)
    q = jax.random.normal(keys[0], (1, sweep.heads, tokens, sweep.head_dim), jnp.bfloat16)
    kv_shape = (1, sweep.kv_heads, tokens, sweep.head_dim)
    k, v = (jax.random.normal(key, kv_shape, jnp.bfloat16) for key in keys[1:])
    positions = jnp.arange(tokens, dtype=jnp.int32)[None]
    sm_scale = sweep.head_dim**-0.5
    dense_kernel = jax.jit(
        functools.partial(attention.causal_attention, sm_scale=sm_scale, backend=backend)
    )
    dense_kernel_ms = 1e3 * seconds_per_call(dense_kernel, q, k, v, repeats=repeats)
    vertical_slash = jax.jit(
        functools.partial(
            attention.vertical_slash_chunk_attention,
            window=sweep.wgkv_window,
            sm_scale=sm_scale,
            backend=backend,
        )
    )
    rng = np.random.default_rng(tokens)
    rows = []
    for rate in sweep.wgkv_admission:
        admitted = rng.random((1, sweep.kv_heads, tokens)) < rate
        seconds = seconds_per_call(
            vertical_slash, q, k, v, positions, jnp.asarray(admitted), repeats=repeats
        )
        pairs = _admitted_pairs(admitted[0], sweep.wgkv_window)
        rows.append(
            {
                "tokens": tokens,
                "window": sweep.wgkv_window,
                "admission": rate,
                "work_fraction": pairs / (sweep.kv_heads * tokens * (tokens + 1) / 2),
                "kernel_ms": seconds * 1e3,
                "dense_kernel_ms": dense_kernel_ms,
                "speedup_vs_dense_kernel": dense_kernel_ms / (seconds * 1e3),
            }
        )
    return rows


def markdown(report: dict) -> str:
    """The report's three tables (decode, block-sparse prefill, WG-KV prefill) in markdown."""
    mode = "Pallas interpreter: times say nothing about a GPU" if report["interpret"] else "kernels"
    lines = [
        "# Kernel benchmark",
        "",
        f"{report['machine']['device']}, jax {report['jax']}, {report['date']}, commit "
        f"{report['commit']}; {mode}. Copy bandwidth {report['copy_bandwidth_gbs']:.1f} GB/s "
        "(bytes read + written by an elementwise op); each time per call is the median over "
        "`--repeats` batches of 10 back-to-back calls after a compiling one.",
        "",
        f"`{report['command']}`",
        "",
        "Paged decode (32 query heads, 8 KV heads x 128, 16-token pages placed at random; "
        "`vs dense`: XLA's dense decode over the same tokens held contiguously, bf16):",
        "",
        "| batch | tokens per head | pages | ms | GB/s | of copy | vs dense |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["decode"]:
        head = f"| {row['batch']} | {row['tokens_per_head']} | {row['pages']} |"
        if "skipped" in row:
            lines.append(f"{head} skipped: {row['skipped']} | | | |")
            continue
        lines.append(
            f"{head} {row['kernel_ms']:.3f} | {row['achieved_gbs']:.1f} | "
            f"{row['fraction_of_copy_bandwidth']:.2f} | {row['speedup_vs_dense']:.2f} |"
        )
    lines += [
        "",
        "Block-sparse prefill (a random `density` of each KV head's causal blocks; TFLOP/s of "
        "the visited blocks; `speed-up` over dense causal `jax.nn.dot_product_attention`):",
        "",
        "| tokens | density | ms | TFLOP/s | dense ms | dense | speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["prefill"]:
        dense = "failed" if row["dense_ms"] is None else f"{row['dense_ms']:.3f}"
        speedup = f"{row['speedup_vs_dense']:.2f}" if "speedup_vs_dense" in row else "-"
        lines.append(
            f"| {row['tokens']} | {row['density']:.2f} | {row['kernel_ms']:.3f} | "
            f"{row['visited_tflops']:.1f} | {dense} | {row['dense_implementation']} | {speedup} |"
        )
    lines += [
        "",
        "WG-KV vertical-slash prefill of one chunk (`work`: the share of causal pairs admitted; "
        "`speed-up` over dense causal attention through the same block-sparse kernel):",
        "",
        "| tokens | admitted | work | ms | dense kernel ms | speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["wgkv_prefill"]:
        lines.append(
            f"| {row['tokens']} | {row['admission']:.2f} | {row['work_fraction']:.2f} | "
            f"{row['kernel_ms']:.3f} | {row['dense_kernel_ms']:.3f} | "
            f"{row['speedup_vs_dense_kernel']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench kernels", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU, interpreter)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-kv-gib", type=float, help="skip decode pools larger than this")
    parser.add_argument("--decode-tokens", type=int, nargs="*", help="tokens per head to sweep")
    parser.add_argument("--batches", type=int, nargs="*", help="decode batch sizes to sweep")
    parser.add_argument("--prefill-tokens", type=int, nargs="*", help="prefill lengths to sweep")
    parser.add_argument("--out", default="kernels.json")
    parser.add_argument("--render", metavar="JSON", help="rewrite the JSON's markdown; no run")
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads(Path(args.render).read_text())
        _save(report, args.render)
        return report
    sweep = QUICK if args.quick else FULL
    overrides = {
        "max_kv_bytes": None if args.max_kv_gib is None else int(args.max_kv_gib * 2**30),
        "decode_tokens": args.decode_tokens,
        "decode_batches": args.batches,
        "prefill_tokens": args.prefill_tokens,
    }
    sweep = dataclasses.replace(
        sweep, **{name: value for name, value in overrides.items() if value is not None}
    )
    interpret = jax.default_backend() != "gpu"
    copy_bps = copy_bandwidth(sweep.copy_bytes, args.repeats)
    report = {
        **harness.provenance("jaxkv bench kernels", argv),
        "interpret": interpret,
        "sweep": dataclasses.asdict(sweep),
        "copy_bandwidth_gbs": copy_bps / 1e9,
        "decode": [],
        "prefill": [],
        "wgkv_prefill": [],
    }
    # Rows are saved as they finish so that a run cut short still leaves its numbers.
    for tokens in sweep.decode_tokens:
        for batch in sweep.decode_batches:
            for int8 in (False, True):
                row = bench_decode(
                    sweep, batch, tokens, int8, copy_bps, interpret=interpret, repeats=args.repeats
                )
                report["decode"].append(row)
                print(json.dumps(row), flush=True)
                _save(report, args.out)
    for tokens in sweep.prefill_tokens:
        rows = bench_prefill(
            sweep, tokens, sweep.densities, interpret=interpret, repeats=args.repeats
        )
        report["prefill"].extend(rows)
        print("\n".join(json.dumps(row) for row in rows), flush=True)
        _save(report, args.out)
        rows = bench_wgkv_prefill(
            sweep, tokens, backend="interpret" if interpret else "pallas", repeats=args.repeats
        )
        report["wgkv_prefill"].extend(rows)
        print("\n".join(json.dumps(row) for row in rows), flush=True)
        _save(report, args.out)
    print(markdown(report))
    return report


def _save(report: dict, path: str) -> None:
    """`path` (JSON) and its markdown beside it."""
    harness.save(Path(path).parent, Path(path).stem, report, markdown(report))


if __name__ == "__main__":
    main()
