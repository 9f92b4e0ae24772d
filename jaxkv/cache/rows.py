"""Rows of a long-lived state that requests come and go through (`jaxkv.engine`): a program
runs on some rows (`take_rows`, then `put_rows`: the pool is shared, only the rows' tables,
lengths and local rings are gathered), a row moves to another without copying a page
(`move_row`), a one-row state with its own pool moves in (`insert_row`: a preempted request
swapped back from the host), a row reads another's tokens without copying its full pages
(`attach_row`: a question over a cached context) and a finished row gives back the pages no
other row names (`release_rows`).

With int8 storage every one of them covers both tiers: a row's int8 tables, lengths and channel
scales move with it, and its int8 pages are shared, copied and released like its model-dtype
ones. A prompt is read without the tier (`without_int8`: every token stays in the model dtype
until the policy has compressed it, as `generate` reads one), and `put_rows` takes such a part
back, the rows' int8 fields unchanged.

All are pure functions of the state, jitted by the caller with the state donated, so a row
changes in place and the pools' sizes never do.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.cache.allocator import allocate, release
from jaxkv.cache.state import KVState, PagePool


def _row_fields(kv: KVState):
    """The per-row fields of `kv` (row axis 1 in each): tables, lengths, the local ring, and
    the int8 tier's tables, lengths and channel scales (None without a tier)."""
    tier = kv.pool.int8
    tier_fields = None
    if tier is not None:
        tier_fields = (tier.page_table, tier.lengths, tier.k_channel_scales, tier.v_channel_scales)
    return kv.page_table, kv.lengths, kv.ring, tier_fields


def _with_row_fields(kv: KVState, fields, pool: PagePool | None = None) -> KVState:
    """`kv` over `pool` (default its own) with its per-row fields `fields` (`_row_fields`)."""
    table, lengths, ring, tier_fields = fields
    pool = kv.pool if pool is None else pool
    if tier_fields is not None:
        tier_table, tier_lengths, k_scales, v_scales = tier_fields
        tier = dataclasses.replace(
            pool.int8,
            page_table=tier_table,
            lengths=tier_lengths,
            k_channel_scales=k_scales,
            v_channel_scales=v_scales,
        )
        pool = dataclasses.replace(pool, int8=tier)
    return dataclasses.replace(kv, pool=pool, page_table=table, lengths=lengths, ring=ring)


def without_int8(kv: KVState) -> KVState:
    """`kv` as a state without int8 storage: what a prompt's prefill and compression run on
    (every token in the model dtype; the rows' int8 tiers must be empty)."""
    return dataclasses.replace(kv, pool=dataclasses.replace(kv.pool, int8=None))


def take_rows(kv: KVState, rows: jax.Array) -> KVState:
    """The state of rows `rows` (int32 [R], distinct) over the same pool: what a program runs
    on, then gives back with `put_rows`."""
    return _with_row_fields(kv, jax.tree.map(lambda x: x[:, rows], _row_fields(kv)))


def put_rows(kv: KVState, rows: jax.Array, part: KVState) -> KVState:
    """`kv` with rows `rows` (int32 [R], distinct) replaced by `part`'s (a `take_rows` state
    after a program ran on it, or its `without_int8`: the rows' int8 fields then stay) and
    `part`'s pool, where those rows' pages live."""
    whole, new = _row_fields(kv), _row_fields(part)
    pool = part.pool
    if new[3] is None and whole[3] is not None:
        new = (*new[:3], jax.tree.map(lambda x: x[:, rows], whole[3]))
        pool = dataclasses.replace(pool, int8=kv.pool.int8)
    fields = jax.tree.map(lambda x, y: x.at[:, rows].set(y), whole, new)
    return _with_row_fields(kv, fields, pool)


def _emptied(kv: KVState, rows: jax.Array) -> KVState:
    """`kv` with the rows where `rows` (bool [B]) is set naming no page: tables, lengths and
    local ring cleared (channel scales are left: a row's next tier sets its own)."""
    table, lengths, ring, tier_fields = _row_fields(kv)
    tables, heads = rows[None, :, None, None], rows[None, :, None]
    if ring is not None:
        ring = dataclasses.replace(
            ring,
            positions=jnp.where(heads, -1, ring.positions),
            count=jnp.where(rows[None, :], 0, ring.count),
            admitted=jnp.where(rows[None, :, None, None], False, ring.admitted),
        )
    if tier_fields is not None:
        tier_table, tier_lengths, k_scales, v_scales = tier_fields
        tier_fields = (
            jnp.where(tables, -1, tier_table),
            jnp.where(heads, 0, tier_lengths),
            k_scales,
            v_scales,
        )
    fields = (jnp.where(tables, -1, table), jnp.where(heads, 0, lengths), ring, tier_fields)
    return _with_row_fields(kv, fields)


