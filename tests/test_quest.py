"""Quest: per-page key bounds stay exact through writes and compaction; decode reads exactly the
pages a numpy version of Quest's selection picks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.cache import KVState, write_tokens
from jaxkv.cache.eviction import compact
from jaxkv.models import init_model
from jaxkv.models.configs import Family
from jaxkv.models.decoder import logits_from_hidden
from jaxkv.step import forward as forward_lib
from tests import dense_reference
from tests.tiny_models import tiny_config

CONFIG = tiny_config(Family.QWEN2)


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=3, scale=0.3)


def _assert_bounds_exact(kv: KVState):
    keys = np.asarray(kv.pool.k_pages)
    p = kv.pool.page_size
    table, lengths = np.asarray(kv.page_table), np.asarray(kv.lengths)
    for index in np.ndindex(lengths.shape):
        for j in range(-(-lengths[index] // p)):
            page = table[index][j]
            held = keys[page][: min(p, lengths[index] - j * p)]
            np.testing.assert_array_equal(np.asarray(kv.pool.key_min)[page], held.min(0))
            np.testing.assert_array_equal(np.asarray(kv.pool.key_max)[page], held.max(0))


def test_key_bounds_follow_writes_and_compaction():
    kv = KVState.create(
        num_layers=1,
        batch=2,
        num_kv_heads=2,
        head_dim=8,
        max_tokens=64,
        page_size=4,
        num_pages=40,
        dtype=jnp.float32,
        key_bounds=True,
    )
    rng = np.random.default_rng(0)
    pool, table, lengths = kv.pool, kv.page_table[0], kv.lengths[0]
    for chunk in (7, 1, 5, 9):
        k = jnp.asarray(rng.normal(size=(2, 2, chunk, 8)), jnp.float32)
        mask = jnp.asarray(rng.random((2, 2, chunk)) < 0.8)
        pool, table, lengths = write_tokens(
            pool, table, lengths, k, k, jnp.zeros((2, chunk), jnp.int32), mask
        )
        kv = KVState(pool=pool, page_table=table[None], lengths=lengths[None])
        _assert_bounds_exact(kv)
    keep = jnp.asarray(rng.random(kv.positions().shape) < 0.4)
    kv = compact(kv, keep)
    _assert_bounds_exact(kv)
    assert kv.pool.page_bytes == 4 * 8 * 8 + 4 * 8 + 2 * 8 * 4


def _quest_select(p, budget):
    """Numpy Quest: pages by max over the group of sum_d max(q_d kmax_d, q_d kmin_d)."""

    def select(layer, b, kv_head, q_group, keys):
        n = len(keys)
        pages = [keys[j : j + p] for j in range(0, n, p)]
        partial = n % p != 0
        scores = [
            np.max(np.sum(np.maximum(q_group * pg.max(0), q_group * pg.min(0)), -1)) for pg in pages
        ]
        candidates = range(len(pages) - 1) if partial else range(len(pages))
        ranked = sorted(candidates, key=lambda j: -scores[j])[: -(-budget // p)]
        chosen = set(ranked) | ({len(pages) - 1} if partial else set())
        return np.concatenate([np.arange(j * p, min(n, (j + 1) * p)) for j in sorted(chosen)])

    return select


# Jitted: one compiled program per call instead of one per primitive.
forward_cached = jax.jit(forward_lib.forward_cached, static_argnames=("policy", "backend"))


@pytest.mark.parametrize(("length", "budget"), [(150, 32), (133, 40)])
def test_quest_decode_reads_exactly_the_selected_pages(model, length, budget):
    rng = np.random.default_rng(length)
    prompts = [rng.integers(0, 64, length).tolist(), rng.integers(0, 64, length - 37).tolist()]
    state = KVState.create(  # a cache with key bounds, as generate builds for Quest
        num_layers=2,
        batch=2,
        num_kv_heads=2,
        head_dim=16,
        max_tokens=length + 8,
        page_size=8,
        num_pages=200,
        dtype=jnp.float32,
        key_bounds=True,
    )
    hidden, state, _ = forward_cached(
        model,
        jnp.asarray([p + [0] * (length - len(p)) for p in prompts]),
        jnp.asarray([[i if i < len(p) else -1 for i in range(length)] for p in prompts]),
        state,
        policy=policies.FullCache(),
    )
    keys, values = dense_reference.cached_keys_values(state)
    token, position = np.array([3, 7], np.int32), np.array([length, length - 37], np.int32)
    expected = dense_reference.decode_step_logits(
        model, token, position, keys, values, select=_quest_select(8, budget)
    )
    quest = policies.Quest(budget=budget).static()
    hidden, _, _ = forward_cached(
        model,
        jnp.asarray(token)[:, None],
        jnp.asarray(position)[:, None],
        state,
        policy=quest,
        read_budget=jnp.full((2,), budget, jnp.int32),
    )
    got = np.asarray(logits_from_hidden(model.params, CONFIG, hidden))[:, 0]
    # Paged blocks and the dense reference sum in different orders: f32 rounding of a few tens
    # of ulps of the logits' scale (one value in 128 reached 18 ulps), not a fixed 1e-5.
    tolerance = 64 * np.finfo(np.float32).eps * np.abs(expected).max()
    np.testing.assert_allclose(got, expected, atol=tolerance, rtol=0)
    full = dense_reference.decode_step_logits(model, token, position, keys, values)
    assert np.abs(got - full).max() > 100 * tolerance  # the selection really dropped pages


def test_quest_in_generate_keeps_every_token_and_needs_a_budget(model):
    prompts = [list(range(1, 60)), list(range(5, 40))]
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=5,
        policy=policies.Quest(budget=16),
        stop_tokens=(),
        cache=jaxkv.CacheConfig(page_size=8),
    )
    np.testing.assert_array_equal(np.asarray(out.state.lengths)[0, :, 0], [63, 39])
    with pytest.raises(ValueError, match="needs budget="):
        jaxkv.generate(model, prompts, max_new_tokens=2, policy=policies.Quest())
