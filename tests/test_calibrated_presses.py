"""The presses whose parameters summarise a model's queries ahead of any prompt. Q-Filters: the
filter of a head is minus the dominant direction of its queries, oriented so that most queries
project positively on it, averaged over the KV head's group (checked against the eigenvector of
the queries' second-moment matrix), `jaxkv train qfilter` end to end on a tiny GGUF model, and
the policy ranks keys by the filters it is given. ExpectedAttentionStats: `jaxkv train
expected_attention_stats` writes each query head's mean and covariance (checked against numpy's)
and the policy scores with them as ExpectedAttention with the same moments."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.model_sources import load_model
from jaxkv.policies.calibration import layer_queries
from jaxkv.policies.qfilter import query_filters
from jaxkv.train import expected_attention_stats, fastkvzip, qfilter
from tests import gguf_files


def dominant_direction(queries: np.ndarray) -> np.ndarray:
    """The unit eigenvector of Q^T Q [H, H] with the largest eigenvalue, signed so that most
    queries [T, H] have a positive dot product with it."""
    _, vectors = np.linalg.eigh(queries.T @ queries)
    top = vectors[:, -1]
    return top if np.mean(queries @ top > 0) > 0.5 else -top


def anisotropic_queries(rng, directions: np.ndarray, tokens: int) -> np.ndarray:
    """[N, T, H]: per head, positive multiples of its direction (mostly) plus noise."""
    scale = rng.normal(3.0, 1.0, (len(directions), tokens, 1))
    return scale * directions[:, None, :] + 0.5 * rng.standard_normal((*scale.shape[:2], 16))


def test_filters_are_minus_the_oriented_dominant_direction_averaged_over_the_group():
    rng = np.random.default_rng(0)
    directions = rng.standard_normal((4, 16))
    directions /= np.linalg.norm(directions, axis=-1, keepdims=True)
    queries = anisotropic_queries(rng, directions, 500)
    filters = query_filters(queries, num_kv_heads=2)
    expected = np.stack([-dominant_direction(head) for head in queries]).reshape(2, 2, 16).mean(1)
    np.testing.assert_allclose(filters, expected, atol=1e-6)
    # Each head's filter points against its queries' direction: v . key ranks keys.
    for kv_head in range(2):
        group = directions[2 * kv_head : 2 * kv_head + 2].mean(0)
        assert filters[kv_head] @ group < -0.9 * np.linalg.norm(group) ** 2
    # Queries pointing the other way flip the orientation.
    np.testing.assert_allclose(query_filters(-queries, num_kv_heads=2), -filters, atol=1e-6)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return gguf_files.write_tiny_qwen2(tmp_path_factory.mktemp("gguf"))


def test_train_qfilter_writes_the_filters_of_the_sampled_queries(gguf_path, tmp_path):
    out = tmp_path / "filters"
    argv = ["--model", str(gguf_path), "--out", str(out), "--contexts", "3", "--length", "64"]
    summary = qfilter.main([*argv, "--samples", "100", "--context-batch", "2"])
    model, tokenizer = load_model(str(gguf_path), dtype="float32")
    rows = fastkvzip.contexts("train", 3, 64, fastkvzip.TRAIN_SEED, tokenizer)
    queries = np.asarray(layer_queries(model, jnp.asarray(rows), rotated=True))  # [L, B, N, T, H]
    drawn = np.sort(np.random.default_rng(fastkvzip.TRAIN_SEED).choice(3 * 64, 100, replace=False))
    row, position = np.divmod(drawn, 64)
    sampled = np.transpose(queries[:, row, :, position], (1, 2, 0, 3))  # [L, N, 100, H]
    k = model.config.num_kv_heads
    expected = np.stack([query_filters(layer, k) for layer in sampled])
    filters = policies.get("qfilter").params.load(out, model.config)["filters"]
    np.testing.assert_allclose(filters, expected, rtol=1e-4, atol=1e-5)
    run = json.loads((out / "run.json").read_text())
    assert run["command"] == summary["command"] and run["samples"] == 100
    assert 0 < run["direction_share_mean"] <= 1


def test_train_qfilter_refuses_more_samples_than_tokens(gguf_path, tmp_path):
    argv = ["--model", str(gguf_path), "--out", str(tmp_path), "--contexts", "1", "--length", "32"]
    with pytest.raises(ValueError, match="--samples 40 exceeds the 32 calibration tokens"):
        qfilter.main([*argv, "--samples", "40"])
    with pytest.raises(ValueError, match="--contexts 0 must be >= 1"):
        qfilter.main(["--out", str(tmp_path), "--contexts", "0"])


def test_qfilter_keeps_the_keys_with_the_highest_projection_on_minus_the_filter(gguf_path):
    """Against the scores written plainly from the full cache's keys: -(filter . key)."""
    model, _ = load_model(str(gguf_path), dtype="float32")
    cfg = model.config
    rng = np.random.default_rng(1)
    filters = rng.standard_normal((cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    params = {"filters": filters.astype(np.float32)}
    prompt = rng.integers(0, cfg.vocab_size, 80).tolist()
    full = jaxkv.compress_prompt(model, [prompt], "full")
    state = jaxkv.compress_prompt(model, [prompt], "qfilter:0.25", policy_params=params)
    for layer in range(cfg.num_layers):
        table = np.asarray(full.page_table)[layer, 0]  # [K, M]
        pages = np.asarray(full.pool.k_pages)[np.maximum(table, 0)]  # [K, M, p, H]
        keys = pages.reshape(cfg.num_kv_heads, -1, cfg.head_dim)  # in position order
        scores = -np.einsum("kh,ksh->ks", filters[layer], keys[:, :80])
        kept = np.asarray(state.positions(layer))[0]
        for head in range(cfg.num_kv_heads):
            expected = set(np.argsort(-scores[head], kind="stable")[:20].tolist())
            assert set(kept[head][kept[head] >= 0].tolist()) == expected, (layer, head)
    with pytest.raises(ValueError, match=r"needs policy_params \{'filters': f32 \[L, K, H\]"):
        jaxkv.compress_prompt(
            model, [prompt], "qfilter:0.25", policy_params={"filters": filters[0]}
        )


def test_train_expected_attention_stats_writes_the_moments_of_the_queries(gguf_path, tmp_path):
    out = tmp_path / "stats"
    argv = ["--model", str(gguf_path), "--out", str(out), "--contexts", "3", "--length", "48"]
    summary = expected_attention_stats.main([*argv, "--sinks", "4", "--context-batch", "2"])
    model, tokenizer = load_model(str(gguf_path), dtype="float32")
    rows = fastkvzip.contexts("train", 3, 48, fastkvzip.TRAIN_SEED, tokenizer)
    queries = np.asarray(layer_queries(model, jnp.asarray(rows), rotated=False), np.float64)
    counted = queries[:, :, :, 4:]  # [L, B, N, T - 4, H]
    layers, _, heads, _, dim = counted.shape
    per_head = np.moveaxis(counted, 2, 1).reshape(layers, heads, -1, dim)  # [L, N, 3 * 44, H]
    stats = policies.get("expected_attention_stats").params.load(out, model.config)
    np.testing.assert_allclose(stats["query_mean"], per_head.mean(axis=2), rtol=1e-4, atol=1e-5)
    covariance = np.stack([[np.cov(head, rowvar=False) for head in layer] for layer in per_head])
    np.testing.assert_allclose(stats["query_covariance"], covariance, rtol=1e-4, atol=1e-5)
    assert summary["queries_per_head"] == 3 * 44
    assert json.loads((out / "run.json").read_text())["command"] == summary["command"]
    with pytest.raises(ValueError, match=r"--sinks 47 must lie in \[0, --length - 1\)"):
        expected_attention_stats.main([*argv, "--sinks", "47"])


def test_expected_attention_with_the_prompt_s_own_statistics_keeps_what_expected_attention_keeps(
    gguf_path,
):
    """Given the moments ExpectedAttention fits on the prompt (population covariance, queries
    past the sinks), the statistics policy keeps the same tokens."""
    model, _ = load_model(str(gguf_path), dtype="float32")
    prompt = np.random.default_rng(2).integers(0, model.config.vocab_size, 90).tolist()
    queries = np.asarray(layer_queries(model, jnp.asarray([prompt]), rotated=False), np.float64)
    counted = queries[:, 0, :, 4:]  # [L, N, T - 4, H]
    centered = counted - counted.mean(axis=2, keepdims=True)
    params = {
        "query_mean": counted.mean(axis=2).astype(np.float32),
        "query_covariance": (
            np.einsum("lnth,lntg->lnhg", centered, centered) / counted.shape[2]
        ).astype(np.float32),
    }
    own = jaxkv.compress_prompt(model, [prompt], "expected_attention:0.3")
    given = jaxkv.compress_prompt(
        model, [prompt], "expected_attention_stats:0.3", policy_params=params
    )
    np.testing.assert_array_equal(
        np.sort(np.asarray(given.positions()), -1), np.sort(np.asarray(own.positions()), -1)
    )
