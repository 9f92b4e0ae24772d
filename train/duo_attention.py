"""DuoAttention retrieval heads for a model, picked on general text instead of on each prompt.

DuoAttention ("DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
Heads", arXiv:2410.10819) keeps the whole cache in its retrieval heads and only sinks plus a
recent window in the others. Here a head's calibration score is the attention mass its queries
give to keys outside sinks + window under full causal attention
(`policies.long_range_attention_mass`), averaged over contexts of the corpus's train split in the
model's ids (opened as `jaxkv train fastkvzip`'s are); the `--share` of all (layer, KV head)
pairs with the highest score become retrieval heads (`policies.retrieval_heads`). Nothing is
trained: one forward pass a context. Writes heads.npy (bool [L, K], what `--params
duo_attention=PATH` and `DuoAttention.load_params` read) and run.json (the command, every
head's score, seconds).

    jaxkv train duo_attention --model smollm2-135m-instruct --share 0.2 \
        --out assets/duo-heads/smollm2-135m-instruct/share-0.2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxkv import bundled, policies
from jaxkv.model_sources import load_model, model_file_sha256
from jaxkv.train.fastkvzip import TRAIN_SEED, contexts


def calibration_scores(model, token_rows: list[list[int]], *, sinks: int, window: int, batch: int):
    """f32 [L, K]: `long_range_attention_mass` averaged over the rows, `batch` rows a pass (all
    rows of one length)."""
    passes = [
        np.asarray(
            policies.long_range_attention_mass(
                model, jnp.asarray(token_rows[i : i + batch], jnp.int32), sinks=sinks, window=window
            ),
            np.float64,
        )
        * len(token_rows[i : i + batch])
        for i in range(0, len(token_rows), batch)
    ]
    return (np.sum(passes, axis=0) / len(token_rows)).astype(np.float32)


def _check_arguments(args: argparse.Namespace) -> None:
    if not 0 < args.share < 1:
        raise ValueError(f"--share {args.share}: the share of retrieval heads, in (0, 1)")
    for option, value in (("--contexts", args.contexts), ("--context-batch", args.context_batch)):
        if value < 1:
            raise ValueError(f"{option} {value} must be >= 1")
    if args.sinks < 0 or args.window < 1:
        raise ValueError(f"--sinks {args.sinks} must be >= 0 and --window {args.window} >= 1")
    if args.length <= args.sinks + args.window:
        raise ValueError(
            f"--length {args.length} must exceed --sinks + --window = {args.sinks + args.window}"
        )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="jaxkv train duo_attention", description=__doc__)
    parser.add_argument(
        "--model",
        default=str(bundled.REFERENCE_MODEL),
        help="a checkpoint directory, a .gguf file or a fetched model's name (jaxkv fetch)",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for heads.npy + run.json"
    )
    parser.add_argument("--share", type=float, default=0.25, help="retrieval heads, in (0, 1)")
    parser.add_argument("--contexts", type=int, default=16, help="calibration contexts")
    parser.add_argument("--length", type=int, default=2048, help="tokens per context")
    parser.add_argument("--context-batch", type=int, default=2)
    defaults = policies.DuoAttention()
    parser.add_argument("--sinks", type=int, default=defaults.sinks, help="as the policy's")
    parser.add_argument("--window", type=int, default=defaults.window, help="as the policy's")
    args = parser.parse_args(argv)
    _check_arguments(args)

    model, tokenizer = load_model(args.model, dtype="float32")
    rows = contexts("train", args.contexts, args.length, TRAIN_SEED, tokenizer)
    began = time.perf_counter()
    scores = calibration_scores(
        model, rows, sinks=args.sinks, window=args.window, batch=args.context_batch
    )
    heads = policies.retrieval_heads(scores, args.share)
    summary = {
        "command": "jaxkv train duo_attention " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "model_file_sha256": model_file_sha256(args.model),
        "share": args.share,
        "contexts": args.contexts,
        "length": args.length,
        "sinks": args.sinks,
        "window": args.window,
        "seed": TRAIN_SEED,
        "retrieval_heads": int(heads.sum()),
        "retrieval_heads_per_layer": heads.sum(axis=1).tolist(),
        "scores": scores.tolist(),
        "seconds": time.perf_counter() - began,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / "heads.npy", heads)
    (args.out / "run.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "scores"}, indent=2))
    return summary
