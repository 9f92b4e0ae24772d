"""DuoAttention retrieval heads for a model, picked on general text instead of on each prompt.

DuoAttention ("DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
Heads", arXiv:2410.10819) keeps the whole cache in its retrieval heads and only sinks plus a
recent window in the others; the paper finds those heads by optimisation on synthetic passkey
retrieval. Here nothing is trained: each (layer, KV head) gets a calibration score from full
causal attention over contexts of the corpus's train split in the model's ids (opened as
`jaxkv train fastkvzip`'s are; `--text docstrings`: only the English docstrings), and the
`--share` of all pairs with the highest score become retrieval heads
(`policies.retrieval_heads`). Two scores (`--score`):

  copy  each context's text is cut to half its length and repeated; a query in the repeat puts
        the score on the key that follows its own token's first occurrence, the next token it
        would copy (far outside the window): the copy-paste behaviour of retrieval heads
        ("Retrieval Head Mechanistically Explains Long-Context Factuality", arXiv:2404.15574).
  mass  the attention mass a query gives to keys outside sinks + window
        (`policies.long_range_attention_mass`, what `duo_attention` picks on a prompt).

Writes heads.npy (bool [L, K], what `--params duo_attention=PATH` and
`RetrievalHeads.load` read) and run.json (the command, every head's score, seconds).

    jaxkv train duo_attention --model smollm2-135m-instruct --share 0.2 \
        --out assets/duo-heads/smollm2-135m-instruct/copy-0.2
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxkv import policies
from jaxkv.model_sources import load_model, model_file_sha256
from jaxkv.policies.kvzip import context_prefix_ids
from jaxkv.provenance import provenance as run_provenance
from jaxkv.train.calibration import calibration_parser, calibration_rows, check_counts
from jaxkv.train.fastkvzip import TRAIN_SEED

SCORES = ("copy", "mass")


def repeated_halves(rows: list[list[int]], prefix: int) -> tuple[np.ndarray, int]:
    """int32 [B, prefix + 2n] rows whose text (after `prefix` tokens) is its first n tokens twice,
    n = half the text; and n, the distance from a repeated token back to its first occurrence."""
    half = (len(rows[0]) - prefix) // 2
    repeated = [r[: prefix + half] + r[prefix : prefix + half] for r in rows]
    return np.asarray(repeated, np.int32), half


def copy_pairs(prefix: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys bool [T, T], queries bool [T]) of `repeated_halves`' rows, T = prefix + 2 half: each
    query in the repeat (but its last) and the key after its token's first occurrence."""
    t = prefix + 2 * half
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    queries = (np.arange(t) >= prefix + half) & (np.arange(t) < t - 1)
    return (j == i - half + 1) & queries[:, None], queries


def calibration_scores(
    model, rows: list[list[int]], *, score: str, prefix: int, sinks: int, window: int, batch: int
) -> np.ndarray:
    """f32 [L, K]: the `score` (see the module) averaged over the rows, `batch` rows a pass (all
    rows of one length, their first `prefix` tokens what precedes the text)."""
    if score == "copy":
        tokens, half = repeated_halves(rows, prefix)
        keys, queries = copy_pairs(prefix, half)

        def one_pass(batch_tokens):
            return policies.attention_mass(model, batch_tokens, keys, queries)
    else:
        tokens = np.asarray(rows, np.int32)

        def one_pass(batch_tokens):
            return policies.long_range_attention_mass(
                model, batch_tokens, sinks=sinks, window=window
            )

    total = np.zeros((model.config.num_layers, model.config.num_kv_heads))
    starts = range(0, len(tokens), batch)
    for start in tqdm(starts, desc=f"duo_attention {score} scores", unit="batch", disable=None):
        rows_now = tokens[start : start + batch]
        total += np.asarray(one_pass(jnp.asarray(rows_now)), np.float64) * len(rows_now)
    return (total / len(tokens)).astype(np.float32)


def _check_arguments(args: argparse.Namespace) -> None:
    if not 0 < args.share < 1:
        raise ValueError(f"--share {args.share}: the share of retrieval heads, in (0, 1)")
    check_counts(args, "--contexts", "--context-batch")
    if args.sinks < 0 or args.window < 1:
        raise ValueError(f"--sinks {args.sinks} must be >= 0 and --window {args.window} >= 1")
    if args.length <= args.sinks + args.window:
        raise ValueError(
            f"--length {args.length} must exceed --sinks + --window = {args.sinks + args.window}"
        )


def main(argv=None) -> dict:
    parser = calibration_parser(
        "duo_attention", __doc__, "heads.npy + run.json", contexts=16, length=2048
    )
    defaults = policies.DuoAttention()
    parser.add_argument("--score", choices=SCORES, default="copy", help="see above")
    parser.add_argument(
        "--share", type=float, default=defaults.params.share, help="retrieval heads, in (0, 1)"
    )
    parser.add_argument("--sinks", type=int, default=defaults.sinks, help="as the policy's")
    parser.add_argument("--window", type=int, default=defaults.window, help="as the policy's")
    args = parser.parse_args(argv)
    _check_arguments(args)

    model, tokenizer = load_model(args.model, dtype="float32")
    prefix = len(context_prefix_ids(tokenizer))
    if args.score == "copy" and (args.length - prefix) // 2 <= args.window:
        raise ValueError(
            f"--length {args.length}: the copy score repeats half of the {args.length - prefix} "
            f"tokens after the prompt's opening, a distance that must exceed --window {args.window}"
        )
    rows = calibration_rows(args, tokenizer)
    began = time.perf_counter()
    scores = calibration_scores(
        model,
        rows,
        score=args.score,
        prefix=prefix,
        sinks=args.sinks,
        window=args.window,
        batch=args.context_batch,
    )
    heads = policies.retrieval_heads(scores, args.share)
    summary = {
        **run_provenance("jaxkv train duo_attention", argv),
        "model": args.model,
        "model_file_sha256": model_file_sha256(args.model),
        "score": args.score,
        "share": args.share,
        "contexts": args.contexts,
        "length": args.length,
        "text": args.text,
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
