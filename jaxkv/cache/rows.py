"""Rows of a long-lived state that requests come and go through (`jaxkv.engine`): a program
runs on some rows (`take_rows`, then `put_rows`: the pool is shared, only the rows' tables,
lengths and local rings are gathered), a row moves to another without copying a page
(`move_row`), a one-row state with its own pool moves in (`insert_row`: a preempted request
swapped back from the host) and a finished row gives its pages back (`release_rows`).

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
    """`kv` with the rows where `rows` (bool [B]) is set emptied: their pages back to the pool,
    their tables, lengths and local ring cleared."""
    chosen = rows[None, :, None, None]
    freed = jnp.where(chosen & (kv.page_table >= 0), kv.page_table, -1)
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
