"""Q-Filters for a model: each (layer, KV head)'s filter from the queries of calibration text.

Q-Filters ("Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression",
arXiv:2503.02812) scores a key by its projection on the direction most queries of its head
point along. Nothing is trained: contexts of the corpus's train split in the model's ids (opened
as `jaxkv train fastkvzip`'s are; `--text docstrings`: only the English docstrings) run through
the model under full causal attention, `--samples` of their tokens (drawn with the seed) give
each layer's queries after RoPE, and `policies.qfilter.query_filters` turns them into filters
(per query head the first right singular vector, oriented and negated as kvpress stores it,
averaged over the KV head's group).

Writes filters.npy (f32 [L, K, H], what `--params qfilter=PATH` and `QueryFilters.load` read)
and run.json (the command, the model's digest, the share of each head's query energy along its
direction, seconds).

    jaxkv train qfilter --model smollm2-135m-instruct \
        --out assets/q-filters/smollm2-135m-instruct/source-8x1024
"""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxkv.model_sources import load_model, model_file_sha256
from jaxkv.policies.calibration import layer_queries
from jaxkv.policies.qfilter import FILTERS_FILE, query_filters
from jaxkv.provenance import provenance as run_provenance
from jaxkv.train.calibration import calibration_parser, calibration_rows, check_counts
from jaxkv.train.fastkvzip import TRAIN_SEED


def sampled_queries(model, rows: list[list[int]], samples: int, batch: int, seed: int):
    """f32 [L, N, samples, H]: the queries after RoPE of `samples` tokens drawn (without
    replacement, with `seed`) from every row's tokens, `batch` rows a pass."""
    tokens = np.asarray(rows, np.int32)
    total = tokens.size
    if samples > total:
        raise ValueError(f"--samples {samples} exceeds the {total} calibration tokens")
    drawn = np.sort(np.random.default_rng(seed).choice(total, samples, replace=False))
    row_of, position_of = np.divmod(drawn, tokens.shape[1])
    parts = []
    starts = range(0, len(tokens), batch)
    for start in tqdm(starts, desc="qfilter queries", unit="batch", disable=None):
        rows_now = (row_of >= start) & (row_of < start + batch)
        batch_tokens = jnp.asarray(tokens[start : start + batch])
        queries = np.asarray(layer_queries(model, batch_tokens, rotated=True))
        # queries [L, b, N, T, H]; the drawn tokens' [n, L, N, H] (advanced indices first)
        picked = queries[:, row_of[rows_now] - start, :, position_of[rows_now]]
        parts.append(np.transpose(picked, (1, 2, 0, 3)))
    return np.concatenate(parts, axis=2)


def direction_share(queries: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """f32 [L, K]: the share of each KV head's query energy along its filter's direction
    (queries [L, N, T, H]): how anisotropic the queries the filter summarises are."""
    num_layers, num_heads = queries.shape[:2]
    k = filters.shape[1]
    grouped = queries.reshape(num_layers, k, num_heads // k, -1, queries.shape[-1])
    unit = filters / np.linalg.norm(filters, axis=-1, keepdims=True)
    along = np.einsum("lkgth,lkh->lkgt", grouped, unit)
    return (np.sum(along**2, axis=(2, 3)) / np.sum(grouped**2, axis=(2, 3, 4))).astype(np.float32)


def main(argv=None) -> dict:
    parser = calibration_parser(
        "qfilter", __doc__, "filters.npy + run.json", contexts=8, length=1024
    )
    parser.add_argument("--samples", type=int, default=3000, help="tokens whose queries count")
    args = parser.parse_args(argv)
    check_counts(args, "--contexts", "--length", "--samples", "--context-batch")

    model, tokenizer = load_model(args.model, dtype="float32")
    rows = calibration_rows(args, tokenizer)
    began = time.perf_counter()
    queries = sampled_queries(model, rows, args.samples, args.context_batch, TRAIN_SEED)
    k = model.config.num_kv_heads
    filters = np.stack([query_filters(layer, k) for layer in queries])
    share = direction_share(queries, filters)
    summary = {
        **run_provenance("jaxkv train qfilter", argv),
        "model": args.model,
        "model_file_sha256": model_file_sha256(args.model),
        "contexts": args.contexts,
        "length": args.length,
        "samples": args.samples,
        "text": args.text,
        "seed": TRAIN_SEED,
        "queries": "after RoPE",
        "direction_share_mean": float(share.mean()),
        "direction_share": share.tolist(),
        "seconds": time.perf_counter() - began,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / FILTERS_FILE, filters)
    (args.out / "run.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "direction_share"}, indent=2))
    return summary