def move_row(kv: KVState, source: jax.Array, destination: jax.Array) -> KVState:
    """`kv` with row `source`'s pages, lengths and ring (and int8 fields) moved to the empty row
    `destination` (int32 []), `source` left empty; no page is copied."""
    moved = put_rows(kv, destination[None], take_rows(kv, source[None]))
    return _emptied(moved, jnp.arange(kv.page_table.shape[1]) == source)


def _pages_alone(table: jax.Array, num_pages: int, chosen: jax.Array) -> jax.Array:
    """bool [num_pages]: the pages that entries of table [L, B, K, M] where `chosen` (broadcast
    to it) name and no other entry of an unchosen row does."""
    named = table >= 0

    def pages_named(where):
        ids = jnp.where(where, table, num_pages).reshape(-1)
        return jnp.zeros((num_pages,), bool).at[ids].set(True, mode="drop")

    return pages_named(named & chosen) & ~pages_named(named & ~chosen)


def _released(pool: PagePool, table: jax.Array, chosen: jax.Array) -> PagePool:
    freed = _pages_alone(table, pool.num_pages, chosen)
    freed = jnp.where(freed, jnp.arange(pool.num_pages, dtype=jnp.int32), -1)
    return dataclasses.replace(pool, allocator=release(pool.allocator, freed))


def release_rows(kv: KVState, rows: jax.Array) -> KVState:
    """`kv` with the rows where `rows` (bool [B]) is set emptied: their tables, lengths and
    local ring cleared, and each page they name (in either tier) back to its pool once, unless
    a row kept names it too (a context's pages that rows attached to it share, `attach_row`)."""
    chosen = rows[None, :, None, None]
    pool = _released(kv.pool, kv.page_table, chosen)
    tier = kv.pool.int8
    if tier is not None:
        tier = dataclasses.replace(tier, pool=_released(tier.pool, tier.page_table, chosen))
        pool = dataclasses.replace(pool, int8=tier)
    return _emptied(dataclasses.replace(kv, pool=pool), rows)


def _own(table: jax.Array, num_pages: int) -> jax.Array:
    named = table >= 0
    ids = jnp.where(named, table, num_pages)
    refs = jnp.zeros((num_pages,), jnp.int32).at[ids.reshape(-1)].add(1, mode="drop")
    alone = named & (refs[jnp.minimum(ids, num_pages - 1)] == 1)
    return jnp.sum(alone, axis=(0, 2, 3))


def own_pages(kv: KVState) -> jax.Array:
    """int32 [T, B]: the pages each row alone names (what releasing it frees) in each tier
    (T = 1, or 2 with int8 storage: model-dtype, then int8); a page that rows share (a
    context's and its attached rows') counts for none of them."""
    counts = [_own(kv.page_table, kv.pool.num_pages)]
    tier = kv.pool.int8
    if tier is not None:
        counts.append(_own(tier.page_table, tier.pool.num_pages))
    return jnp.stack(counts)


def _page_fields(pool: PagePool):
    """The per-page arrays of a pool ([P, ...]): what copying a page copies."""
    return (
        pool.k_pages,
        pool.v_pages,
        pool.token_positions,
        pool.token_scores,
        pool.k_scales,
        pool.v_scales,
        pool.key_min,
        pool.key_max,
    )


def _with_page_fields(pool: PagePool, fields) -> PagePool:
    names = ("k_pages", "v_pages", "token_positions", "token_scores")
    names += ("k_scales", "v_scales", "key_min", "key_max")
    return dataclasses.replace(pool, **dict(zip(names, fields, strict=True)))


def _allocated(pool: PagePool, wanted: jax.Array):
    """(allocator, new page id per entry where `wanted` (bool, any shape) else -1, ok): a page
    of `pool` for each wanted entry, all or none."""
    flat = wanted.reshape(-1)
    count = jnp.sum(flat).astype(jnp.int32)
    allocator, pages, ok = allocate(pool.allocator, count[None], flat.size)
    rank = jnp.cumsum(flat) - 1
    ids = jnp.where(flat, pages[0][jnp.maximum(rank, 0)], -1)
    return allocator, ids.reshape(wanted.shape), ok


def _copied(pool, source_pool, source_ids, new_ids, allocator, ok) -> PagePool:
    """`pool` with the pages `source_ids` of `source_pool` copied to `new_ids` (same shape, -1:
    none) and `allocator`, where `ok`; else unchanged but flagged `overflow`."""
    into = jnp.where((new_ids >= 0) & ok, new_ids, pool.num_pages).reshape(-1)
    source = jnp.maximum(source_ids, 0).reshape(-1)
    fields = jax.tree.map(
        lambda x, y: x.at[into].set(y[source], mode="drop"),
        _page_fields(pool),
        _page_fields(source_pool),
    )
    allocator = jax.tree.map(lambda new, old: jnp.where(ok, new, old), allocator, pool.allocator)
    pool = _with_page_fields(pool, fields)
    return dataclasses.replace(pool, allocator=allocator, overflow=pool.overflow | ~ok)


