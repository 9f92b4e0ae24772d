"""Writing tokens into the paged state, and the per-layer attend-then-write step of the models."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv import attention as attention_ops
from jaxkv.cache.allocator import allocate
from jaxkv.cache.int8 import spill_layer
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
):
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

    # Destination of each written token: its rank among the head's written tokens.
    rank = lengths[..., None] + jnp.cumsum(write_mask, axis=-1) - 1
    page = jnp.take_along_axis(page_table, jnp.clip(rank // p, 0, max_pages - 1), axis=-1)
    destination = page * p + rank % p
    destination = jnp.where(write_mask & ok, destination, pool.num_pages * p).reshape(-1)

    def scatter(pages, values):
        flat = pages.reshape(-1, *pages.shape[2:])
        flat = flat.at[destination].set(
            values.reshape(-1, *values.shape[3:]).astype(flat.dtype), mode="drop"
        )
        return flat.reshape(pages.shape)

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


def attend_and_write(
    pool: PagePool,
    page_table,
    lengths,
    q,
    k,
    v,
    positions,
    *,
    layer,
    sm_scale: float,
    policy,
    backend: str,
    read_budget=None,
    write_scores=None,
):
    """One layer's attention for a chunk: over the cached tokens and the chunk itself, then write.

    With `read_budget` (int32 [B] tokens), a page-selecting policy (Quest) picks the cached pages
    each head reads. `write_scores` f32 [B, K, C] (a learned gate's per-token scores) reach the
    policy's `admit` and are stored as the written tokens' scores.

    q [B, N, C, H], k, v [B, K, C, H], positions [B, C] (-1 = padding). The chunk's queries see
    every cached token of their head plus the chunk's earlier tokens, whether or not the policy
    admits those to the cache. Returns (attn [B, N, C, H] in q.dtype, pool, page_table, lengths).
    With int8 storage (`pool.int8`), the int8 tier is read as a second paged attention merged
    through the logsumexps, and the write is followed by the spill out of the model-dtype window.
    """
    tier = pool.int8
    full_lengths = lengths if tier is None else lengths - tier.lengths[layer]
    page_mask = None
    if read_budget is not None:
        page_mask = policy.select_pages(q, pool, page_table, full_lengths, read_budget)
    cached = attention_ops.paged_attention(
        q,
        pool.k_pages,
        pool.v_pages,
        page_table,
        full_lengths,
        sm_scale=sm_scale,
        page_mask=page_mask,
        return_probs=policy.accumulates_attention,
        backend=backend,
    )
    cached_out, cached_lse = cached[:2]
    if tier is not None:
        quantized = tier.attention(
            q, layer, sm_scale=sm_scale, return_probs=policy.accumulates_attention, backend=backend
        )
        cached_out, cached_lse = attention_ops.merge_partials(
            cached_out, cached_lse, *quantized[:2]
        )
    chunk_out, chunk_lse = attention_ops.chunk_attention(
        q, k, v, positions, sm_scale=sm_scale, backend=backend
    )
    out, lse = attention_ops.merge_partials(cached_out, cached_lse, chunk_out, chunk_lse)

    new_scores = write_scores
    if policy.accumulates_attention:
        if write_scores is not None:
            raise ValueError(f"policy {policy.name!r} both accumulates attention and gates writes")
        decay, query_weights = policy.mass_weights(positions)
        mass = attention_ops.mass_from_probs(
            cached[2], cached[1], lse, query_weights, num_kv_heads=k.shape[1]
        )
        pool = _accumulate_cached_mass(pool, page_table, full_lengths, mass, decay)
        if tier is not None:
            mass = attention_ops.mass_from_probs(
                quantized[2], quantized[1], lse, query_weights, num_kv_heads=k.shape[1]
            )
            table, held = tier.page_table[layer], tier.lengths[layer]
            tier_pool = _accumulate_cached_mass(tier.pool, table, held, mass, decay)
            pool = dataclasses.replace(pool, int8=dataclasses.replace(tier, pool=tier_pool))
        new_scores = attention_ops.chunk_attention_mass(
            q, k, positions, lse, query_weights, sm_scale=sm_scale, backend=backend
        )
    write_mask = jnp.broadcast_to((positions >= 0)[:, None, :], k.shape[:3])
    admitted = policy.admit(layer=layer, k=k, v=v, positions=positions, scores=write_scores)
    if admitted is not None:
        write_mask = write_mask & admitted
    pool, page_table, full_lengths = write_tokens(
        pool, page_table, full_lengths, k, v, positions, write_mask, new_scores
    )
    if tier is None:
        return out.astype(q.dtype), pool, page_table, full_lengths
    lengths = full_lengths + pool.int8.lengths[layer]
    pool, page_table, lengths = spill_layer(pool, page_table, lengths, layer)
    return out.astype(q.dtype), pool, page_table, lengths


def _accumulate_cached_mass(pool: PagePool, page_table, lengths, mass, decay):
    """score <- decay * score + mass [B, K, M * p] (the weighted attention the chunk gave each
    cached slot)."""
    p = pool.page_size
    slots = jnp.arange(mass.shape[-1])
    page = jnp.take_along_axis(page_table, slots // p + jnp.zeros_like(mass, jnp.int32), axis=-1)
    held = slots < lengths[..., None]
    flat = jnp.where(held, page * p + slots % p, pool.num_pages * p).reshape(-1)
    old = pool.token_scores.reshape(-1)
    held_old = old[jnp.minimum(flat, old.shape[0] - 1)].reshape(mass.shape)
    new = decay[:, None, None] * held_old + mass
    scores = old.at[flat].set(new.reshape(-1), mode="drop")  # each held slot is one head's
    return dataclasses.replace(pool, token_scores=scores.reshape(pool.token_scores.shape))
