"""The one eviction mechanism: keep-mask -> compact kept tokens to the first pages -> free the rest.

Every eviction policy ends here. A keep-mask covers each (layer, sequence, KV head)'s token slots
in cache order (slot s of a head is page `page_table[s // p]`, offset `s % p`). Kept tokens move
to the head's first slots, in order, and the pages no longer needed go back to the pool, so a
head that keeps fewer tokens really holds fewer pages.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv.cache.allocator import release
from jaxkv.cache.slots import pages_holding, set_from_itself, split_slots
from jaxkv.cache.state import KVState, PagePool


def compact_layer(pool: PagePool, page_table, lengths, keep):
    """Compacts one layer of `pool`: page_table [B, K, M], lengths [B, K] (the tokens this
    pool's pages hold), keep bool [B, K, M * p]. Kept tokens keep their order. Returns (pool,
    page_table, lengths)."""
    p = pool.page_size
    slots = jnp.arange(page_table.shape[-1] * p)
    keep = keep & (slots < lengths[..., None])
    new_lengths = jnp.sum(keep, axis=-1, dtype=jnp.int32)
    new_slot = jnp.cumsum(keep, axis=-1) - 1
    source = _flat_index(page_table, jnp.broadcast_to(slots, keep.shape), p)
    destination = jnp.where(keep, _flat_index(page_table, new_slot, p), pool.num_pages * p)
    pool = _move_tokens(pool, jnp.maximum(source, 0), destination)
    return _free_emptied_pages(pool, page_table, lengths, new_lengths)


def fill_holes_layer(pool: PagePool, page_table, lengths, keep, max_moves: int):
    """`compact_layer` without keeping the order, for at most `max_moves` moves per head: the
    kept tokens past a head's new length fill the slots of its evicted ones below it (k-th
    hole from the k-th such token), so a step that evicts a few tokens moves those few rather
    than every token after the first hole. Attention does not depend on the order (keys are
    stored rotated, with their positions). The caller guarantees no head needs more moves."""
    p = pool.page_size
    slots = jnp.arange(page_table.shape[-1] * p)
    keep = keep & (slots < lengths[..., None])
    new_lengths = jnp.sum(keep, axis=-1, dtype=jnp.int32)
    below = slots < new_lengths[..., None]
    holes = _first_slots(below & ~keep, max_moves)  # [B, K, max_moves], -1 past the last
    movers = _first_slots(~below & keep, max_moves)
    source = _flat_index(page_table, jnp.maximum(movers, 0), p)
    destination = jnp.where(holes >= 0, _flat_index(page_table, holes, p), pool.num_pages * p)
    pool = _move_tokens(pool, source, destination)
    return _free_emptied_pages(pool, page_table, lengths, new_lengths)


def moves_to_fill_holes(keep: jax.Array, lengths: jax.Array) -> jax.Array:
    """int32 [..., heads]: the moves `fill_holes_layer` makes per head (its evicted slots below
    its new length) for keep [..., S] and lengths [...]."""
    slots = jnp.arange(keep.shape[-1])
    keep = keep & (slots < lengths[..., None])
    below = slots < jnp.sum(keep, axis=-1, keepdims=True)
    return jnp.sum(below & ~keep, axis=-1, dtype=jnp.int32)


def _first_slots(mask: jax.Array, count: int) -> jax.Array:
    """int32 [..., count]: the first `count` slots where mask [..., S] holds, -1 past the last."""
    rank = jnp.cumsum(mask, axis=-1) - 1
    target = jnp.where(mask & (rank < count), rank, count)
    slots = jnp.broadcast_to(jnp.arange(mask.shape[-1], dtype=jnp.int32), mask.shape)
    first = jnp.full((*mask.shape[:-1], count + 1), -1, jnp.int32)
    batch = [
        jnp.arange(n).reshape((-1,) + (1,) * (mask.ndim - 1 - axis))
        for axis, n in enumerate(mask.shape[:-1])
    ]
    return first.at[(*batch, target)].set(slots)[..., :count]


def compact_first_pages(pool: PagePool, page_table, lengths, keep, width: int):
    """`compact_layer` over the table's first `width` (static) pages [B, K, :width] only, for
    heads known to hold no more (keep bool [B, K, width * p]); a head holding more sets
    `overflow` rather than losing tokens silently. Returns (pool, page_table, lengths)."""
    unseen = jnp.any(lengths > width * pool.page_size)
    pool, seen, lengths = compact_layer(pool, page_table[..., :width], lengths, keep)
    pool = dataclasses.replace(pool, overflow=pool.overflow | unseen)
    return pool, jnp.concatenate([seen, page_table[..., width:]], axis=-1), lengths


def _flat_index(page_table: jax.Array, slot: jax.Array, p: int) -> jax.Array:
    """Pool-wide token index (page * p + offset) of each head's slot [B, K, n]."""
    max_pages = page_table.shape[-1]
    page = jnp.take_along_axis(page_table, jnp.clip(slot // p, 0, max_pages - 1), axis=-1)
    return page * p + slot % p


def _move_tokens(pool: PagePool, source: jax.Array, destination: jax.Array) -> PagePool:
    """Every per-token field's tokens at `source` written to `destination` (flat indices,
    destinations >= P * p dropped)."""
    source, destination = source.reshape(-1), destination.reshape(-1)

    def move(pages):
        if pages is None:
            return None
        flat = pages.reshape(-1, *pages.shape[2:])
        return set_from_itself(flat, destination, flat[source]).reshape(pages.shape)

    return pool.map_token_data(move)


def _free_emptied_pages(pool: PagePool, page_table, lengths, new_lengths):
    """Frees the pages past each head's new length and refreshes the key bounds of the rest.
    Returns (pool, page_table, new_lengths)."""
    p = pool.page_size
    pages_needed = -(-new_lengths // p)
    pages_held = -(-lengths // p)
    page_index = jnp.arange(page_table.shape[-1])
    freed = (page_index >= pages_needed[..., None]) & (page_index < pages_held[..., None])
    pool = dataclasses.replace(
        pool, allocator=release(pool.allocator, jnp.where(freed, page_table, -1))
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
    return _evict_tiers(kv, keep, _compact_pool)


def run_if(pred: jax.Array, fn, operand):
    """`fn(operand)` where the scalar `pred` holds, else `operand`, updating it in place.

    A `lax.cond` whose branch scatters into a pool makes XLA (CPU seen) copy the whole pool
    into the conditional, on every call; a `while_loop` of zero or one trips updates its
    carry in place. Every conditional eviction of a KV state goes through this."""

    def once(carry):  # ~pred: False, typed as pred (device-varying on a mesh)
        return ~carry[0], fn(carry[1])

    return jax.lax.while_loop(lambda carry: carry[0], once, (jnp.asarray(pred), operand))[1]


def evict_in_place(kv: KVState, keep: jax.Array, max_moves: int) -> KVState:
    """`compact` for a step that evicts a few tokens (decode-time eviction): when no head has
    more than `max_moves` (static) evicted slots below its new length, each head's kept tokens
    past it fill those slots (`fill_holes_layer`: the moves cost O(evicted), not O(held)) and
    the kept tokens' order is not kept; otherwise `compact`. With int8 storage this holds for
    the int8 tier; the model-dtype window, whose order the spill reads, is compacted in order
    (it holds at most the window's few tokens).

    keep: bool [L, B, K, S] as for `compact`.
    """
    return _evict_tiers(kv, keep, functools.partial(_evict_pool_in_place, max_moves=max_moves))


def _evict_tiers(kv: KVState, keep: jax.Array, evict_pool) -> KVState:
    """`evict_pool(pool, page_table, lengths, keep) -> (pool, page_table, lengths)` on the
    state's pool, or with int8 storage on the int8 tier, then `_compact_window` on the
    model-dtype window."""
    tier = kv.pool.int8
    if tier is None:
        pool, page_table, lengths = evict_pool(kv.pool, kv.page_table, kv.lengths, keep)
        return dataclasses.replace(kv, pool=pool, page_table=page_table, lengths=lengths)
    keep_int8, keep = split_slots(keep, tier.lengths, tier.max_tokens_per_head)
    int8_pool, int8_table, int8_lengths = evict_pool(
        tier.pool, tier.page_table, tier.lengths, keep_int8
    )
    tier = dataclasses.replace(tier, pool=int8_pool, page_table=int8_table, lengths=int8_lengths)
    pool, page_table, lengths = _compact_window(
        dataclasses.replace(kv.pool, int8=None),
        kv.page_table,
        kv.full_precision_lengths(),
        keep,
        tier.window,
    )
    pool = dataclasses.replace(pool, int8=tier)
    return dataclasses.replace(kv, pool=pool, page_table=page_table, lengths=lengths + int8_lengths)


def _compact_window(pool: PagePool, page_table, lengths, keep, window: int):
    """`_compact_pool` of an int8 state's model-dtype pages, which hold at most `window`
    tokens per head between steps: `compact_first_pages` of the pages that hold them."""
    width = pages_holding(window, pool.page_size, page_table.shape[-1])
    layer = functools.partial(compact_first_pages, width=width)
    return _compact_pool(pool, page_table, lengths, keep[..., : width * pool.page_size], layer)


def _evict_pool_in_place(pool: PagePool, page_table, lengths, keep, max_moves: int):
    """`fill_holes_layer` over every layer when no head needs more than `max_moves` moves,
    else `_compact_pool`: page_table [L, B, K, M], lengths [L, B, K]."""

    def fill(state):
        def layer(pool, xs):
            pool, page_table, lengths = fill_holes_layer(pool, *xs, max_moves)
            return pool, (page_table, lengths)

        pool, (page_table, lengths) = jax.lax.scan(layer, state[0], (*state[1:], keep))
        return pool, page_table, lengths

    few = jnp.max(moves_to_fill_holes(keep, lengths)) <= max_moves
    state = run_if(few, fill, (pool, page_table, lengths))
    return run_if(~few, lambda state: _compact_pool(*state, keep), state)


def _compact_pool(pool: PagePool, page_table, lengths, keep, compact_one=compact_layer):
    """`compact_one` (`compact_layer`) over every layer: page_table [L, B, K, M], lengths
    [L, B, K]."""

    def layer(pool, xs):
        page_table, lengths, layer_keep = xs
        pool, page_table, lengths = compact_one(pool, page_table, lengths, layer_keep)
        return pool, (page_table, lengths)

    pool, (page_table, lengths) = jax.lax.scan(layer, pool, (page_table, lengths, keep))
    return pool, page_table, lengths


def rank_descending(scores: jax.Array) -> jax.Array:
    """Rank of each entry along the last axis by descending score (ties: lower index first)."""
    order = jnp.argsort(-scores, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def keep_top_per_head(scores, budget, held, protected, max_evicted: int | None = None):
    """Per head: the protected slots plus the best-scored others, `budget` slots in all (ties:
    the lower slot is kept), as `rank_descending(...) < budget` but with one sort of the values.

    scores f32 [..., S]; budget int [...] (>= the protected count); held, protected bool [..., S].
    max_evicted (static; decode-time eviction): when no head drops more than that many slots,
    its lowest-scored ones are found by `lax.top_k` (O(S) for a few victims) instead of a sort
    (O(S log S)); the same mask either way.
    """
    ranked = jnp.where(protected, jnp.inf, scores)
    ranked = jnp.where(held, ranked, -jnp.inf)
    if max_evicted is None:
        return _keep_above_threshold(ranked, budget, held)
    candidates = held & ~protected
    excess = jnp.sum(held, axis=-1, dtype=jnp.int32) - budget
    few = jnp.all(excess <= jnp.minimum(max_evicted, jnp.sum(candidates, axis=-1)))
    return jax.lax.cond(
        few,
        lambda: held & ~_lowest_slots(ranked, excess, candidates, max_evicted),
        lambda: _keep_above_threshold(ranked, budget, held),
    )


def _keep_above_threshold(ranked, budget, held) -> jax.Array:
    """The `budget` [...] best of ranked [..., S] per head (ties: the lower slot), via the
    budget-th largest value: those above it, then the first of those equal to it."""
    descending = -jnp.sort(-ranked, axis=-1)
    last_kept = jnp.clip(budget, 1, ranked.shape[-1])[..., None] - 1
    threshold = jnp.take_along_axis(descending, last_kept, axis=-1)
    above = ranked > threshold
    ties = ranked == threshold
    room = budget[..., None] - jnp.sum(above, axis=-1, keepdims=True)
    return (above | (ties & (jnp.cumsum(ties, axis=-1) <= room))) & held


def _lowest_slots(ranked, count, candidates, most: int) -> jax.Array:
    """bool [..., S]: each head's `count` [...] (<= most, static) lowest-ranked candidate slots,
    ties: the higher slot first (the reverse of `_keep_above_threshold`'s order)."""
    s = ranked.shape[-1]
    most = min(most, s)
    key = jnp.where(candidates, -ranked, -jnp.inf)[..., ::-1]  # reversed: top_k takes the
    _, reversed_slots = jax.lax.top_k(key, most)  # lower index of a tie, the higher slot here
    slots = s - 1 - reversed_slots  # [..., most], lowest first
    chosen = jnp.arange(most) < count[..., None]
    hits = (slots[..., None] == jnp.arange(s)) & chosen[..., None]  # [..., most, S]
    return jnp.any(hits, axis=-2)


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
