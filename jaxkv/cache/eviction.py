"""The one eviction mechanism: keep-mask -> compact kept tokens to the first pages -> free the rest.

Every eviction policy ends here. A keep-mask covers each (layer, sequence, KV head)'s token slots
in cache order (slot s of a head is page `page_table[s // p]`, offset `s % p`). Kept tokens move
to the head's first slots, in order, and the pages no longer needed go back to the pool, so a
head that keeps fewer tokens really holds fewer pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.cache.allocator import release
from jaxkv.cache.slots import split_slots
from jaxkv.cache.state import KVState, PagePool


def held_slots(kv: KVState) -> jax.Array:
    """bool [L, B, K, S]: which slots of each head hold a token (S = max_pages * page_size)."""
    return jnp.arange(kv.max_tokens_per_head) < kv.lengths[..., None]


def compact_layer(pool: PagePool, page_table, lengths, keep):
    """Compacts one layer of `pool`: page_table [B, K, M], lengths [B, K] (the tokens this
    pool's pages hold), keep bool [B, K, M * p]. Returns (pool, page_table, lengths)."""
    p = pool.page_size
    max_pages = page_table.shape[-1]
    slots = jnp.arange(max_pages * p)
    keep = keep & (slots < lengths[..., None])
    new_lengths = jnp.sum(keep, axis=-1, dtype=jnp.int32)
    new_slot = jnp.cumsum(keep, axis=-1) - 1

    def flat_index(slot):
        page = jnp.take_along_axis(page_table, jnp.clip(slot // p, 0, max_pages - 1), axis=-1)
        return page * p + slot % p

    source = flat_index(jnp.broadcast_to(slots, keep.shape))
    destination = jnp.where(keep, flat_index(new_slot), pool.num_pages * p).reshape(-1)
    source = jnp.maximum(source, 0).reshape(-1)

    def move(pages):
        if pages is None:
            return None
        flat = pages.reshape(-1, *pages.shape[2:])
        # The gather reads the old pool before the scatter writes the new one.
        return flat.at[destination].set(flat[source], mode="drop").reshape(pages.shape)

    pages_needed = -(-new_lengths // p)
    pages_held = -(-lengths // p)
    page_index = jnp.arange(max_pages)
    freed = (page_index >= pages_needed[..., None]) & (page_index < pages_held[..., None])
    pool = dataclasses.replace(
        pool.map_token_data(move),
        allocator=release(pool.allocator, jnp.where(freed, page_table, -1)),
    )
    page_table = jnp.where(page_index >= pages_needed[..., None], -1, page_table)
    held_in_page = jnp.clip(new_lengths[..., None] - page_index * p, 0, p)
    pool = pool.refresh_key_bounds(page_table.reshape(-1), held_in_page.reshape(-1))
    return pool, page_table, new_lengths


def compact(kv: KVState, keep: jax.Array) -> KVState:
    """Keeps the masked tokens of every head and frees the pages left empty.

    Args:
      kv: the KV state.
      keep: bool [L, B, K, S] over each head's slots; slots past a head's length are ignored.
    Returns:
      the state with kept tokens in their original order at each head's first slots.
      With int8 storage each tier is compacted on its own (no token changes tier).
    """
    tier = kv.pool.int8
    if tier is None:
        pool, page_table, lengths = _compact_pool(kv.pool, kv.page_table, kv.lengths, keep)
        return dataclasses.replace(kv, pool=pool, page_table=page_table, lengths=lengths)
    keep_int8, keep = split_slots(keep, tier.lengths, tier.max_tokens_per_head)
    int8_pool, int8_table, int8_lengths = _compact_pool(
        tier.pool, tier.page_table, tier.lengths, keep_int8
    )
    tier = dataclasses.replace(tier, pool=int8_pool, page_table=int8_table, lengths=int8_lengths)
    pool, page_table, lengths = _compact_pool(
        dataclasses.replace(kv.pool, int8=None), kv.page_table, kv.full_precision_lengths(), keep
    )
    pool = dataclasses.replace(pool, int8=tier)
    return dataclasses.replace(kv, pool=pool, page_table=page_table, lengths=lengths + int8_lengths)


def _compact_pool(pool: PagePool, page_table, lengths, keep):
    """`compact_layer` over every layer: page_table [L, B, K, M], lengths [L, B, K]."""

    def layer(pool, xs):
        page_table, lengths, layer_keep = xs
        pool, page_table, lengths = compact_layer(pool, page_table, lengths, layer_keep)
        return pool, (page_table, lengths)

    pool, (page_table, lengths) = jax.lax.scan(layer, pool, (page_table, lengths, keep))
    return pool, page_table, lengths


def rank_descending(scores: jax.Array) -> jax.Array:
    """Rank of each entry along the last axis by descending score (ties: lower index first)."""
    order = jnp.argsort(-scores, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def keep_top_per_head(scores, budget, held, protected) -> jax.Array:
    """Per head: the protected slots plus the best-scored others, `budget` slots in all.

    scores f32 [..., S]; budget int [...] (>= the protected count); held, protected bool [..., S].
    """
    ranked = jnp.where(protected, jnp.inf, scores)
    ranked = jnp.where(held, ranked, -jnp.inf)
    return (rank_descending(ranked) < budget[..., None]) & held


def keep_top_across_heads(scores, budget_per_head, held, protected, safeguard: float):
    """AdaKV: one bottom-k across a layer's heads, each head keeping >= `safeguard` of its share.

    scores f32 [L, B, K, S]; budget_per_head int [L, B]: the uniform per-head budget whose total
    K * budget the layer keeps; held, protected bool [L, B, K, S].
    """
    guaranteed = jnp.floor(budget_per_head * safeguard).astype(jnp.int32)
    forced = keep_top_per_head(scores, guaranteed[..., None], held, protected) | protected
    ranked = jnp.where(forced, jnp.inf, jnp.where(held, scores, -jnp.inf))
    *lead, k, s = ranked.shape
    flat_rank = rank_descending(ranked.reshape(*lead, k * s)).reshape(*lead, k, s)
    return (flat_rank < (k * budget_per_head)[..., None, None]) & held
