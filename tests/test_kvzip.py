"""KVzip: reconstruction scores against a dense transformers forward of context + repeat + chunk,
and the global-threshold selection against a plain-numpy ranking."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.policies import kvzip
from jaxkv.policies.kvzip import keep_top_globally, reconstruction_scores
from tests import hf_models
from tests import policy_references as ref

LENGTHS = (70, 45)
CHUNK = 32
REPEAT = (5, 6, 7)
CONTINUE = (8, 9)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kvzip-model")
    hf, model = hf_models.build_and_load("llama2-tied", directory, seed=5, scale=0.3)
    rng = np.random.default_rng(3)
    contexts = [rng.integers(10, hf.config.vocab_size, n).tolist() for n in LENGTHS]
    return hf, model, contexts


def dense_targets(hf, context):
    """[L, K, T]: max over replay queries and group heads, one dense forward per chunk."""
    t = len(context)
    best = None
    for start in range(0, t, CHUNK):
        prompt = list(REPEAT) if start == 0 else list(CONTINUE) + context[start - 8 : start]
        fwd = ref.run(hf, context + prompt + context[start : start + CHUNK])
        k = fwd.num_kv_heads
        per_layer = np.stack([a[:, t:, :t].reshape(k, -1, t).max(axis=1) for a in fwd.attentions])
        best = per_layer if best is None else np.maximum(best, per_layer)
    return best


def dense_window_targets(hf, context, sinks, suffix):
    """[L, K, T]: the paper's code's scores (`KVzip.sinks`): each chunk's replay probabilities
    renormalised over the first `sinks` tokens, the chunk's own and the replay tokens (a softmax
    over a subset of the full softmax's entries), the forward itself over the whole context."""
    t = len(context)
    best = None
    for start in range(0, t, CHUNK):
        prompt = list(REPEAT) if start == 0 else [*CONTINUE, *context[start - 8 : start], *suffix]
        replay = prompt + context[start : start + CHUNK]
        fwd = ref.run(hf, context + replay)
        scored = np.zeros(t + len(replay), bool)
        scored[:sinks] = scored[start : start + CHUNK] = scored[t:] = True
        per_layer = []
        for probs in fwd.attentions:  # [N, Q, keys]
            rows = probs[:, t:, :] * scored
            rows = rows / rows.sum(axis=-1, keepdims=True)
            per_layer.append(rows[..., :t].reshape(fwd.num_kv_heads, -1, t).max(axis=1))
        per_layer = np.stack(per_layer)
        best = per_layer if best is None else np.maximum(best, per_layer)
    return best


def full_cache_scores(model, contexts, **options) -> np.ndarray:
    """f32 [L, B, K, S]: `reconstruction_scores` of the contexts' full cache."""
    state = jaxkv.compress_prompt(
        model, contexts, cache=jaxkv.CacheConfig(page_size=8), prefill_chunk=CHUNK
    )
    padded = np.zeros((len(contexts), 96), np.int32)
    for row, context in enumerate(contexts):
        padded[row, : len(context)] = context
    scores = reconstruction_scores(
        model,
        state,
        jnp.asarray(padded),
        jnp.asarray([len(c) for c in contexts], jnp.int32),
        chunk=CHUNK,
        repeat_ids=REPEAT,
        continue_ids=CONTINUE,
        **options,
    )
    return np.asarray(scores)


# 4096: the whole prefix in one block; 16 and 40: several (40 with a padded last block).
@pytest.mark.parametrize("prefix_block", [4096, 16, 40])
def test_reconstruction_scores_match_dense_attention(setup, monkeypatch, prefix_block):
    hf, model, contexts = setup
    monkeypatch.setattr(kvzip, "REPLAY_PREFIX_BLOCK", prefix_block)
    scores = full_cache_scores(model, contexts)
    for row, context in enumerate(contexts):
        expected = dense_targets(hf, context)
        got = scores[:, row, :, : len(context)]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
        assert np.all(scores[:, row, :, len(context) :] == 0)


def test_scores_with_sinks_renormalise_each_chunk_over_sinks_chunk_and_replay(setup):
    hf, model, contexts = setup
    suffix = (11, 12)
    scores = full_cache_scores(model, contexts, sinks=3, suffix_ids=suffix)
    for row, context in enumerate(contexts):
        expected = dense_window_targets(hf, context, 3, suffix)
        np.testing.assert_allclose(
            scores[:, row, :, : len(context)], expected, rtol=1e-4, atol=1e-6
        )
    # the window changes the scores: without it each softmax runs over the whole context
    whole = full_cache_scores(model, contexts, suffix_ids=suffix)
    assert np.abs(whole - scores).max() > 1e-2


