"""Moving a KV state into a pool and page tables sized for what it really holds.

After compression most of the pool is free, but its arrays keep their prefill size. `repack`
copies the held pages, renumbered 0..n-1 in table order, into a pool of `num_pages` pages and
trims every page table to `max_pages` entries, so the decode loop runs on arrays sized for the
compressed cache: less memory held and fewer pages read per step. With int8 storage the int8
tier is repacked the same way into `int8_geometry = (num_pages, max_pages)`.

A repack holds the prefill pool and the decode pool at once, so it raises the request's peak by
the decode pool. Where the decode pool would be more than half the prefill pool
(`keeps_prefill_pool`), decoding stays in the prefill pool and only the page tables change
width (`retable`): the peak stays the prefill's, for at most twice the pages decode needs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.geometry import pool_pages_bucket, table_pages_bucket
from jaxkv.cache.state import KVState, PagePool
from jaxkv.sharding import to_host


def table_of_width(table, max_pages: int):
    """Page tables [..., W] trimmed or padded (with -1) to [..., max_pages]: a head's pages are
    the first entries of its table."""
    width = table.shape[-1]
    if max_pages <= width:
        return table[..., :max_pages]
    pad = [(0, 0)] * (table.ndim - 1) + [(0, max_pages - width)]
    return jnp.pad(table, pad, constant_values=-1)


def _first_references(table, pool_pages: int) -> jax.Array:
    """bool, table's shape: whether each entry is the first (in table order) to name its page
    (ids in [0, pool_pages)). Every held entry is, except where rows share pages
    (`jaxkv.cache.sharing`)."""
    flat = table.reshape(-1)
    held = flat >= 0
    entry = jnp.arange(flat.size, dtype=jnp.int32)
    first_entry = (
        jnp.full((pool_pages,), flat.size, jnp.int32)
        .at[jnp.where(held, flat, pool_pages)]
        .min(entry, mode="drop")
    )
    return (held & (first_entry[jnp.maximum(flat, 0)] == entry)).reshape(table.shape)


def _repack_pool(pool: PagePool, table, lengths, num_pages: int, max_pages: int):
    """(pool of `num_pages` pages, tables [..., max_pages]) holding the same tokens; a page
    that several rows share (`jaxkv.cache.sharing`) is copied once and stays shared."""
    p = pool.page_size
    held = table >= 0
    first = _first_references(table, pool.num_pages)
    pages_held = jnp.sum(first)
    fits = (pages_held <= num_pages) & jnp.all(lengths <= max_pages * p)
    first_id = (jnp.cumsum(first.reshape(-1)) - 1).reshape(table.shape)
    # Each old page's new id, read back by every entry that names it.
    renumber = (
        jnp.zeros((pool.num_pages,), jnp.int32)
        .at[jnp.where(first, table, pool.num_pages)]
        .set(first_id, mode="drop")
    )
    new_id = renumber[jnp.maximum(table, 0)]
    new_table = table_of_width(jnp.where(held, new_id, -1), max_pages)
    destination = jnp.where(first, first_id, num_pages).reshape(-1)
    source = jnp.zeros((num_pages,), jnp.int32).at[destination].set(table.reshape(-1), mode="drop")

    return gathered_pool(pool, source, pages_held, fits), new_table


def gathered_pool(pool: PagePool, source, in_use, fits) -> PagePool:
    """A pool whose page i holds `pool`'s page source[i] (int32 [P']: every page-aligned field
    and the key bounds), its first `in_use` pages in use and the rest free; flagged `overflow`
    unless `fits` (what was to be held fits in it)."""
    num_pages = source.shape[0]

    def move(pages):
        return None if pages is None else pages[source]

    in_use = jnp.minimum(in_use, num_pages).astype(jnp.int32)
    allocator = PageAllocator.create(num_pages)
    allocator = dataclasses.replace(allocator, num_free=num_pages - in_use)
    return dataclasses.replace(
        pool.map_token_data(move),
        key_min=move(pool.key_min),
        key_max=move(pool.key_max),
        allocator=allocator,
        overflow=pool.overflow | ~fits,
    )


def repack(
    kv: KVState,
    *,
    num_pages: int,
    max_pages: int,
    int8_geometry: tuple[int, int] | None = None,
) -> KVState:
    """A copy of `kv` in a pool of `num_pages` pages with page tables of `max_pages` entries
    (and its int8 tier, if any, in `int8_geometry` = (num_pages, max_pages)).

    If the held pages do not fit, the copy is flagged `overflow` (checked on the host).
    """
    tier = kv.pool.int8
    if (tier is None) != (int8_geometry is None):
        raise ValueError("int8_geometry is needed exactly when the state has int8 storage")
    pool, table = _repack_pool(
        kv.pool, kv.page_table, kv.full_precision_lengths(), num_pages, max_pages
    )
    if tier is not None:
        int8_pool, int8_table = _repack_pool(
            tier.pool, tier.page_table, tier.lengths, *int8_geometry
        )
        tier = dataclasses.replace(tier, pool=int8_pool, page_table=int8_table)
        pool = dataclasses.replace(pool, int8=tier, overflow=pool.overflow | int8_pool.overflow)
    return dataclasses.replace(kv, pool=pool, page_table=table)


def keeps_prefill_pool(pool_pages: int, decode_pages: int, int8: bool = False) -> bool:
    """Whether decode runs in the prefill pool of `pool_pages` pages rather than a repacked one
    of `decode_pages`: when repacking would save at most half of it (module docstring). An int8
    tier is always repacked (its geometry changes with the window)."""
    return not int8 and pool_pages // 2 < decode_pages <= pool_pages


def retable(kv: KVState, *, max_pages: int) -> KVState:
    """`kv` with page tables of `max_pages` entries over the same pool arrays (not a program:
    the pool's buffers are shared, not copied); flagged `overflow` where a head holds more
    tokens than that many pages do. Stacked per-device states [S, ...] keep their leading axis."""
    if kv.pool.int8 is not None:
        raise ValueError("retable: a state with an int8 tier is repacked (repack)")
    too_long = kv.full_precision_lengths() > max_pages * kv.pool.page_size
    overflow = kv.pool.overflow | jnp.any(too_long, axis=(-3, -2, -1))
    pool = dataclasses.replace(kv.pool, overflow=overflow)
    return dataclasses.replace(kv, pool=pool, page_table=table_of_width(kv.page_table, max_pages))


def grow(kv: KVState, num_pages: int, int8_pages: int | None = None) -> KVState:
    """`kv` with a pool of `num_pages` (>= its own) pages: the same pages under the same ids,
    the new ones free; with an int8 tier, its pool grown to `int8_pages` (needed exactly
    then) the same way. Used during prefill by policies whose need is known only as they admit
    tokens (a policy with an admission part), and by a loaded session."""
    tier = kv.pool.int8
    if (tier is None) != (int8_pages is None):
        raise ValueError("grow: int8_pages is needed exactly when the state has an int8 tier")
    pool = _grown_pool(kv.pool, num_pages)
    if tier is not None:
        tier = dataclasses.replace(tier, pool=_grown_pool(tier.pool, int8_pages))
        pool = dataclasses.replace(pool, int8=tier)
    return dataclasses.replace(kv, pool=pool)


def _grown_pool(pool: PagePool, num_pages: int) -> PagePool:
    added = num_pages - pool.num_pages
    if added < 0:
        raise ValueError(f"grow: num_pages={num_pages} must be >= {pool.num_pages}")

    def pad(pages, fill=0):
        if pages is None:
            return None
        return jnp.pad(pages, [(0, added)] + [(0, 0)] * (pages.ndim - 1), constant_values=fill)

    # free_stack[:num_free] are the free ids: the new pages first, then the old free ones.
    new_ids = jnp.arange(num_pages - 1, pool.num_pages - 1, -1, dtype=jnp.int32)
    allocator = PageAllocator(
        free_stack=jnp.concatenate([new_ids, pool.allocator.free_stack]),
        num_free=pool.allocator.num_free + added,
    )
    return dataclasses.replace(
        pool.map_token_data(pad),
        token_positions=pad(pool.token_positions, -1),
        key_min=pad(pool.key_min),
        key_max=pad(pool.key_max),
        allocator=allocator,
    )


def _bucketed_geometry(
    grown: np.ndarray, p: int, bound_pages: int | None = None, duplicate_entries: int = 0
):
    """(pool pages, table width) for heads growing to `grown` tokens, the pool at most
    `bound_pages` when the policy bounds what it holds; `duplicate_entries` of the tables' entries
    name a page another entry names (rows sharing pages, `jaxkv.cache.sharing`)."""
    pages = int((-(-grown // p)).sum()) - duplicate_entries
    if bound_pages is not None:
        pages = min(pages, bound_pages)
    width = max(int(-(-grown.max() // p)), 1)
    return pool_pages_bucket(pages, p), table_pages_bucket(width)


def decode_geometry(
    kv: KVState,
    max_new_tokens: int,
    tokens_bound: np.ndarray | None = None,
    duplicate_entries: int = 0,
) -> tuple[int, int]:
    """(num_pages, max_pages) that hold `kv` plus up to `max_new_tokens - 1` more tokens per head
    (host side; bucketed, `jaxkv.cache.geometry`). With int8 storage: of the model-dtype pages,
    which never hold more than the window plus one token.

    tokens_bound: int [B], the policy's bound on the tokens a head of each sequence holds on
    average during decode (its decode eviction's `decode_tokens_bound`); the pool then holds
    that many per head (plus a partial page each), or what the state holds now if that is more.
    A mesh's per-device states stacked [S, ...] (`jaxkv.sharding`) get the geometry of the
    fullest device; tokens_bound is then [S, B/d], each device's rows. duplicate_entries: table
    entries that name a page another row's entry names too (held once; one device).
    """
    lengths = _per_device(to_host(kv.full_precision_lengths()))
    bounds = [None] * len(lengths)
    if tokens_bound is not None:
        bounds = np.reshape(tokens_bound, (len(lengths), -1))
    window = None if kv.pool.int8 is None else kv.pool.int8.window
    return _largest(
        device_decode_geometry(
            held, bound, max_new_tokens, kv.pool.page_size, window, duplicate_entries
        )
        for held, bound in zip(lengths, bounds, strict=True)
    )


def _per_device(lengths: np.ndarray) -> np.ndarray:
    """[L, B, K] or stacked [S, L, B, K] -> [S, L, B, K]."""
    return lengths.reshape(-1, *lengths.shape[-3:])


def _largest(geometries) -> tuple[int, int]:
    pages, widths = zip(*geometries, strict=True)
    return max(pages), max(widths)


def device_decode_geometry(
    lengths, tokens_bound, max_new_tokens, p, int8_window=None, duplicate_entries: int = 0
):
    """(num_pages, max_pages) of one device's state holding lengths int [L, B, K] (host)."""
    grown = lengths + max(max_new_tokens - 1, 0)
    if int8_window is not None:
        grown = np.minimum(grown, np.maximum(lengths, int8_window + 1))
    bound_pages = None
    if tokens_bound is not None and int8_window is None:
        heads_per_sequence = lengths.shape[0] * lengths.shape[2]
        per_head = -(-np.asarray(tokens_bound, np.int64) // p) + 1
        held = int((-(-lengths // p)).sum())
        bound_pages = max(int(per_head.sum()) * heads_per_sequence, held + lengths.size)
    return _bucketed_geometry(grown, p, bound_pages, duplicate_entries)


def int8_decode_geometry(
    kv: KVState, max_new_tokens: int, duplicate_entries: int = 0
) -> tuple[int, int]:
    """(num_pages, max_pages) of the int8 tier for `max_new_tokens` more steps (host side; of
    the fullest device for stacked states, as `decode_geometry`); `duplicate_entries` of its
    tables' entries name a page another entry names (one device)."""
    tier = kv.pool.int8
    full, held = to_host(kv.full_precision_lengths()), to_host(tier.lengths)
    grown = held + np.maximum(full + max(max_new_tokens - 1, 0) - tier.window, 0)
    return _largest(
        _bucketed_geometry(device, tier.pool.page_size, duplicate_entries=duplicate_entries)
        for device in _per_device(grown)
    )
