"""WG-KV's local ring: the last W tokens of every (layer, sequence, KV head), read whatever their
gate, next to the global paged cache that holds only admitted tokens.

The ring is a dense side array (not pages of the pool): it is written every step, always read
whole, and its size is fixed, so paging it would add table lookups and nothing else. Slot
`t % W` holds a sequence's t-th written token; the pointer is the count of tokens written.

A chunk (prefill chunk or decode token, one code path: `jaxkv.step.layer.attend_and_write`)
attends to the global pages, the ring and itself; a ring or chunk token j is visible to a query
at position i when causal and (i - j < W or admitted(j)). Then the chunk enters the ring
(`promote_and_push`), and the tokens it pushes out (the ring's oldest, or the chunk's own
earliest when C > W) are promoted to the global cache when admitted, else dropped: lazy
promotion. Query i thus sees every admitted token and the band.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.cache.state import LocalRing, PagePool
from jaxkv.cache.writes import write_tokens


def _leaving_ring_tokens(ring: LocalRing, chunk_tokens: jax.Array, max_leaving: int):
    """The ring's oldest `max_leaving` slots (oldest first) and which of them the chunk's
    `chunk_tokens` [B] new tokens push out. Returns (slots [B, m], leaving bool [B, m])."""
    age = jnp.arange(max_leaving)
    # Age a holds the token written W - a steps before the pointer; a < n leave.
    slots = (ring.count[:, None] + age) % ring.window
    held = jnp.take_along_axis(ring.positions, slots, axis=-1) >= 0
    return slots, held & (age < chunk_tokens[:, None])


def _gather_slots(values: jax.Array, slots: jax.Array) -> jax.Array:
    """values [B, K, W, ...] at slots [B, m] -> [B, K, m, ...]."""
    index = slots[:, None, :]
    index = index.reshape(index.shape + (1,) * (values.ndim - 3))
    return jnp.take_along_axis(values, index, axis=2)


def promote_and_push(
    pool: PagePool,
    page_table: jax.Array,
    lengths: jax.Array,
    ring: LocalRing,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    scores: jax.Array,
    admitted: jax.Array,
) -> tuple[PagePool, jax.Array, jax.Array, LocalRing]:
    """Writes a chunk into one layer's ring; the tokens it pushes out go to the global pages
    when admitted (lazy promotion), else are dropped.

    Args:
      page_table [B, K, M], lengths [B, K], ring: this layer's.
      k, v [B, K, C, H]; positions int32 [B, C] (-1 = padding, not written); scores f32 and
        admitted bool [B, K, C] for the chunk's tokens.
    Returns:
      (pool, page_table, lengths, ring). A promotion that does not fit in the pool is dropped
      whole and sets `pool.overflow` (live pages are never overwritten).
    """
    window = ring.window
    valid = positions >= 0
    chunk_tokens = jnp.sum(valid, axis=-1, dtype=jnp.int32)  # [B]
    rank = jnp.cumsum(valid, axis=-1, dtype=jnp.int32) - 1  # among the chunk's valid tokens
    slots, ring_leaving = _leaving_ring_tokens(ring, chunk_tokens, min(k.shape[2], window))
    chunk_leaving = valid & (rank < chunk_tokens[:, None] - window)

    ring_admitted = _gather_slots(ring.admitted, slots)
    promoted = jnp.concatenate(
        [ring_leaving[:, None] & ring_admitted, chunk_leaving[:, None] & admitted], axis=-1
    )
    ring_positions = jnp.take_along_axis(ring.positions, slots, axis=-1)
    pool, page_table, lengths = write_tokens(
        pool,
        page_table,
        lengths,
        jnp.concatenate([_gather_slots(ring.k, slots).astype(k.dtype), k], axis=2),
        jnp.concatenate([_gather_slots(ring.v, slots).astype(v.dtype), v], axis=2),
        jnp.concatenate([ring_positions, positions], axis=-1),
        promoted,
        jnp.concatenate([_gather_slots(ring.scores, slots), scores], axis=-1),
    )

    stays = valid & ~chunk_leaving
    slot = jnp.where(stays, (ring.count[:, None] + rank) % window, window)  # window: dropped
    rows = jnp.broadcast_to(jnp.arange(slot.shape[0])[:, None], slot.shape)

    def put(ring_values, chunk_values):  # [B, K, W, ...] <- [B, K, C, ...] at slot
        updates = jnp.swapaxes(chunk_values, 1, 2).astype(ring_values.dtype)
        return ring_values.at[rows, :, slot].set(updates, mode="drop")

    ring = LocalRing(
        k=put(ring.k, k),
        v=put(ring.v, v),
        positions=ring.positions.at[rows, slot].set(positions, mode="drop"),
        scores=put(ring.scores, scores),
        admitted=put(ring.admitted, admitted),
        count=ring.count + chunk_tokens,
    )
    return pool, page_table, lengths, ring


__all__ = [
    "promote_and_push",
]
