"""Decode cost of compressed caches relative to the full cache, measured in one run.

For each policy: KV bytes held after prefill and after generation, and the wall time of a whole
`generate` call (compiled beforehand), each as a ratio to the full cache. Prints a table and
writes JSON. Absolute times from a CPU machine are noise; the ratios are the result.

    jaxkv bench decode --prompt-tokens 2048 --new-tokens 64 --out decode.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

import jaxkv
from jaxkv import policies
from jaxkv.benchmarks import harness
from jaxkv.models import ModelConfig, init_model
from jaxkv.models.configs import Family

CONFIG = ModelConfig(
    family=Family.LLAMA,
    vocab_size=256,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=500000.0,
    max_position_embeddings=65536,
)


def _policies(budget: float) -> dict[str, policies.Policy]:
    return {
        "full": policies.FullCache(),
        "streaming_llm": policies.StreamingLLM(budget=budget),
        "snapkv": policies.SnapKV(budget=budget),
        "h2o": policies.H2O(budget=budget),
        "adakv": policies.AdaKV(inner=policies.SnapKV(), budget=budget),
        "quest": policies.Quest(budget=budget),
    }


def _timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # compile
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        jax.block_until_ready(out.tokens)
        best = min(best, time.perf_counter() - start)
    return best, out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench decode", description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="decode.json")
    args = parser.parse_args(argv)

    model = init_model(CONFIG, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, args.prompt_tokens).tolist() for _ in range(args.batch)]
    rows = {}
    for name, policy in tqdm(_policies(args.budget).items(), desc="decode", unit="policy"):
        seconds, out = _timed(
            lambda policy=policy: jaxkv.generate(
                model, prompts, max_new_tokens=args.new_tokens, policy=policy, stop_tokens=()
            ),
            args.repeats,
        )
        rows[name] = {
            "seconds": seconds,
            "kv_bytes_after_prefill": int(out.memory_bytes[0]),
            "kv_bytes_final": int(out.memory_bytes[-1]),
            "pool_bytes_allocated": int(out.state.pool.k_pages.nbytes * 2),
        }
    full = rows["full"]
    for row in rows.values():
        row["time_ratio"] = row["seconds"] / full["seconds"]
        row["memory_ratio"] = row["kv_bytes_final"] / full["kv_bytes_final"]
        row["pool_ratio"] = row["pool_bytes_allocated"] / full["pool_bytes_allocated"]
    report = {
        **harness.provenance("jaxkv bench decode", argv),
        "config": vars(args),
        "rows": rows,
    }
    print(f"{'policy':<15}{'time ratio':>12}{'KV held ratio':>15}{'pool ratio':>12}")
    for name, row in rows.items():
        print(
            f"{name:<15}{row['time_ratio']:>12.3f}{row['memory_ratio']:>15.3f}"
            f"{row['pool_ratio']:>12.3f}"
        )
    out = Path(args.out)
    harness.save(out.parent, out.stem, report)
    return report


if __name__ == "__main__":
    main()