def test_kvzip_sinks_are_kept_in_every_head(setup):
    _, model, contexts = setup
    policy = policies.get(
        "kvzip", ratio=0.3, chunk=CHUNK, repeat_ids=REPEAT, continue_ids=CONTINUE, sinks=4
    )
    cache = jaxkv.CacheConfig(page_size=8)
    state = jaxkv.compress_prompt(model, contexts, policy, cache=cache, prefill_chunk=CHUNK)
    positions = np.asarray(state.positions())  # [L, B, K, S]
    for first in range(4):
        assert np.all(np.any(positions == first, axis=-1))
    for bad in ({"sinks": -1}, {"sinks": True}, {"prompt_turn": "user"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            policies.KVzip(ratio=0.3, **bad)


def test_global_selection_keeps_the_top_entries_with_protected_forced():
    rng = np.random.default_rng(0)
    scores = rng.random((3, 2, 2, 40)).astype(np.float32)
    lengths = np.array([[[40, 25], [10, 40]]] * 3)
    held = np.arange(40) < lengths[..., None]
    protected = held & (rng.random(held.shape) < 0.1)
    total = np.array([50, 30])
    keep = np.asarray(keep_top_globally(scores, jnp.asarray(total), held, protected))
    for b in range(2):
        flat_scores = scores[:, b][held[:, b]]
        flat_protected = protected[:, b][held[:, b]]
        rest = np.sort(flat_scores[~flat_protected])[::-1]
        threshold = rest[total[b] - flat_protected.sum() - 1]
        expected = held[:, b] & (protected[:, b] | (scores[:, b] >= threshold))
        np.testing.assert_array_equal(keep[:, b], expected)
        assert keep[:, b].sum() == total[b]


def test_kvzip_policy_keeps_the_ratio_and_frees_pages(setup):
    _, model, contexts = setup
    policy = policies.get("kvzip", ratio=0.3, chunk=CHUNK, repeat_ids=REPEAT, continue_ids=CONTINUE)
    state = jaxkv.compress_prompt(
        model, contexts, policy, cache=jaxkv.CacheConfig(page_size=8), prefill_chunk=CHUNK
    )
    lengths = np.asarray(state.lengths)  # [L, B, K]
    cfg = model.config
    for row, n in enumerate(LENGTHS):
        assert lengths[:, row].sum() == int(0.3 * n) * cfg.num_layers * cfg.num_kv_heads
    assert len(np.unique(lengths)) > 1  # non-uniform head budgets
    assert int(state.pages_in_use()) == int(np.sum(-(-lengths // 8)))
    with pytest.raises(ValueError, match="ratio"):
        policies.KVzip(ratio=1.5)


def test_kvzip_recent_keeps_every_heads_newest_positions_inside_the_ratio(setup):
    _, model, contexts = setup
    recent = 6
    policy = policies.get(
        "kvzip", ratio=0.3, chunk=CHUNK, repeat_ids=REPEAT, continue_ids=CONTINUE, recent=recent
    )
    cache = jaxkv.CacheConfig(page_size=8)
    state = jaxkv.compress_prompt(model, contexts, policy, cache=cache, prefill_chunk=CHUNK)
    scores = full_cache_scores(model, contexts)
    positions = np.asarray(state.positions())  # [L, B, K, S]
    num_layers, _, num_heads, _ = positions.shape
    for row, n in enumerate(LENGTHS):
        total = int(0.3 * n) * num_layers * num_heads
        row_scores = scores[:, row, :, :n].copy()
        row_scores[..., n - recent :] = np.inf  # the newest `recent` of every head first
        order = np.argsort(-row_scores.reshape(-1), kind="stable")[:total]
        expected = np.zeros(row_scores.size, bool)
        expected[order] = True
        expected = expected.reshape(row_scores.shape)
        for layer in range(num_layers):
            for head in range(num_heads):
                got = sorted(p for p in positions[layer, row, head] if p >= 0)
                np.testing.assert_array_equal(got, np.flatnonzero(expected[layer, head]))
    # A ratio keeping fewer than `recent` tokens (21 and 13 < 40): the prompts are kept whole.
    too_long = dataclasses.replace(policy, recent=40)
    np.testing.assert_array_equal(too_long.budget_tokens(np.array(LENGTHS)), LENGTHS)
    with pytest.raises(ValueError, match="recent=-1"):
        policies.KVzip(ratio=0.3, recent=-1)
