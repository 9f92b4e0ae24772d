"""Rows of a long-lived state that requests come and go through (`jaxkv.engine`): a program
runs on some rows (`take_rows`, then `put_rows`: the pool is shared, only the rows' tables,
lengths and local rings are gathered), a row moves to another without copying a page
(`move_row`), a one-row state with its own pool moves in (`insert_row`: a preempted request
swapped back from the host), a row reads another's tokens without copying its full pages
(`attach_row`: a question over a cached context) and a finished row gives back the pages no
other row names (`release_rows`).

All are pure functions of the state, jitted by the caller with the state donated, so a row
changes in place and the pool's size never does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.cache.allocator import allocate, release
from jaxkv.cache.state import KVState


def _row_fields(kv: KVState):
    """The per-row fields of `kv` (row axis 1 in each): tables, lengths, the local ring."""
    if kv.pool.int8 is not None:
        raise ValueError("rows of a state with an int8 tier are not moved (no engine runs one)")
    return kv.page_table, kv.lengths, kv.ring


def _with_row_fields(kv: KVState, fields) -> KVState:
    table, lengths, ring = fields
    return dataclasses.replace(kv, page_table=table, lengths=lengths, ring=ring)


def take_rows(kv: KVState, rows: jax.Array) -> KVState:
    """The state of rows `rows` (int32 [R], distinct) over the same pool: what a program runs
    on, then gives back with `put_rows`."""
    return _with_row_fields(kv, jax.tree.map(lambda x: x[:, rows], _row_fields(kv)))


def put_rows(kv: KVState, rows: jax.Array, part: KVState) -> KVState:
    """`kv` with rows `rows` (int32 [R], distinct) replaced by `part`'s (a `take_rows` state
    after a program ran on it) and `part`'s pool, where those rows' pages live."""
    fields = jax.tree.map(
        lambda whole, new: whole.at[:, rows].set(new), _row_fields(kv), _row_fields(part)
    )
    return dataclasses.replace(_with_row_fields(kv, fields), pool=part.pool)


def move_row(kv: KVState, source: jax.Array, destination: jax.Array) -> KVState:
    """`kv` with row `source`'s pages, lengths and ring moved to the empty row `destination`
    (int32 []), `source` left empty; no page is copied."""
    empty = release_rows(take_rows(kv, source[None]), jnp.ones((1,), bool))
    empty = dataclasses.replace(empty, pool=kv.pool)  # the pages are not freed: they move
    moved = put_rows(kv, destination[None], take_rows(kv, source[None]))
    return put_rows(moved, source[None], empty)


def insert_row(kv: KVState, row: KVState, slot: jax.Array) -> KVState:
    """`kv` with the one-row state `row` (its own pool, a table no wider than kv's, no int8
    tier) copied into row `slot` (int32 [], an empty row): its held pages to free pages of kv's
    pool, its table, lengths and local ring. Flagged `overflow` (nothing written) when kv's
    pool has too few free pages (checked on the host)."""
    table = row.page_table[:, 0]  # [L, K, M_row]
    held = table >= 0
    flat = held.reshape(-1)
    count = jnp.sum(flat).astype(jnp.int32)
    allocator, pages, ok = allocate(kv.pool.allocator, count[None], flat.size)
    rank = jnp.cumsum(flat) - 1
    new_ids = jnp.where(flat, pages[0][jnp.maximum(rank, 0)], -1)  # each held entry's page
    destination = jnp.where(flat & ok, new_ids, kv.pool.num_pages)
    source = jnp.maximum(table.reshape(-1), 0)

    def move(into, values):
        if into is None:
            return None
        return into.at[destination].set(values[source], mode="drop")

    pool = kv.pool
    pool = dataclasses.replace(
        pool,
        k_pages=move(pool.k_pages, row.pool.k_pages),
        v_pages=move(pool.v_pages, row.pool.v_pages),
        token_positions=move(pool.token_positions, row.pool.token_positions),
        token_scores=move(pool.token_scores, row.pool.token_scores),
        key_min=move(pool.key_min, row.pool.key_min),
        key_max=move(pool.key_max, row.pool.key_max),
        allocator=allocator,
        overflow=pool.overflow | ~ok,
    )
    width = kv.page_table.shape[-1]
    new_table = jnp.full(table.shape[:-1] + (width,), -1, jnp.int32)
    new_table = new_table.at[..., : table.shape[-1]].set(new_ids.reshape(table.shape))
    new_table = jnp.where(ok, new_table, -1)
    lengths = jnp.where(ok, row.lengths[:, 0], 0)
    ring = kv.ring
    if ring is not None:
        ring = jax.tree.map(
            lambda whole, one: whole.at[:, slot].set(jnp.where(ok, one[:, 0], whole[:, slot])),
            ring,
            row.ring,
        )
    return dataclasses.replace(
        kv,
        pool=pool,
        page_table=kv.page_table.at[:, slot].set(new_table),
        lengths=kv.lengths.at[:, slot].set(lengths),
        ring=ring,
    )


def release_rows(kv: KVState, rows: jax.Array) -> KVState:
    """`kv` with the rows where `rows` (bool [B]) is set emptied: their tables, lengths and
    local ring cleared, and each page they name back to the pool once, unless a row kept
    names it too (a context's pages that rows attached to it share, `attach_row`)."""
    chosen = rows[None, :, None, None]
    named = kv.page_table >= 0
    num_pages = kv.pool.num_pages

    def pages_named(where):
        ids = jnp.where(where, kv.page_table, num_pages).reshape(-1)
        return jnp.zeros((num_pages,), bool).at[ids].set(True, mode="drop")

    freed = pages_named(named & chosen) & ~pages_named(named & ~chosen)
    freed = jnp.where(freed, jnp.arange(num_pages, dtype=jnp.int32), -1)
    pool = dataclasses.replace(kv.pool, allocator=release(kv.pool.allocator, freed))
    ring = kv.ring
    if ring is not None:
        ring = dataclasses.replace(
            ring,
            positions=jnp.where(rows[None, :, None], -1, ring.positions),
            count=jnp.where(rows[None, :], 0, ring.count),
            admitted=jnp.where(rows[None, :, None, None], False, ring.admitted),
        )
    return dataclasses.replace(
        kv,
        pool=pool,
        page_table=jnp.where(chosen, -1, kv.page_table),
        lengths=jnp.where(rows[None, :, None], 0, kv.lengths),
        ring=ring,
    )


def own_pages(kv: KVState) -> jax.Array:
    """int32 [B]: the pages each row alone names (what releasing it frees); a page that rows
    share (a context's and its attached rows') counts for none of them."""
    named = kv.page_table >= 0
    ids = jnp.where(named, kv.page_table, kv.pool.num_pages)
    refs = jnp.zeros((kv.pool.num_pages,), jnp.int32).at[ids.reshape(-1)].add(1, mode="drop")
    alone = named & (refs[jnp.minimum(ids, kv.pool.num_pages - 1)] == 1)
    return jnp.sum(alone, axis=(0, 2, 3))


def attach_row(kv: KVState, context: jax.Array, destination: jax.Array) -> KVState:
    """`kv` with the empty row `destination` (int32 []) reading row `context`'s tokens: its
    tables name the context's full pages (shared: nothing writes them while rows name them
    both) and its own copy of each head's partial last page (its next token is written there);
    its lengths and local ring are the context's. `Session.fork` within one pool. Flagged
    `overflow` (nothing attached) when the pool has too few free pages for the copies (checked
    on the host)."""
    _row_fields(kv)  # refuses an int8 tier
    table, lengths = kv.page_table[:, context], kv.lengths[:, context]  # [L, K, M], [L, K]
    width, p = table.shape[-1], kv.pool.page_size
    full = lengths // p
    has_tail = (lengths % p > 0).reshape(-1)
    count = jnp.sum(has_tail).astype(jnp.int32)
    allocator, pages, ok = allocate(kv.pool.allocator, count[None], has_tail.size)
    rank = jnp.cumsum(has_tail) - 1
    copy_ids = jnp.where(has_tail, pages[0][jnp.maximum(rank, 0)], -1).reshape(full.shape)
    tail_entry = jnp.minimum(full, width - 1)[..., None]
    tail_ids = jnp.take_along_axis(table, tail_entry, -1)[..., 0]  # [L, K]
    into = jnp.where(has_tail & ok, copy_ids.reshape(-1), kv.pool.num_pages)
    source = jnp.maximum(tail_ids.reshape(-1), 0)

    def copy(pages):
        return None if pages is None else pages.at[into].set(pages[source], mode="drop")

    pool = dataclasses.replace(
        kv.pool.map_token_data(copy),
        key_min=copy(kv.pool.key_min),
        key_max=copy(kv.pool.key_max),
        allocator=allocator,
        overflow=kv.pool.overflow | ~ok,
    )
    is_tail = jnp.arange(width) == full[..., None]
    new_table = jnp.where(is_tail & (copy_ids >= 0)[..., None], copy_ids[..., None], table)
    new_table = jnp.where(ok, new_table, -1)
    ring = kv.ring
    if ring is not None:
        ring = jax.tree.map(
            lambda x: x.at[:, destination].set(jnp.where(ok, x[:, context], x[:, destination])),
            ring,
        )
    return dataclasses.replace(
        kv,
        pool=pool,
        page_table=kv.page_table.at[:, destination].set(new_table),
        lengths=kv.lengths.at[:, destination].set(jnp.where(ok, lengths, 0)),
        ring=ring,
    )
