"""The in-jit page allocator never hands out a page twice, and pool exhaustion is reported."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.cache import KVState, PageAllocator, PoolExhaustedError, allocate, release, write_tokens

MAX_COUNT = 4
_allocate = jax.jit(allocate, static_argnames=("max_count",))
_release = jax.jit(release)

# An operation is ("admit", counts per request) or ("free", which held pages, by index seed).
operations = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.lists(st.integers(0, MAX_COUNT), min_size=3, max_size=3)),
        st.tuples(st.just("free"), st.lists(st.integers(0, 1000), min_size=0, max_size=6)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(num_pages=st.integers(1, 24), ops=operations)
def test_random_admit_free_sequences_never_double_allocate(num_pages, ops):
    alloc = PageAllocator.create(num_pages)
    held: list[int] = []
    for kind, values in ops:
        if kind == "admit":
            counts = jnp.asarray(values, jnp.int32)
            alloc, pages, ok = _allocate(alloc, counts, max_count=MAX_COUNT)
            pages = np.asarray(pages)
            fits = sum(values) <= num_pages - len(held)
            assert bool(ok) == fits
            new = pages[pages >= 0].tolist()
            if fits:
                assert [int(np.sum(row >= 0)) for row in pages] == values
            else:
                assert new == []
            assert len(set(new)) == len(new), "a page handed out twice in one call"
            assert not set(new) & set(held), "a page in use handed out again"
            assert all(0 <= p < num_pages for p in new)
            held += new
        else:
            chosen = sorted({held[i % len(held)] for i in values}) if held else []
            padded = np.full(6, -1, np.int32)
            padded[: len(chosen)] = chosen
            alloc = _release(alloc, jnp.asarray(padded))
            held = [p for p in held if p not in chosen]
        assert int(alloc.pages_in_use()) == len(held)
        free = np.asarray(alloc.free_stack)[: int(alloc.num_free)]
        assert sorted(free.tolist() + held) == list(range(num_pages))


@settings(max_examples=25, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 8]),
    chunks=st.lists(st.integers(0, 9), min_size=1, max_size=6),
)
def test_memory_bytes_is_pages_in_use_times_page_bytes(page_size, chunks):
    kv = KVState.create(
        num_layers=1,
        batch=2,
        num_kv_heads=2,
        head_dim=8,
        max_tokens=64,
        page_size=page_size,
        num_pages=200,
        dtype=jnp.bfloat16,
    )
    pool, table, lengths = kv.pool, kv.page_table[0], kv.lengths[0]
    written = np.zeros((2, 2), int)
    for n in chunks:
        k = jnp.ones((2, 2, 9, 8), jnp.bfloat16)
        mask = jnp.arange(9)[None, None] < jnp.asarray([[n, n // 2], [0, n]])[..., None]
        pool, table, lengths = write_tokens(
            pool, table, lengths, k, k, jnp.zeros((2, 9), jnp.int32), mask
        )
        written += np.array([[n, n // 2], [0, n]])
    np.testing.assert_array_equal(np.asarray(lengths), written)
    pages = int(np.sum(-(-written // page_size)))
    state = KVState(pool=pool, page_table=table[None], lengths=lengths[None])
    assert int(state.pages_in_use()) == pages
    assert (
        state.memory_bytes()
        == pages * pool.page_bytes
        == pages * (page_size * 8 * 4 + page_size * 8)
    )
    held = np.asarray(table)[np.asarray(table) >= 0]
    assert len(set(held.tolist())) == len(held)


def test_exhausted_pool_sets_flag_and_writes_nothing():
    kv = KVState.create(
        num_layers=1,
        batch=1,
        num_kv_heads=2,
        head_dim=4,
        max_tokens=32,
        page_size=4,
        num_pages=3,
        dtype=jnp.float32,
    )
    pool, table, lengths = kv.pool, kv.page_table[0], kv.lengths[0]
    k = jnp.arange(2 * 8 * 4, dtype=jnp.float32).reshape(1, 2, 8, 4)
    positions = jnp.arange(8)[None]
    # 4 tokens per head: 2 pages, fits.
    mask = jnp.broadcast_to(jnp.arange(8) < 4, (1, 2, 8))
    pool, table, lengths = write_tokens(pool, table, lengths, k, k, positions, mask)
    assert not bool(pool.overflow)
    before = jax.tree.map(np.asarray, (pool.k_pages, table, lengths, pool.allocator.num_free))
    # 4 more per head: 2 more pages, only 1 free: nothing may be written.
    pool, table, lengths = write_tokens(pool, table, lengths, k, k, positions + 8, mask)
    assert bool(pool.overflow)
    after = jax.tree.map(np.asarray, (pool.k_pages, table, lengths, pool.allocator.num_free))
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(b, a)
    state = KVState(pool=pool, page_table=table[None], lengths=lengths[None])
    with pytest.raises(PoolExhaustedError, match="num_pages=3"):
        state.check()
