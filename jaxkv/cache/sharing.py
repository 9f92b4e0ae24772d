"""Rows that share one context's pages: a compressed context held once, read by many rows.

`fork_rows` turns a one-row state (a compressed context) into N rows whose page tables point
at the context's full pages; each row gets its own copy of each head's partial last page (the
next token of a row is written there), so no row ever writes a shared page. Shared pages are
never released either: the callers refuse eviction on a state with shared rows
(`jaxkv.generation.Session`), and `repack` copies a shared page once.

Bytes held = the context's full pages once + per row its own pages (the context's partial
tails, then what the row reads and generates).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.repack import gathered_pool, table_of_width
from jaxkv.cache.state import KVState, PagePool
from jaxkv.sharding import to_host


def _forked_pages(lengths: np.ndarray, shared_entries: np.ndarray, p: int, num_rows: int) -> int:
    """Pages `_fork_pool` gives heads holding `lengths` int [...] tokens whose first
    `shared_entries` [...] table entries are shared: those once, the rest once per row."""
    held = -(-lengths // p)
    shared = np.minimum(shared_entries, held)
    return int(np.sum(shared) + num_rows * np.sum(held - shared))


def fork_pages_needed(kv: KVState, num_rows: int) -> tuple[int, int | None]:
    """Host-side (pages, int8 pages or None without an int8 tier) a `fork_rows` copy of the
    one-row `kv` holds before any row reads more: the context's full pages once, its partial
    pages once per row; with an int8 tier, every model-dtype page once per row (the window's
    tokens move as they age, so no row may share them) and the int8 tier's as above."""
    p = kv.pool.page_size
    tier = kv.pool.int8
    full = to_host(kv.full_precision_lengths())
    if tier is None:
        return _forked_pages(full, full // p, p, num_rows), None
    int8 = to_host(tier.lengths)
    return _forked_pages(full, np.zeros_like(full), p, num_rows), _forked_pages(
        int8, int8 // p, p, num_rows
    )


def _fork_pool(pool: PagePool, table, lengths, shared_entries, num_rows, num_pages, max_pages):
    """One pool's half of `fork_rows`: table [L, K, M] and lengths [L, K] of the context row,
    each head's first shared_entries [L, K] table entries shared by every row and the rest of
    its held pages copied per row. Returns (pool of `num_pages` pages, tables [L, N, K,
    max_pages]), the pool flagged `overflow` if the pages do not fit."""
    p = pool.page_size
    entry = jnp.arange(table.shape[-1])
    held = (entry < -(-lengths // p)[..., None]) & (table >= 0)  # [L, K, M]
    shared = held & (entry < shared_entries[..., None])
    own = held & ~shared
    shared_id = (jnp.cumsum(shared.reshape(-1)) - 1).reshape(shared.shape)
    own_rank = (jnp.cumsum(own.reshape(-1)) - 1).reshape(own.shape)
    num_shared, num_own = jnp.sum(shared), jnp.sum(own)
    own_id = num_shared + jnp.arange(num_rows)[:, None, None, None] * num_own + own_rank
    new_table = jnp.where(shared, shared_id, jnp.where(own, own_id, -1))  # [N, L, K, M]
    new_table = table_of_width(new_table, max_pages).transpose(1, 0, 2, 3)
    source = (
        jnp.zeros((num_pages,), jnp.int32)
        .at[jnp.where(shared, shared_id, num_pages).reshape(-1)]
        .set(table.reshape(-1), mode="drop")
        .at[jnp.where(own, own_id, num_pages).reshape(-1)]
        .set(jnp.broadcast_to(table, own_id.shape).reshape(-1), mode="drop")
    )
    in_use = num_shared + num_rows * num_own
    fits = (in_use <= num_pages) & jnp.all(lengths <= max_pages * p)
    return gathered_pool(pool, source, in_use, fits), new_table


def _repeat_rows(tree, num_rows: int):
    """Every leaf of `tree` (row axis 1) repeated `num_rows` times along it."""
    return jax.tree.map(lambda leaf: jnp.repeat(leaf, num_rows, axis=1), tree)


def fork_rows(
    kv: KVState,
    *,
    num_rows: int,
    num_pages: int,
    max_pages: int,
    int8_geometry: tuple[int, int] | None = None,
) -> KVState:
    """`num_rows` rows over the one-row state `kv`, in a new pool of `num_pages` pages with
    page tables of `max_pages` entries: each row's table names the context's full pages
    (shared) and its own copy of each head's partial last page. Flagged `overflow` if the
    pages do not fit (checked on the host). The local ring, if any, is copied to every row.

    With an int8 tier (in `int8_geometry` = (num_pages, max_pages), needed exactly then), the
    int8 tier's pages are shared as above and every model-dtype page is copied per row: a
    row's spill moves its window's tokens within those pages.

    kv: a state of batch 1 (the caller checks).
    """
    tier = kv.pool.int8
    if (tier is None) != (int8_geometry is None):
        raise ValueError("int8_geometry is needed exactly when the state has int8 storage")
    p = kv.pool.page_size
    lengths = kv.full_precision_lengths()[:, 0]  # [L, K]
    shared_entries = lengths // p if tier is None else jnp.zeros_like(lengths)
    pool, table = _fork_pool(
        kv.pool, kv.page_table[:, 0], lengths, shared_entries, num_rows, num_pages, max_pages
    )
    if tier is not None:
        int8_lengths = tier.lengths[:, 0]
        int8_pool, int8_table = _fork_pool(
            tier.pool,
            tier.page_table[:, 0],
            int8_lengths,
            int8_lengths // p,
            num_rows,
            *int8_geometry,
        )
        per_row = _repeat_rows(
            (tier.lengths, tier.k_channel_scales, tier.v_channel_scales), num_rows
        )
        tier = dataclasses.replace(
            tier,
            pool=int8_pool,
            page_table=int8_table,
            lengths=per_row[0],
            k_channel_scales=per_row[1],
            v_channel_scales=per_row[2],
        )
        pool = dataclasses.replace(pool, int8=tier, overflow=pool.overflow | int8_pool.overflow)
    ring = None if kv.ring is None else _repeat_rows(kv.ring, num_rows)
    return dataclasses.replace(
        kv,
        pool=pool,
        page_table=table,
        lengths=jnp.repeat(kv.lengths, num_rows, axis=1),
        ring=ring,
    )


def duplicate_entries(page_table, pool: PagePool) -> int:
    """Host-side int: entries of `page_table` naming a page of `pool` that another entry names
    as well (0 unless rows share pages; one device's state: the tables of the model-dtype
    pool or of an int8 tier)."""
    return int(np.sum(to_host(page_table) >= 0)) - int(to_host(pool.allocator.pages_in_use()))


@dataclasses.dataclass(frozen=True)
class RowPages:
    """Pages of a state whose rows may share pages (host-side counts).

    Attributes:
      shared: pages named by more than one row.
      own: int [B] pages each row alone names.
    """

    shared: int
    own: np.ndarray


def row_pages(kv: KVState) -> RowPages:
    """Which model-dtype pages of a one-device state are shared by rows and which each row
    owns (`tier_row_pages` for the int8 tier's)."""
    return _pages_by_row(to_host(kv.page_table), kv.pool.num_pages)


def tier_row_pages(kv: KVState) -> RowPages:
    """`row_pages` of the int8 tier of a one-device state with int8 storage."""
    tier = kv.pool.int8
    return _pages_by_row(to_host(tier.page_table), tier.pool.num_pages)


def _pages_by_row(table: np.ndarray, num_pages: int) -> RowPages:
    """`RowPages` of page tables [L, B, K, M] over a pool of `num_pages` pages."""
    batch = table.shape[1]
    rows_naming = np.zeros(num_pages, np.int64)
    for row in range(batch):
        rows_naming[np.unique(table[:, row][table[:, row] >= 0])] += 1
    own = np.array(
        [int(np.sum(rows_naming[table[:, row][table[:, row] >= 0]] == 1)) for row in range(batch)]
    )
    return RowPages(shared=int(np.sum(rows_naming > 1)), own=own)


def shared_and_own_bytes(kv: KVState) -> tuple[int, np.ndarray]:
    """Host-side (bytes of the pages rows share, held once; int64 [B] bytes each row alone
    holds) of a one-device state: both tiers' pages, and with an int8 tier each row's channel
    scales (its own)."""
    pages = row_pages(kv)
    shared = pages.shared * kv.pool.page_bytes
    own = pages.own.astype(np.int64) * kv.pool.page_bytes
    tier = kv.pool.int8
    if tier is not None:
        int8 = tier_row_pages(kv)
        shared += int8.shared * tier.pool.page_bytes
        own += int8.own.astype(np.int64) * tier.pool.page_bytes
        own += tier.channel_scale_bytes // len(own)
    return shared, own
