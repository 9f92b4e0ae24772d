"""Writing into one layer of a page pool: appending a chunk's tokens, accumulating their scores."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxkv.cache.allocator import allocate
from jaxkv.cache.slots import set_from_itself
from jaxkv.cache.state import PagePool


def _ceil_div(x, d):
    return (x + d - 1) // d


def write_tokens(
    pool: PagePool,
    page_table: jax.Array,
    lengths: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    write_mask: jax.Array,
    scores: jax.Array | None = None,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> tuple[PagePool, jax.Array, jax.Array]:
    """Appends the masked tokens of a chunk to each (sequence, KV head) of one layer.

    Args:
      pool: the shared page pool.
      page_table: int32 [B, K, M]; lengths: int32 [B, K] (the tokens this pool holds).
      k, v: [B, K, C, H] new keys (post-RoPE) and values.
      positions: int32 [B, C] (or [B, K, C]) original positions of the chunk's tokens.
      write_mask: bool [B, K, C]; which tokens each head stores (admission).
      scores: f32 [B, K, C] initial per-token scores (default 0).
      k_scales, v_scales: f32 [B, K, C] per-token scales, for a pool with int8 pages only.
    Returns:
      (pool, page_table, lengths). If the pages needed do not fit in the pool or in the page
      table, nothing is written and `pool.overflow` is set.
    """
    b, num_kv, c, h = k.shape
    p = pool.page_size
    max_pages = page_table.shape[-1]
    new_lengths = lengths + jnp.sum(write_mask, axis=-1, dtype=jnp.int32)
    pages_held = _ceil_div(lengths, p)
    pages_needed = _ceil_div(new_lengths, p)
    max_new_pages = _ceil_div(c, p) + 1
    allocator, new_pages, ok = allocate(
        pool.allocator, (pages_needed - pages_held).reshape(-1), max_new_pages
    )
    ok = ok & jnp.all(pages_needed <= max_pages)
    new_pages = jnp.where(ok, new_pages, -1).reshape(b, num_kv, max_new_pages)
    allocator = jax.tree.map(lambda new, old: jnp.where(ok, new, old), allocator, pool.allocator)

    table_slot = pages_held[..., None] + jnp.arange(max_new_pages)
    table_slot = jnp.where(new_pages >= 0, table_slot, max_pages)  # out of range: dropped
    bi, ki = jnp.indices((b, num_kv))
    page_table = page_table.at[bi[..., None], ki[..., None], table_slot].set(new_pages, mode="drop")

    page, rank = _written_slots(page_table, lengths, write_mask, p)
    scatter = _slot_scatter(page, rank, write_mask & ok, pool.num_pages, p)

    if positions.ndim == 2:
        positions = positions[:, None, :]
    token_positions = jnp.broadcast_to(positions, (b, num_kv, c))
    scores = jnp.zeros((b, num_kv, c), jnp.float32) if scores is None else scores
    pool = dataclasses.replace(
        pool,
        k_pages=scatter(pool.k_pages, k),
        v_pages=scatter(pool.v_pages, v),
        token_positions=scatter(pool.token_positions, token_positions),
        token_scores=scatter(pool.token_scores, scores),
        k_scales=None if k_scales is None else scatter(pool.k_scales, k_scales),
        v_scales=None if v_scales is None else scatter(pool.v_scales, v_scales),
        allocator=allocator,
        overflow=pool.overflow | ~ok,
    )
    # Bounds of every page a written token landed in, from the tokens it now holds.
    written_page = jnp.where(write_mask & ok, page, -1).reshape(-1)
    page_held = jnp.clip(new_lengths[..., None] - (rank // p) * p, 0, p).reshape(-1)
    pool = pool.refresh_key_bounds(written_page, page_held)
    return pool, page_table, jnp.where(ok, new_lengths, lengths)


def _written_slots(page_table, lengths, write_mask, p: int) -> tuple[jax.Array, jax.Array]:
    """(page, rank) int32 [B, K, C] of each written token: its rank among the head's tokens
    (lengths [B, K] before the write) and the page holding that rank."""
    rank = lengths[..., None] + jnp.cumsum(write_mask, axis=-1) - 1
    max_pages = page_table.shape[-1]
    page = jnp.take_along_axis(page_table, jnp.clip(rank // p, 0, max_pages - 1), axis=-1)
    return page, rank


def _slot_scatter(page, rank, written, num_pages: int, p: int):
    """values [B, K, C, ...] -> pool field [P, p, ...] with the `written` tokens set at their
    (page, slot). Indexed by (page, slot) rather than through a flattened view of the pool: XLA
    updates the pool in place then, where a reshaped view made it copy the whole pool at every
    write."""
    destination = jnp.where(written, page * p + rank % p, num_pages * p).reshape(-1)
    page_index, slot_index = destination // p, destination % p

    def scatter(pages, values):
        values = values.reshape(-1, *values.shape[3:]).astype(pages.dtype)
        return pages.at[page_index, slot_index].set(values, mode="drop")

    return scatter


def set_written_scores(
    pool: PagePool,
    page_table: jax.Array,
    lengths: jax.Array,
    new_lengths: jax.Array,
    write_mask: jax.Array,
    scores: jax.Array,
) -> PagePool:
    """The scores f32 [B, K, C] of the tokens a `write_tokens` call stored (called with
    lengths [B, K] and write_mask [B, K, C]; new_lengths what it returned: an overflowed write
    stored nothing, and nothing is set), for scores known only after the chunk's attention."""
    page, rank = _written_slots(page_table, lengths, write_mask, pool.page_size)
    stored = write_mask & (new_lengths > lengths)[..., None]
    scatter = _slot_scatter(page, rank, stored, pool.num_pages, pool.page_size)
    return dataclasses.replace(pool, token_scores=scatter(pool.token_scores, scores))


def accumulate_cached_mass(
    pool: PagePool,
    page_table: jax.Array,
    lengths: jax.Array,
    mass: jax.Array,
    update: Callable[[jax.Array, jax.Array], jax.Array],
) -> PagePool:
    """score <- update(score, mass) for the held slots of one layer (page_table [B, K, M],
    lengths [B, K]); mass f32 [B, K, M * p] is the weighted attention a chunk gave each slot,
    `update` the policy's rule on [B, K, M * p] arrays (decay * score + mass for H2O)."""
    p = pool.page_size
    slots = jnp.arange(mass.shape[-1])
    page = jnp.take_along_axis(page_table, slots // p + jnp.zeros_like(mass, jnp.int32), axis=-1)
    held = slots < lengths[..., None]
    flat = jnp.where(held, page * p + slots % p, pool.num_pages * p).reshape(-1)
    old = pool.token_scores.reshape(-1)
    held_old = old[jnp.minimum(flat, old.shape[0] - 1)].reshape(mass.shape)
    new = update(held_old, mass)
    scores = set_from_itself(old, flat, new.reshape(-1))  # each held slot is one head's
    return dataclasses.replace(pool, token_scores=scores.reshape(pool.token_scores.shape))
