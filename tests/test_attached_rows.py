"""Rows attached to a context row of one pool (`attach_row`): they read the context's tokens
through its own full pages, copy only its partial last pages, never write a shared page, and
release frees each page once, when no row names it any more."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cache import KVState, write_tokens
from jaxkv.cache.rows import attach_row, own_pages, release_rows
from jaxkv.cache.sharing import row_pages

LAYERS, ROWS, HEADS, DIM, PAGE = 2, 3, 2, 4, 4


def written(kv: KVState, row: int, counts: np.ndarray, seed: int, start: int = 0) -> KVState:
    """`kv` with counts[l, k] random tokens appended to each head of `row` (positions from
    `start`)."""
    rng = np.random.default_rng(seed)
    width = int(counts.max())
    pool, tables, lengths = kv.pool, kv.page_table, kv.lengths
    for layer in range(LAYERS):
        mask = np.zeros((ROWS, HEADS, width), bool)
        mask[row] = np.arange(width)[None, :] < counts[layer][:, None]
        k = jnp.asarray(rng.normal(size=(ROWS, HEADS, width, DIM)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(ROWS, HEADS, width, DIM)), jnp.float32)
        positions = jnp.broadcast_to(start + jnp.arange(width), (ROWS, width))
        pool, table, length = write_tokens(
            pool, tables[layer], lengths[layer], k, v, positions, jnp.asarray(mask)
        )
        tables, lengths = tables.at[layer].set(table), lengths.at[layer].set(length)
    kv = kv.replace(pool=pool, page_table=tables, lengths=lengths)
    kv.check()
    return kv


def view(kv: KVState, field: str, row: int) -> np.ndarray:
    return np.asarray(kv._per_slot(field, None, 0))[:, row]


@pytest.fixture
def context():
    kv = KVState.create(
        num_layers=LAYERS,
        batch=ROWS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        max_tokens=32,
        page_size=PAGE,
        num_pages=64,
        dtype=jnp.float32,
        key_bounds=True,
    )
    counts = np.array([[9, 4], [6, 11]])  # ragged heads: partial and full last pages
    return written(kv, 0, counts, seed=0), counts


def test_an_attached_row_reads_the_context_and_copies_only_its_partial_pages(context):
    kv, counts = context
    before = int(kv.pages_in_use())
    attached = jax.jit(attach_row)(kv, jnp.int32(0), jnp.int32(1))
    attached.check()
    for field in ("k_pages", "v_pages", "token_positions", "token_scores"):
        np.testing.assert_array_equal(view(attached, field, 1), view(attached, field, 0))
    tails = int(np.sum(counts % PAGE > 0))
    assert int(attached.pages_in_use()) == before + tails
    table = np.asarray(attached.page_table)
    full = counts // PAGE
    for layer, head in np.ndindex(LAYERS, HEADS):
        shared = table[layer, 1, head, : full[layer, head]]
        np.testing.assert_array_equal(shared, table[layer, 0, head, : full[layer, head]])
        tail = full[layer, head]
        if counts[layer, head] % PAGE:
            assert table[layer, 1, head, tail] != table[layer, 0, head, tail]
    bounds = np.asarray(attached.pool.key_min)
    copies = table[:, 1][(table[:, 1] >= 0) & (table[:, 1] != table[:, 0])]
    originals = table[:, 0][(table[:, 1] >= 0) & (table[:, 1] != table[:, 0])]
    np.testing.assert_array_equal(bounds[copies], bounds[originals])


def test_writing_an_attached_row_leaves_the_context_untouched(context):
    kv, counts = context
    attached = attach_row(kv, jnp.int32(0), jnp.int32(1))
    keys, positions = view(attached, "k_pages", 0), view(attached, "token_positions", 0)
    grown = written(attached, 1, np.full((LAYERS, HEADS), 3), seed=1, start=20)
    np.testing.assert_array_equal(view(grown, "k_pages", 0), keys)
    np.testing.assert_array_equal(view(grown, "token_positions", 0), positions)
    np.testing.assert_array_equal(np.asarray(grown.lengths[:, 1]), counts + 3)


def test_release_frees_a_page_once_no_row_names_it(context):
    kv, _ = context
    attached = attach_row(attach_row(kv, jnp.int32(0), jnp.int32(1)), jnp.int32(0), jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(own_pages(attached))[0], row_pages(attached).own)
    total = int(attached.pages_in_use())
    own = np.asarray(own_pages(attached))[0]  # the model-dtype pool (no int8 tier here)
    context_gone = release_rows(attached, jnp.array([True, False, False]))
    assert int(context_gone.pages_in_use()) == total - own[0]  # its shared pages stay
    np.testing.assert_array_equal(view(context_gone, "k_pages", 1), view(attached, "k_pages", 0))
    both = release_rows(attached, jnp.array([True, True, False]))  # in one release: once
    assert int(both.pages_in_use()) == total - own[0] - own[1]
    empty = release_rows(both, jnp.array([False, False, True]))
    assert int(empty.pages_in_use()) == 0
    free = np.asarray(empty.pool.allocator.free_stack)
    np.testing.assert_array_equal(np.sort(free), np.arange(64))  # each page freed once


def test_attaching_without_free_pages_for_the_copies_is_flagged(context):
    kv, _ = context
    allocator = kv.pool.allocator.replace(num_free=jnp.int32(1))  # fewer than the 3 tails
    starved = kv.replace(pool=kv.pool.replace(allocator=allocator))
    attached = attach_row(starved, jnp.int32(0), jnp.int32(1))
    assert bool(attached.pool.overflow)
    assert int(np.sum(np.asarray(attached.page_table[:, 1]) >= 0)) == 0
    assert int(np.sum(np.asarray(attached.lengths[:, 1]))) == 0