def _joined(pool: PagePool, pools: list[PagePool]) -> PagePool:
    """`pools` (the model-dtype pool, then the int8 tier's where there is one) as one pool
    whose tier is `pool`'s with its pool replaced."""
    if len(pools) == 1:
        return pools[0]
    return dataclasses.replace(pools[0], int8=dataclasses.replace(pool.int8, pool=pools[1]))


def _placed(one, tables, ok, whole, row):
    """A row's fields `one` (`_row_fields` of one row) naming `tables` (per tier), or where
    not `ok` nothing: lengths 0 and the ring as row `row` of the fields `whole` holds it."""
    _, lengths, ring, tier_fields = one
    if ring is not None:
        ring = jax.tree.map(lambda x, y: jnp.where(ok, x, y[:, row]), ring, whole[2])
    if tier_fields is not None:
        tier_fields = (tables[1], jnp.where(ok, tier_fields[1], 0), *tier_fields[2:])
    return tables[0], jnp.where(ok, lengths, 0), ring, tier_fields


def _all_ok(allocations) -> jax.Array:
    return jnp.all(jnp.stack([ok for _, _, ok in allocations]))


def insert_row(kv: KVState, row: KVState, slot: jax.Array) -> KVState:
    """`kv` with the one-row state `row` (its own pools, tables no wider than kv's, int8
    storage as kv's) copied into row `slot` (int32 [], an empty row): its held pages to free
    pages of kv's pools, its tables, lengths, local ring and channel scales. Flagged `overflow`
    (nothing written) when a pool of kv has too few free pages (checked on the host)."""
    whole, one = _row_fields(kv), jax.tree.map(lambda x: x[:, 0], _row_fields(row))
    tiers = [(kv.pool, row.pool, one[0], kv.page_table.shape[-1])]
    if whole[3] is not None:
        tiers.append((kv.pool.int8.pool, row.pool.int8.pool, one[3][0], whole[3][0].shape[-1]))
    allocations = [_allocated(pool, table >= 0) for pool, _, table, _ in tiers]
    ok = _all_ok(allocations)
    pools, tables = [], []
    for (pool, source, table, width), (allocator, ids, _) in zip(tiers, allocations, strict=True):
        pools.append(_copied(pool, source, table, ids, allocator, ok))
        wide = jnp.full(table.shape[:-1] + (width,), -1, jnp.int32)
        tables.append(jnp.where(ok, wide.at[..., : table.shape[-1]].set(ids), -1))
    new = _placed(one, tables, ok, whole, slot)
    fields = jax.tree.map(lambda x, y: x.at[:, slot].set(y), whole, new)
    return _with_row_fields(kv, fields, _joined(kv.pool, pools))


def attach_row(kv: KVState, context: jax.Array, destination: jax.Array) -> KVState:
    """`kv` with the empty row `destination` (int32 []) reading row `context`'s tokens: its
    tables name the context's full pages (shared: nothing writes them while rows name them
    both) and its own copy of each head's partial last page (its next token is written there);
    its lengths, local ring (and channel scales) are the context's. With int8 storage the
    int8 tier's pages are shared so, and every model-dtype page is copied (a row's spill moves
    its window's tokens within those pages). `Session.fork` within one pool. Flagged `overflow`
    (nothing attached) when a pool has too few free pages for the copies (checked on the
    host)."""
    whole = _row_fields(kv)
    one = jax.tree.map(lambda x: x[:, context], whole)
    p, tier = kv.pool.page_size, kv.pool.int8
    full_lengths = kv.full_precision_lengths()[:, context]  # [L, K]
    tiers = [(kv.pool, one[0], _copied_entries(one[0], full_lengths, p, tier is not None))]
    if tier is not None:
        tiers.append((tier.pool, one[3][0], _copied_entries(one[3][0], one[3][1], p, False)))
    allocations = [_allocated(pool, wanted) for pool, _, wanted in tiers]
    ok = _all_ok(allocations)
    pools, tables = [], []
    for (pool, table, _), (allocator, ids, _) in zip(tiers, allocations, strict=True):
        pools.append(_copied(pool, pool, table, ids, allocator, ok))
        tables.append(jnp.where(ok, jnp.where(ids >= 0, ids, table), -1))
    new = _placed(one, tables, ok, whole, destination)
    fields = jax.tree.map(lambda x, y: x.at[:, destination].set(y), whole, new)
    return _with_row_fields(kv, fields, _joined(kv.pool, pools))


def _copied_entries(table: jax.Array, lengths: jax.Array, page_size: int, every: bool):
    """bool like table [L, K, M]: the entries a row attached to these heads copies: each
    head's partial last page, or (`every`) each page it holds."""
    entry = jnp.arange(table.shape[-1])
    if every:
        return (entry < -(-lengths // page_size)[..., None]) & (table >= 0)
    partial = (lengths % page_size > 0)[..., None]
    return partial & (entry == (lengths // page_size)[..., None])
