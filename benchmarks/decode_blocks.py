"""The quality cost of evicting in blocks during decode (`evict_every`) on the reference model.

Decode-time eviction runs every `evict_every` steps (default 32) instead of at every step, so
that its compaction is amortised; in between, heads hold up to that many tokens more. This
measures what that changes: bits per byte of a teacher-forced read with the policy's decode hook
(the Conf-KV benchmark's reader: prefix prefilled, continuation read token by token), per policy
and block size, and the mean tokens held per head.

    jaxkv bench decode_blocks [--quick] [--out results/decode-blocks]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxkv import bundled, policies
from jaxkv.benchmarks import harness
from jaxkv.benchmarks.confkv_settings import QUICK, Settings
from jaxkv.benchmarks.teacher_forced import SEED, byte_rows, teacher_forced
from jaxkv.models import load_hf_checkpoint
from jaxkv.train import corpus as corpus_lib

REFERENCE_MODEL = bundled.REFERENCE_MODEL
BLOCKS = (1, 8, 32)


def block_policies(s: Settings, evict_every: int) -> dict[str, policies.Policy]:
    """The decode-evicting policies at the Conf-KV benchmark's budgets, evicting in blocks."""
    return {
        "h2o": policies.H2O(budget=s.tight, recent=s.protected, evict_every=evict_every),
        "streaming_llm": policies.StreamingLLM(budget=s.tight, evict_every=evict_every),
        "confkv": policies.ConfKV(
            tight=s.tight, loose=s.loose, protected=s.protected, evict_every=evict_every
        ),
    }


def run(model, texts: list[bytes], s: Settings, blocks=BLOCKS) -> dict:
    ids = byte_rows(texts)

    def read(policy):
        return teacher_forced(model, policy, ids, s.prefix + 1, s.continuation, s.bins)

    rows = {"full": read(policies.FullCache())}
    jobs = [(n, name, p) for n in blocks for name, p in block_policies(s, n).items()]
    for evict_every, name, policy in tqdm(jobs, desc="decode blocks", unit="run"):
        rows[f"{name}/every-{evict_every}"] = read(policy)
    summary = {}
    for key, result in rows.items():
        name = key.split("/")[0]
        per_step = rows.get(f"{name}/every-1", result)
        summary[key] = {
            "bits_per_byte": result["bits_per_token"],  # byte-level: a token is a byte
            "delta_vs_every_step": result["bits_per_token"] - per_step["bits_per_token"],
            "tokens_per_head": result["tokens_per_head"],
        }
    return summary


def table(summary: dict, texts: int, s: Settings) -> str:
    lines = [
        f"Teacher-forced read of {s.continuation} bytes after a {s.prefix}-byte prefix, "
        f"{texts} held-out texts, reference model (CPU).",
        "",
        "| policy / block | bits per byte | change vs every step | tokens per head (mean) |",
        "| --- | --- | --- | --- |",
    ]
    for key, row in summary.items():
        lines.append(
            f"| {key} | {row['bits_per_byte']:.4f} | {row['delta_vs_every_step']:+.4f} | "
            f"{row['tokens_per_head']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv bench decode_blocks", description=__doc__)
    parser.add_argument("--model", type=Path, default=REFERENCE_MODEL)
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny settings (tests)")
    parser.add_argument("--out", type=Path, default=Path("results/decode-blocks"))
    args = parser.parse_args(argv)
    s = QUICK if args.quick else Settings()
    model = load_hf_checkpoint(args.model, dtype="float32")
    heldout = corpus_lib.load_corpus("heldout")
    rng = np.random.default_rng([SEED, 7])
    texts = [heldout.text(rng, s.prefix + s.continuation + 1) for _ in range(args.texts)]
    summary = run(model, texts, s)
    report = {
        **harness.provenance("jaxkv bench decode_blocks", argv),
        "settings": dataclasses.asdict(s),
        "texts": args.texts,
        "results": summary,
    }
    text = table(summary, args.texts, s)
    harness.save(args.out, "decode_blocks", report, text)
    print(text)
    return report


if __name__ == "__main__":
    main()
