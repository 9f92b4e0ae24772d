"""ExpectedAttention's query statistics for a model, from the queries of calibration text.

kvpress's ExpectedAttentionStatsPress scores keys with a Gaussian of each query head's
pre-RoPE queries fitted once on a dataset, instead of on each prompt (`expected_attention`).
Nothing is trained: contexts of the corpus's train split in the model's ids (opened as `jaxkv
train fastkvzip`'s are; `--text docstrings`: only the English docstrings) run through the model
under full causal attention, and every query past each context's first `--sinks` positions
counts towards its (layer, query head)'s mean and unbiased covariance, as kvpress's script
computes them.

Writes statistics.npz (query_mean f32 [L, N, H], query_covariance f32 [L, N, H, H]: what
`--params expected_attention_stats=PATH` and `QueryStatistics.load` read) and run.json (the
command, the model's digest, the queries counted, seconds).

    jaxkv train expected_attention_stats --model smollm2-135m-instruct \
        --out assets/query-statistics/smollm2-135m-instruct/source-8x1024
"""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxkv import policies
from jaxkv.model_sources import load_model, model_file_sha256
from jaxkv.policies.calibration import layer_queries
from jaxkv.policies.expected_attention import STATISTICS_FILE
from jaxkv.provenance import provenance as run_provenance
from jaxkv.train.calibration import calibration_parser, calibration_rows, check_counts
from jaxkv.train.fastkvzip import TRAIN_SEED


def query_statistics(model, rows: list[list[int]], sinks: int, batch: int):
    """(mean f32 [L, N, H], unbiased covariance f32 [L, N, H, H], queries counted per head) of
    the pre-RoPE queries past the first `sinks` positions of every row, `batch` rows a pass."""
    tokens = np.asarray(rows, np.int32)
    count, total, outer = 0, 0.0, 0.0
    starts = range(0, len(tokens), batch)
    for start in tqdm(starts, desc="query statistics", unit="batch", disable=None):
        queries = layer_queries(model, jnp.asarray(tokens[start : start + batch]), rotated=False)
        counted = np.asarray(queries, np.float64)[:, :, :, sinks:]  # [L, b, N, T - sinks, H]
        count += counted.shape[1] * counted.shape[3]
        total = total + counted.sum(axis=(1, 3))
        outer = outer + np.einsum("lbnth,lbntg->lnhg", counted, counted)
    mean = total / count
    covariance = (outer - count * mean[..., :, None] * mean[..., None, :]) / (count - 1)
    return mean.astype(np.float32), covariance.astype(np.float32), count


def main(argv=None) -> dict:
    parser = calibration_parser(
        "expected_attention_stats", __doc__, "statistics.npz + run.json", contexts=8, length=1024
    )
    parser.add_argument(
        "--sinks",
        type=int,
        default=policies.ExpectedAttentionStats().sinks,
        help="each context's first positions left out (the policy's sinks)",
    )
    args = parser.parse_args(argv)
    check_counts(args, "--contexts", "--length", "--context-batch")
    if not 0 <= args.sinks < args.length - 1:
        raise ValueError(
            f"--sinks {args.sinks} must lie in [0, --length - 1) = [0, {args.length - 1})"
        )

    model, tokenizer = load_model(args.model, dtype="float32")
    rows = calibration_rows(args, tokenizer)
    began = time.perf_counter()
    mean, covariance, count = query_statistics(model, rows, args.sinks, args.context_batch)
    summary = {
        **run_provenance("jaxkv train expected_attention_stats", argv),
        "model": args.model,
        "model_file_sha256": model_file_sha256(args.model),
        "contexts": args.contexts,
        "length": args.length,
        "sinks": args.sinks,
        "text": args.text,
        "seed": TRAIN_SEED,
        "queries_per_head": count,
        "queries": "before RoPE",
        "seconds": time.perf_counter() - began,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / STATISTICS_FILE, query_mean=mean, query_covariance=covariance)
    (args.out / "run.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary
