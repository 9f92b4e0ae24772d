"""Rows of a long-lived state that requests come and go through (`jaxkv.engine`): a request's
compressed state moves into a free row's pages, and a finished row gives its pages back.

Both are pure functions of the state, jitted by the caller with the state donated, so a row
changes in place and the pool's size never does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.cache.allocator import allocate, release
from jaxkv.cache.state import KVState


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
