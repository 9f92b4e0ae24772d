"""Fast KVzip's decode-time eviction over a long read: perplexity vs the full cache and H2O.

Each held-out text's first `--prefix` bytes are prefilled (Fast KVzip evicts after every prefill
chunk), then `--continuation` bytes are read token by token with every policy's decode hook after
each token (`jaxkv.benchmarks.teacher_forced`): Fast KVzip gates each token as it is
written and every 128 steps evicts back to its ratio of the current length (first 4 and newest
128 kept). H2O runs at the tokens per head Fast KVzip held on average (equal memory). Prints a
table and writes JSON.

    PYTHONPATH=$PWD python -m jaxkv.benchmarks.fastkvzip_decode --out results/fastkvzip
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from jaxkv import bundled, policies
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.confkv_settings import Settings
from jaxkv.benchmarks.teacher_forced import SEED, byte_rows, teacher_forced
from jaxkv.gates import fastkvzip as fastkvzip_gate
from jaxkv.models import load_hf_checkpoint
from jaxkv.train import corpus as corpus_lib


def run(model, gates, texts, settings: Settings, ratio: float, log=print) -> dict:
    ids, prefill = byte_rows(texts), settings.prefix + 1

    def read(policy, policy_params=None):
        return teacher_forced(
            model,
            policy,
            ids,
            prefill,
            settings.continuation,
            settings.bins,
            policy_params=policy_params,
        )

    results = {"full": read(policies.FullCache())}
    log("full", results["full"]["bits_per_token"])
    results["fastkvzip"] = read(policies.FastKVzip(ratio=ratio), gates)
    matched = max(int(round(results["fastkvzip"]["tokens_per_head"])), 1)
    log("fastkvzip", results["fastkvzip"]["bits_per_token"], "tokens/head", matched)
    results["h2o"] = read(policies.H2O(budget=matched, recent=settings.protected))
    log("h2o", results["h2o"]["bits_per_token"])
    for result in results.values():
        result.pop("trace")
    return {"ratio": ratio, "matched_tokens_per_head": matched, "policies": results}


def table(report: dict) -> str:
    full = report["policies"]["full"]
    lines = [
        "| policy | bpb | bpb - full | tokens/head | KV KiB/seq (mean over steps) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, result in report["policies"].items():  # byte-level: bits per token are per byte
        lines.append(
            f"| {name} | {result['bits_per_token']:.3f} | "
            f"{result['bits_per_token'] - full['bits_per_token']:+.3f} | "
            f"{result['tokens_per_head']:.0f} | {result['kv_bytes_per_sequence'] / 1024:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench fastkvzip_decode", description=__doc__)
    parser.add_argument("--model", type=Path, default=bundled.REFERENCE_MODEL)
    parser.add_argument("--gates", type=Path, default=bundled.FASTKVZIP_GATES / "gates.safetensors")
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
    command = harness.provenance("python -m jaxkv.benchmarks.fastkvzip_decode", argv)
    report = {**command, **run(model, gates, texts, settings, args.ratio)}
    report["settings"] = vars(args) | {"model": str(args.model), "gates": str(args.gates)}
    text = table(report)
    harness.save(args.out, "decode", report, text)
    print(text)
    return report


if __name__ == "__main__":
    main()
