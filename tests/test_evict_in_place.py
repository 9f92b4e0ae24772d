"""`evict_in_place`: the same kept tokens, lengths and freed pages as `compact`, with few moves
(holes filled from past each head's new length) or through `compact` when a head needs more;
with int8 storage in both tiers, the model-dtype window in order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import attention
from jaxkv.cache.eviction import compact, evict_in_place, keep_top_per_head, moves_to_fill_holes
from jaxkv.cache.int8 import spill_layer
from jaxkv.models import init_model
from tests.tiny_models import tiny_config

CONFIG = tiny_config()
PAGE_SIZE = 8
WINDOW = 12  # int8 storage: the newest 12 tokens of a head in the model dtype, over 2 pages


def _prompt_state(cache: jaxkv.CacheConfig):
    model = init_model(CONFIG, seed=3, scale=0.3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (70, 45, 64)]
    return jaxkv.compress_prompt(model, prompts, cache=cache, reserve_tokens=8)


@pytest.fixture(scope="module")
def state():
    return _prompt_state(jaxkv.CacheConfig(page_size=PAGE_SIZE))


@pytest.fixture(scope="module")
def int8_state():
    cache = jaxkv.CacheConfig(page_size=PAGE_SIZE, storage="int8", full_precision_window=WINDOW)
    return _prompt_state(cache)


def _tokens_by_position(pool, page_table, lengths) -> list[dict]:
    """Per (layer, sequence, head) of a pool: {position: (key, value, token scales)} of the
    held tokens (the scales of int8 pages; None in the model dtype)."""

    def view(pages):
        if pages is None:
            return None
        gathered = jax.vmap(lambda t: attention.gather_pages(pages, t))(page_table)
        return np.asarray(gathered).reshape(*page_table.shape[:3], -1, *pages.shape[2:])

    keys, values, positions = view(pool.k_pages), view(pool.v_pages), view(pool.token_positions)
    scales = view(pool.k_scales)
    lengths = np.asarray(lengths)
    heads = []
    for index in np.ndindex(positions.shape[:3]):
        heads.append(
            {
                int(positions[index][s]): (
                    keys[index][s].tolist(),
                    values[index][s].tolist(),
                    None if scales is None else float(scales[index][s]),
                )
                for s in range(lengths[index])
            }
        )
    return heads


def _tiers_by_position(state) -> list[list[dict]]:
    """`_tokens_by_position` of the model-dtype pool, then of the int8 tier if any."""
    tiers = [_tokens_by_position(state.pool, state.page_table, state.full_precision_lengths())]
    tier = state.pool.int8
    if tier is not None:
        tiers.append(_tokens_by_position(tier.pool, tier.page_table, tier.lengths))
    return tiers


def _check_pool_accounting(pool, page_table) -> None:
    """Every page is either free or owned by exactly one head's table, once."""
    table = np.asarray(page_table)
    used = table[table >= 0]
    alloc = pool.allocator
    free = np.asarray(alloc.free_stack)[: int(alloc.num_free)]
    assert len(set(used.tolist())) == used.size
    assert sorted([*used.tolist(), *free.tolist()]) == list(range(pool.num_pages))


def _keep(state, rng, evict_per_head: int) -> np.ndarray:
    """bool [L, B, K, S]: each head drops up to `evict_per_head` random held slots."""
    held = np.asarray(state.positions()) >= 0
    keep = held.copy()
    for index in np.ndindex(held.shape[:3]):
        slots = np.flatnonzero(held[index])
        drop = rng.choice(slots, size=min(evict_per_head, len(slots)), replace=False)
        keep[index][drop] = False
    return keep


@pytest.mark.parametrize("storage", ["model", "int8"])
@pytest.mark.parametrize("evict_per_head, max_moves", [(3, 4), (3, 3), (0, 2), (12, 4)])
def test_keeps_what_compact_keeps_and_frees_the_same_pages(
    state, int8_state, storage, evict_per_head, max_moves
):
    state = int8_state if storage == "int8" else state
    keep = _keep(state, np.random.default_rng(evict_per_head), evict_per_head)
    expected = compact(state, jnp.asarray(keep))
    moved = jax.jit(evict_in_place, static_argnames="max_moves")(
        state, jnp.asarray(keep), max_moves=max_moves
    )
    np.testing.assert_array_equal(np.asarray(moved.lengths), np.asarray(expected.lengths))
    assert int(moved.pages_in_use()) == int(expected.pages_in_use())
    assert _tiers_by_position(moved) == _tiers_by_position(expected)
    _check_pool_accounting(moved.pool, moved.page_table)
    if storage == "int8":
        tier, before = moved.pool.int8, state.pool.int8
        _check_pool_accounting(tier.pool, tier.page_table)
        assert int(tier.pages_in_use()) == int(expected.pool.int8.pages_in_use())
        assert int(np.max(state.full_precision_lengths())) == WINDOW
        assert not bool(moved.pool.overflow)
        # The window keeps its order (the spill moves its first tokens out).
        np.testing.assert_array_equal(
            _window_positions(moved), _window_positions(expected), strict=True
        )
        if evict_per_head:  # the int8 tier lost tokens too
            assert np.any(np.asarray(tier.lengths) < np.asarray(before.lengths))
        return
    moves = np.asarray(moves_to_fill_holes(jnp.asarray(keep), state.lengths))
    if moves.max() > max_moves:  # too many for the few-moves path: compact's order
        np.testing.assert_array_equal(
            np.asarray(moved.positions()), np.asarray(expected.positions())
        )


def _window_positions(state) -> np.ndarray:
    """int32 [L, B, K, WINDOW]: the model-dtype slots' positions, in slot order."""
    table = np.maximum(np.asarray(state.page_table), 0)
    positions = np.asarray(state.pool.token_positions)[table].reshape(*table.shape[:3], -1)
    held = np.arange(positions.shape[-1]) < np.asarray(state.full_precision_lengths())[..., None]
    return np.where(held, positions, -1)[..., :WINDOW]


def test_a_window_holding_more_than_the_spill_reads_is_flagged(int8_state):
    """The spill reads the window's first pages only: a head holding more is an overflow,
    never a silent loss."""
    lengths = int8_state.lengths[0]
    pool, _, _ = spill_layer(int8_state.pool, int8_state.page_table[0], lengths, 0, WINDOW + 1)
    assert not bool(pool.overflow)
    pool, _, _ = spill_layer(int8_state.pool, int8_state.page_table[0], lengths, 0, PAGE_SIZE)
    assert bool(pool.overflow)


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
