"""Launch-parameter sweep of the two kernels on a GPU: which tiles, warps and stages are fastest.

Decode: Llama-3.1-8B shapes at a few (batch, tokens per head), bf16 pages; every combination of
pages per block, warps, stages and split-K target. Prefill: dense causal and 25%-density block
lists at one length, every combination of block_q, block_k, warps and stages. Prints the best
variants per shape and writes every timing as JSON; the defaults in `pallas_kernels` come from it.

    python -m jaxkv.benchmarks.kernel_tuning --out tuning.json    # on a GPU, from the repo root
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
from pathlib import Path

import jax

from jaxkv import pallas_kernels as pk
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.harness import seconds_per_call
from jaxkv.benchmarks.kernel_inputs import FULL, decode_inputs, prefill_lists


def tune_decode(shapes, repeats: int) -> list[dict]:
    rows = []
    grid = itertools.product((4, 8, 16), (4, 8), (2, 3), (256, 1024, 4096))
    variants = [pk.PagedDecodeBlockSizes(ppb, None, None, w, s, t) for ppb, w, s, t in grid]
    for batch, tokens in shapes:
        q, k_pages, v_pages, table, lengths, _ = decode_inputs(
            FULL, batch, tokens, False, jax.random.key(tokens)
        )
        kv_bytes = 2 * k_pages.size * k_pages.dtype.itemsize
        for sizes in variants:
            kernel = jax.jit(
                functools.partial(pk.paged_decode_attention, sm_scale=0.088, block_sizes=sizes)
            )
            try:
                seconds = seconds_per_call(
                    kernel, q, k_pages, v_pages, table, lengths, repeats=repeats
                )
            except Exception as error:  # a variant Triton cannot compile is recorded, not fatal
                rows.append(
                    {
                        "batch": batch,
                        "tokens": tokens,
                        **dataclasses.asdict(sizes),
                        "error": str(error)[:200],
                    }
                )
                continue
            rows.append(
                {
                    "batch": batch,
                    "tokens": tokens,
                    **dataclasses.asdict(sizes),
                    "ms": seconds * 1e3,
                    "gbs": kv_bytes / seconds / 1e9,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def tune_prefill(tokens: int, densities, repeats: int) -> list[dict]:
    keys = jax.random.split(jax.random.key(tokens), 3)
    q = jax.random.normal(keys[0], (1, FULL.heads, tokens, FULL.head_dim), jax.numpy.bfloat16)
    kv_shape = (1, FULL.kv_heads, tokens, FULL.head_dim)
    k, v = (jax.random.normal(key, kv_shape, jax.numpy.bfloat16) for key in keys[1:])
    group = FULL.heads // FULL.kv_heads
    rows = []
    for block_q, block_k, warps, stages in itertools.product(
        (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)
    ):
        sweep = dataclasses.replace(FULL, block_q=block_q, block_k=block_k)
        kernel = jax.jit(
            functools.partial(
                pk.block_sparse_attention,
                sm_scale=0.088,
                block_q=block_q,
                block_k=block_k,
                num_warps=warps,
                num_stages=stages,
            )
        )
        for density in densities:
            idx, cnt, visited = prefill_lists(sweep, tokens, density, seed=tokens)
            row = {
                "tokens": tokens,
                "density": density,
                "block_q": block_q,
                "block_k": block_k,
                "num_warps": warps,
                "num_stages": stages,
            }
            try:
                seconds = seconds_per_call(kernel, q, k, v, idx, cnt, repeats=repeats)
            except Exception as error:
                rows.append({**row, "error": str(error)[:200]})
                continue
            flops = 4 * visited * group * block_q * block_k * FULL.head_dim
            rows.append({**row, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench kernel_tuning", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=16384)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--out", default="tuning.json")
    args = parser.parse_args(argv)
    command = "python -m jaxkv.benchmarks.kernel_tuning"
    report = harness.provenance(command, argv)
    if not args.skip_decode:
        report["decode"] = tune_decode(((1, 32768), (8, 32768), (32, 32768)), args.repeats)
    if not args.skip_prefill:
        report["prefill"] = tune_prefill(args.prefill_tokens, (1.0, 0.25), args.repeats)
    harness.save(Path(args.out).parent, Path(args.out).stem, report)
    for section, key in (("decode", ("batch", "tokens")), ("prefill", ("tokens", "density"))):
        timed = [row for row in report.get(section, ()) if "ms" in row]
        for shape in sorted({tuple(row[k] for k in key) for row in timed}):
            best = sorted(
                (r for r in timed if tuple(r[k] for k in key) == shape), key=lambda r: r["ms"]
            )[:3]
            print(section, shape, *[json.dumps(r) for r in best], sep="\n  ")
    return report


if __name__ == "__main__":
    main()
