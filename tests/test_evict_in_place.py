"""`evict_in_place`: the same kept tokens, lengths and freed pages as `compact`, with few moves
(holes filled from past each head's new length) or through `compact` when a head needs more."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import attention
from jaxkv.cache.eviction import compact, evict_in_place, keep_top_per_head, moves_to_fill_holes
from jaxkv.models import init_model
from tests.tiny_models import tiny_config

CONFIG = tiny_config()
PAGE_SIZE = 8


@pytest.fixture(scope="module")
def state():
    model = init_model(CONFIG, seed=3, scale=0.3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (70, 45, 64)]
    return jaxkv.compress_prompt(
        model, prompts, cache=jaxkv.CacheConfig(page_size=PAGE_SIZE), reserve_tokens=8
    )


def _tokens_by_position(state) -> list[dict]:
    """Per (layer, sequence, head): {position: (key, value)} of the held tokens."""
    keys = jax.vmap(lambda t: attention.gather_pages(state.pool.k_pages, t))(state.page_table)
    values = jax.vmap(lambda t: attention.gather_pages(state.pool.v_pages, t))(state.page_table)
    keys, values = np.asarray(keys), np.asarray(values)
    positions = np.asarray(state.positions())
    heads = []
    for index in np.ndindex(positions.shape[:3]):
        held = positions[index] >= 0
        slots = np.flatnonzero(held)
        heads.append(
            {
                int(positions[index][s]): (keys[index][s].tolist(), values[index][s].tolist())
                for s in slots
            }
        )
    return heads


def _check_pool_accounting(state) -> None:
    """Every page is either free or owned by exactly one head's table, once."""
    table = np.asarray(state.page_table)
    used = table[table >= 0]
    alloc = state.pool.allocator
    free = np.asarray(alloc.free_stack)[: int(alloc.num_free)]
    assert len(set(used.tolist())) == used.size
    assert sorted([*used.tolist(), *free.tolist()]) == list(range(state.pool.num_pages))


def _keep(state, rng, evict_per_head: int) -> np.ndarray:
    """bool [L, B, K, S]: each head drops up to `evict_per_head` random held slots."""
    held = np.asarray(state.positions()) >= 0
    keep = held.copy()
    for index in np.ndindex(held.shape[:3]):
        slots = np.flatnonzero(held[index])
        drop = rng.choice(slots, size=min(evict_per_head, len(slots)), replace=False)
        keep[index][drop] = False
    return keep


@pytest.mark.parametrize("evict_per_head, max_moves", [(3, 4), (3, 3), (0, 2), (12, 4)])
def test_keeps_what_compact_keeps_and_frees_the_same_pages(state, evict_per_head, max_moves):
    keep = _keep(state, np.random.default_rng(evict_per_head), evict_per_head)
    expected = compact(state, jnp.asarray(keep))
    moved = jax.jit(evict_in_place, static_argnames="max_moves")(
        state, jnp.asarray(keep), max_moves=max_moves
    )
    np.testing.assert_array_equal(np.asarray(moved.lengths), np.asarray(expected.lengths))
    assert int(moved.pages_in_use()) == int(expected.pages_in_use())
    assert _tokens_by_position(moved) == _tokens_by_position(expected)
    _check_pool_accounting(moved)
    moves = np.asarray(moves_to_fill_holes(jnp.asarray(keep), state.lengths))
    if moves.max() > max_moves:  # too many for the few-moves path: compact's order
        np.testing.assert_array_equal(
            np.asarray(moved.positions()), np.asarray(expected.positions())
        )


def test_evicting_the_oldest_moves_the_newest_into_their_slots(state):
    """A sliding window's eviction: the oldest tokens' slots take the newest ones, and nothing
    else moves."""
    positions = np.asarray(state.positions())
    keep = positions >= 2  # every head drops positions 0 and 1
    keep &= positions >= 0
    moved = evict_in_place(state, jnp.asarray(keep), max_moves=2)
    after = np.asarray(moved.positions())
    for index in np.ndindex(positions.shape[:3]):
        n = int(np.sum(positions[index] >= 0))
        if n < 4:
            continue
        expected = positions[index][:n].copy()
        expected[:2] = positions[index][n - 2 : n]
        np.testing.assert_array_equal(after[index][: n - 2], expected[: n - 2])


def _keep_top_reference(scores, budget, held, protected):
    """Per head in numpy: protected first, then by descending score, ties by lower slot."""
    keep = np.zeros(scores.shape, bool)
    for head in np.ndindex(scores.shape[:-1]):
        slots = np.flatnonzero(held[head])
        order = sorted(slots, key=lambda s: (not protected[head][s], -scores[head][s], s))
        keep[head][order[: max(int(budget[head]), 0)]] = True
    return keep


@pytest.mark.parametrize("max_evicted", [None, 1, 4, 64])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_keep_top_per_head_is_the_stable_ranking(seed, mixed, max_evicted):
    """One sort with a threshold, or top_k over a few victims, keeps what a full stable ranking
    keeps: ties (many, integer scores) to the lower slot, protected slots always."""
    rng = np.random.default_rng(seed)
    shape = (2, 3, 4, 40)
    scores = rng.integers(0, 6, shape).astype(np.float32)
    held = rng.random(shape) < 0.8
    protected = held & (rng.random(shape) < 0.1)
    counts, floor = held.sum(-1), protected.sum(-1)
    near = counts - rng.integers(0, 5, shape[:-1])  # a few victims: the top_k path
    anywhere = rng.integers(0, shape[-1] + 3, shape[:-1])  # many: the sorted path
    budget = np.maximum(np.where(mixed & (rng.random(shape[:-1]) < 0.3), anywhere, near), floor)
    got = keep_top_per_head(
        jnp.asarray(scores),
        jnp.asarray(budget, jnp.int32),
        jnp.asarray(held),
        jnp.asarray(protected),
        max_evicted=max_evicted,
    )
    expected = _keep_top_reference(scores, budget, held, protected)
    np.testing.assert_array_equal(np.asarray(got), expected)
