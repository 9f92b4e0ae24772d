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
from jaxkv.cache.state import KVState
from jaxkv.sharding import to_host


def fork_pages_needed(kv: KVState, num_rows: int) -> int:
    """Host-side int: pages a `fork_rows` copy of the one-row `kv` holds (before any row
    reads more): the context's full pages once, its partial pages once per row."""
    lengths = to_host(kv.lengths)
    p = kv.pool.page_size
    return int(np.sum(lengths // p) + num_rows * np.sum(lengths % p > 0))


def fork_rows(kv: KVState, *, num_rows: int, num_pages: int, max_pages: int) -> KVState:
    """`num_rows` rows over the one-row state `kv`, in a new pool of `num_pages` pages with
    page tables of `max_pages` entries: each row's table names the context's full pages
    (shared) and its own copy of each head's partial last page. Flagged `overflow` if the
    pages do not fit (checked on the host). The local ring, if any, is copied to every row.

    kv: a state of batch 1 without an int8 tier (the caller checks both).
    """
    pool, table, lengths = kv.pool, kv.page_table[:, 0], kv.lengths[:, 0]  # [L, K, M], [L, K]
    p = pool.page_size
    entry = jnp.arange(table.shape[-1])
    full = lengths // p
    shared = (entry < full[..., None]) & (table >= 0)  # [L, K, M]
    shared_id = (jnp.cumsum(shared.reshape(-1)) - 1).reshape(shared.shape)
    num_shared = jnp.sum(shared)
    has_tail = lengths % p > 0  # [L, K]
    tail_rank = (jnp.cumsum(has_tail.reshape(-1)) - 1).reshape(has_tail.shape)
    num_tails = jnp.sum(has_tail)
    rows = jnp.arange(num_rows)[:, None, None]
    tail_id = num_shared + rows * num_tails + tail_rank  # [N, L, K]
    context_table = table_of_width(jnp.where(shared, shared_id, -1), max_pages)
    new_table = jnp.broadcast_to(context_table, (num_rows, *context_table.shape))
    tail_entry = jnp.arange(max_pages) == full[..., None]  # [L, K, max_pages]
    new_table = jnp.where(
        tail_entry & has_tail[..., None], tail_id[..., None], new_table
    ).transpose(1, 0, 2, 3)  # [L, N, K, max_pages]
    tail_page = jnp.take_along_axis(table, jnp.minimum(full, table.shape[-1] - 1)[..., None], -1)
    in_use = num_shared + num_rows * num_tails
    source = (
        jnp.zeros((num_pages,), jnp.int32)
        .at[jnp.where(shared, shared_id, num_pages).reshape(-1)]
        .set(table.reshape(-1), mode="drop")
        .at[jnp.where(has_tail, tail_id, num_pages).reshape(-1)]
        .set(jnp.broadcast_to(tail_page[..., 0], tail_id.shape).reshape(-1), mode="drop")
    )

    fits = (in_use <= num_pages) & jnp.all(lengths <= max_pages * p)
    new_pool = gathered_pool(pool, source, in_use, fits)
    ring = kv.ring
    if ring is not None:
        ring = jax.tree.map(lambda leaf: jnp.repeat(leaf, num_rows, axis=1), ring)
    return dataclasses.replace(
        kv,
        pool=new_pool,
        page_table=new_table,
        lengths=jnp.repeat(kv.lengths, num_rows, axis=1),
        ring=ring,
    )


def duplicate_entries(kv: KVState) -> int:
    """Host-side int: page-table entries naming a page that another entry names as well (0
    unless rows share pages; one device's state)."""
    return int(np.sum(to_host(kv.page_table) >= 0)) - int(to_host(kv.pages_in_use()))


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
    """Which pages of a one-device state are shared by rows and which each row owns."""
    table = to_host(kv.page_table)  # [L, B, K, M]
    batch = table.shape[1]
    rows_naming = np.zeros(kv.pool.num_pages, np.int64)
    for row in range(batch):
        rows_naming[np.unique(table[:, row][table[:, row] >= 0])] += 1
    own = np.array(
        [int(np.sum(rows_naming[table[:, row][table[:, row] >= 0]] == 1)) for row in range(batch)]
    )
    return RowPages(shared=int(np.sum(rows_naming > 1)), own=own)
