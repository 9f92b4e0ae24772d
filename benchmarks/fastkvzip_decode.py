"""Fast KVzip's decode-time eviction over a long read: perplexity vs the full cache and H2O.

Each held-out text's first `--prefix` bytes are prefilled (Fast KVzip evicts after every prefill
chunk), then `--continuation` bytes are read token by token with every policy's decode hook after
each token (`jaxkv.benchmarks.confkv.teacher_forced`): Fast KVzip gates each token as it is
written and every 128 steps evicts back to its ratio of the current length (first 4 and newest
128 kept). H2O runs at the tokens per head Fast KVzip held on average (equal memory). Prints a
table and writes JSON.

    PYTHONPATH=$PWD python -m jaxkv.benchmarks.fastkvzip_decode --out results/fastkvzip
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from jaxkv import policies
from jaxkv.benchmarks.confkv import REFERENCE_MODEL, SEED, Settings, teacher_forced
from jaxkv.benchmarks.quality import FASTKVZIP_GATES
from jaxkv.gates import fastkvzip as fastkvzip_gate
from jaxkv.models import load_hf_checkpoint
from jaxkv.train import corpus as corpus_lib


def run(model, gates, texts, settings: Settings, ratio: float, log=print) -> dict:
    results = {"full": teacher_forced(model, policies.FullCache(), texts, settings)}
    log("full", results["full"]["bits_per_byte"])
    fast = policies.FastKVzip(ratio=ratio)
    results["fastkvzip"] = teacher_forced(model, fast, texts, settings, policy_params=gates)
    matched = max(int(round(results["fastkvzip"]["tokens_per_head"])), 1)
    log("fastkvzip", results["fastkvzip"]["bits_per_byte"], "tokens/head", matched)
    h2o = policies.H2O(budget=matched, recent=settings.protected)
    results["h2o"] = teacher_forced(model, h2o, texts, settings)
    log("h2o", results["h2o"]["bits_per_byte"])
    for result in results.values():
        result.pop("trace")
    return {"ratio": ratio, "matched_tokens_per_head": matched, "policies": results}


def table(report: dict) -> str:
    full = report["policies"]["full"]
    lines = [
        "| policy | bpb | bpb - full | tokens/head | KV KiB/seq (mean over steps) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, result in report["policies"].items():
        lines.append(
            f"| {name} | {result['bits_per_byte']:.3f} | "
            f"{result['bits_per_byte'] - full['bits_per_byte']:+.3f} | "
            f"{result['tokens_per_head']:.0f} | {result['kv_bytes_per_sequence'] / 1024:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m jaxkv.benchmarks.fastkvzip_decode", description=__doc__
    )
    parser.add_argument("--model", type=Path, default=REFERENCE_MODEL)
    parser.add_argument("--gates", type=Path, default=FASTKVZIP_GATES / "gates.safetensors")
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--prefix", type=int, default=512, help="bytes prefilled")
    parser.add_argument("--continuation", type=int, default=1024, help="bytes read after")
    parser.add_argument("--texts", type=int, default=2)
    parser.add_argument("--protected", type=int, default=64, help="H2O's recent window")
    parser.add_argument("--out", type=Path, default=Path("results/fastkvzip"))
    args = parser.parse_args(argv)
    model = load_hf_checkpoint(args.model, dtype="float32")
    gates = fastkvzip_gate.load_safetensors(args.gates, model.config)
    settings = dataclasses.replace(
        Settings(),
        prefix=args.prefix,
        continuation=args.continuation,
        texts=args.texts,
        protected=args.protected,
        bins=4,
    )
    heldout = corpus_lib.load_corpus("heldout")
    generator = np.random.default_rng([SEED, 1])
    length = args.prefix + args.continuation + 1
    texts = [heldout.text(generator, length) for _ in range(args.texts)]
    report = run(model, gates, texts, settings, args.ratio)
    report["settings"] = vars(args) | {"model": str(args.model), "gates": str(args.gates)}
    report["jax"] = jax.__version__
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(report, default=str) + "\n")
    text = table(report)
    (args.out / "decode.md").write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
