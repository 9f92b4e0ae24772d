"""Prefill cost and peak KV memory of Fast KVzip and KVzip against a full-cache prefill.

One run on a model (the reference model by default; `--model` takes what `jaxkv generate
--model` takes): the same contexts are prefilled by `compress_prompt` with the full cache, Fast
KVzip (gated eviction after every chunk, with the gates jaxkv ships for the model or `--gates`)
and KVzip (prefill plus the reconstruction replay). Each is called once (compile and run,
`first_seconds`), then timed `--repeats` times (median). Reported per policy: seconds, the ratio
to the full-cache prefill, the pool array's bytes (the prefill peak: the whole pool is
allocated up front) and the bytes held after compression.

    python -m jaxkv.benchmarks.fastkvzip_prefill --ratio 0.3 --length 2048 --out results/fastkvzip
    python -m jaxkv.benchmarks.fastkvzip_prefill --model smollm2-135m-instruct --length 31 \
        --batch 1 --out results/fastkvzip/smollm2-31
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np

from jaxkv import bundled, compress_prompt, policies
from jaxkv.benchmarks import harness
from jaxkv.model_sources import load_model, shipped_name
from jaxkv.train import corpus as corpus_lib


def _timed(run, repeats: int) -> tuple[float, float, object]:
    """(seconds of the first call, compile included; median seconds of `repeats` more; the
    state)."""
    seconds = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        state = run()
        jax.block_until_ready(state.pool.k_pages)
        seconds.append(time.perf_counter() - began)
    return seconds[0], float(np.median(seconds[1:])), state


def _prompt(tokenizer, corpus, rng, length: int) -> list[int]:
    """`length` token ids of held-out text (the tokenizer's bos first, if it writes one)."""
    ids = tokenizer.encode(corpus.text(rng, 8 * length).decode(errors="ignore"))
    return ids[:length]


def _gates(path: Path | None, model_arg: str, model_config):
    """Fast KVzip's gates: `path`, or those jaxkv ships for the model (a named error else)."""
    part = policies.FastKVzip().params
    path = part.shipped_path(shipped_name(model_arg)) if path is None else path
    if path is None:
        raise ValueError(f"jaxkv ships no Fast KVzip gates for --model {model_arg}: give --gates")
    return part.load(path, model_config)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench fastkvzip_prefill", description=__doc__)
    parser.add_argument("--model", default=str(bundled.REFERENCE_MODEL))
    parser.add_argument("--gates", type=Path, default=None)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, "float32")
    params = _gates(args.gates, args.model, model.config)
    corpus = corpus_lib.load_corpus("heldout")
    rng = np.random.default_rng(0)
    prompts = [_prompt(tokenizer, corpus, rng, args.length) for _ in range(args.batch)]
    runs = {
        "full": (policies.FullCache(), None),
        "fastkvzip": (policies.FastKVzip(ratio=args.ratio), params),
        "kvzip": (policies.KVzip(ratio=args.ratio).for_tokenizer(tokenizer), None),
    }
    rows = []
    for name, (policy, policy_params) in runs.items():
        first, seconds, state = _timed(
            lambda p=policy, pp=policy_params: compress_prompt(model, prompts, p, policy_params=pp),
            args.repeats,
        )
        rows.append(
            {
                "policy": name,
                "first_seconds": first,
                "seconds": seconds,
                "pool_bytes": state.pool.num_pages * state.pool.page_bytes // args.batch,
                "held_bytes": state.memory_bytes() // args.batch,
            }
        )
    full = rows[0]
    for row in rows:
        row["time_vs_full"] = row["seconds"] / full["seconds"]
        row["first_vs_full"] = row["first_seconds"] / full["first_seconds"]
        row["pool_vs_full"] = row["pool_bytes"] / full["pool_bytes"]
    report = {
        **harness.provenance("jaxkv bench fastkvzip_prefill", argv),
        "model": args.model,
        "ratio": args.ratio,
        "length": args.length,
        "batch": args.batch,
        "device": jax.devices()[0].device_kind,
        "rows": rows,
    }
    print(
        "| policy | first call s | vs full | prefill s | vs full | pool KiB/seq (peak) | vs full "
        "| held KiB/seq |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        pool, held = r["pool_bytes"] / 1024, r["held_bytes"] / 1024
        print(
            f"| {r['policy']} | {r['first_seconds']:.2f} | {r['first_vs_full']:.2f} | "
            f"{r['seconds']:.2f} | {r['time_vs_full']:.2f} | {pool:.0f} | "
            f"{r['pool_vs_full']:.2f} | {held:.0f} |"
        )
    if args.out:
        harness.save(args.out, "prefill", report)
    return report


if __name__ == "__main__":
    main()
