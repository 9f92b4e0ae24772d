"""Prefill cost and peak KV memory of Fast KVzip and KVzip against a full-cache prefill.

One run on the reference model: the same held-out contexts are prefilled by `compress_prompt`
with the full cache, Fast KVzip (gated eviction after every chunk) and KVzip (prefill plus the
reconstruction replay). Each is compiled first, then timed `--repeats` times (median). Reported
per policy: seconds, the ratio to the full-cache prefill, the pool array's bytes (the prefill
peak: the whole pool is allocated up front) and the bytes held after compression.

    python -m jaxkv.benchmarks.fastkvzip_prefill --ratio 0.3 --length 2048 --out results/fastkvzip
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxkv import bundled, compress_prompt, policies
from jaxkv.benchmarks import harness
from jaxkv.gates import fastkvzip as gate
from jaxkv.models import load_hf_checkpoint
from jaxkv.train import corpus as corpus_lib

BOS = 256


def _timed(run, repeats: int) -> tuple[float, object]:
    state = run()  # compiles
    jax.block_until_ready(state.pool.k_pages)
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        state = run()
        jax.block_until_ready(state.pool.k_pages)
        seconds.append(time.perf_counter() - began)
    return float(np.median(seconds)), state


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench fastkvzip_prefill", description=__doc__)
    parser.add_argument("--model", type=Path, default=bundled.REFERENCE_MODEL)
    parser.add_argument("--gates", type=Path, default=bundled.FASTKVZIP_GATES)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    model = load_hf_checkpoint(args.model, dtype="float32")
    params = gate.load_safetensors(args.gates / "gates.safetensors", model.config)
    corpus = corpus_lib.load_corpus("heldout")
    rng = np.random.default_rng(0)
    prompts = [[BOS, *corpus.text(rng, args.length - 1)] for _ in range(args.batch)]
    runs = {
        "full": (policies.FullCache(), None),
        "fastkvzip": (policies.FastKVzip(ratio=args.ratio), params),
        "kvzip": (policies.KVzip(ratio=args.ratio), None),
    }
    rows = []
    for name, (policy, policy_params) in runs.items():
        seconds, state = _timed(
            lambda p=policy, pp=policy_params: compress_prompt(model, prompts, p, policy_params=pp),
            args.repeats,
        )
        rows.append(
            {
                "policy": name,
                "seconds": seconds,
                "pool_bytes": state.pool.num_pages * state.pool.page_bytes // args.batch,
                "held_bytes": state.memory_bytes() // args.batch,
            }
        )
    full = rows[0]
    for row in rows:
        row["time_vs_full"] = row["seconds"] / full["seconds"]
        row["pool_vs_full"] = row["pool_bytes"] / full["pool_bytes"]
    report = {
        **harness.provenance(
            "jaxkv bench fastkvzip_prefill", sys.argv[1:] if argv is None else argv
        ),
        "ratio": args.ratio,
        "length": args.length,
        "batch": args.batch,
        "device": jax.devices()[0].device_kind,
        "rows": rows,
    }
    print("| policy | prefill s | vs full | pool KiB/seq (peak) | vs full | held KiB/seq |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        pool, held = r["pool_bytes"] / 1024, r["held_bytes"] / 1024
        print(
            f"| {r['policy']} | {r['seconds']:.2f} | {r['time_vs_full']:.2f} | "
            f"{pool:.0f} | {r['pool_vs_full']:.2f} | {held:.0f} |"
        )
    if args.out:
        harness.save(args.out, "prefill", report)
    return report


if __name__ == "__main__":
    main()
