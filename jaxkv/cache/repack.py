"""Moving a KV state into a pool and page tables sized for what it really holds.

After compression most of the pool is free, but its arrays keep their prefill size. `repack`
copies the held pages, renumbered 0..n-1 in table order, into a pool of `num_pages` pages and
trims every page table to `max_pages` entries, so the decode loop runs on arrays sized for the
compressed cache: less memory held and fewer pages read per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.state import KVState


def repack(kv: KVState, *, num_pages: int, max_pages: int) -> KVState:
    """A copy of `kv` in a pool of `num_pages` pages with page tables of `max_pages` entries.

    If the held pages do not fit, the copy is flagged `overflow` (checked on the host).
    """
    p = kv.pool.page_size
    table = kv.page_table
    held = table >= 0
    fits = (jnp.sum(held) <= num_pages) & jnp.all(kv.lengths <= max_pages * p)
    new_id = (jnp.cumsum(held.reshape(-1)) - 1).reshape(table.shape)
    new_table = jnp.where(held, new_id, -1)
    width = table.shape[-1]
    if max_pages <= width:
        new_table = new_table[..., :max_pages]
    else:
        pad = [(0, 0)] * (table.ndim - 1) + [(0, max_pages - width)]
        new_table = jnp.pad(new_table, pad, constant_values=-1)
    destination = jnp.where(held, new_id, num_pages).reshape(-1)
    source = jnp.zeros((num_pages,), jnp.int32).at[destination].set(table.reshape(-1), mode="drop")

    def move(pages):
        return None if pages is None else pages[source]

    in_use = jnp.minimum(jnp.sum(held), num_pages).astype(jnp.int32)
    allocator = PageAllocator.create(num_pages)
    allocator = dataclasses.replace(allocator, num_free=num_pages - in_use)
    pool = dataclasses.replace(
        kv.pool,
        k_pages=move(kv.pool.k_pages),
        v_pages=move(kv.pool.v_pages),
        token_positions=move(kv.pool.token_positions),
        token_scores=move(kv.pool.token_scores),
        key_min=move(kv.pool.key_min),
        key_max=move(kv.pool.key_max),
        allocator=allocator,
        overflow=kv.pool.overflow | ~fits,
    )
    return dataclasses.replace(kv, pool=pool, page_table=new_table)


def decode_geometry(
    kv: KVState, max_new_tokens: int, round_pages: int = 32, round_table: int = 8
) -> tuple[int, int]:
    """(num_pages, max_pages) that hold `kv` plus up to `max_new_tokens - 1` more tokens per head
    (host side; rounded up so that similar requests share one compiled decode loop)."""
    p = kv.pool.page_size
    lengths = jax.device_get(kv.lengths)
    grown = lengths + max(max_new_tokens - 1, 0)
    pages = int((-(-grown // p)).sum())
    width = int(-(-grown.max() // p))
    return -(-pages // round_pages) * round_pages, -(-width // round_table) * round_table
