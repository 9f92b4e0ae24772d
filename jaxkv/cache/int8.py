"""Mixed-precision storage: each head's newest tokens in the model dtype, older ones in int8.

Every (layer, sequence, KV head) keeps at most `window` (F) of its newest tokens in the model-dtype
pages of `KVState.pool`; when a write pushes a head past F, its oldest model-dtype tokens leave
the window and are quantised into the int8 tier (`Int8Tier`, a second page pool with its own page
tables), before the step's attention reads them (`jaxkv.step.layer`). Tokens never return to
the model dtype: after an eviction the window may hold fewer than F, and it refills with the
next writes. The int8 tier's tokens are all older than the window's.

Quantisation is symmetric, per token and per channel: with a channel scale c [H] fixed per
(layer, sequence, head) when the tier is created (the largest |x| per channel over the tokens
held then, 1 for an all-zero channel), a token x [H] is stored as q = round(x / c / t) in
[-127, 127] with its token scale t = max_h |x_h / c_h| / 127, and read as q * t * c. Per channel
h the error is at most t * c_h / 2, and later tokens larger than those seen at creation only
raise their own t (nothing is clipped). Token scales are page-aligned like positions, so they
move with their token through `compact` and int8 tokens are never requantised.

During prefill every token stays in the model dtype (the prefill pool holds the prompt anyway);
`start_int8` quantises all but each head's newest F after the policy's compression, so every
policy compresses the prompt as it would without int8 storage.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.eviction import compact_first_pages
from jaxkv.cache.slots import merge_slots, pages_holding, split_slots
from jaxkv.cache.state import Int8Tier, KVState, PagePool
from jaxkv.cache.writes import write_tokens
from jaxkv.collectives import varying_like

QUANT_MAX = 127
# Dtypes the tokens leaving the window may come from (and the attention dequantises back to).
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def check_dtype(dtype) -> None:
    """Raises ValueError unless the model-dtype pages can hold the window of an int8 cache."""
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        allowed = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise ValueError(f"int8 storage needs a kv dtype in ({allowed}); got {jnp.dtype(dtype)}")


def quantize(x: jax.Array, channel_scales: jax.Array):
    """Symmetric int8 per token and channel: x [..., H], channel_scales broadcastable to x.

    Returns (int8 [..., H], token scales f32 [...]); the value read back is q * t * c.
    """
    normalised = x.astype(jnp.float32) / channel_scales
    token_scales = jnp.max(jnp.abs(normalised), axis=-1) / QUANT_MAX
    safe = jnp.where(token_scales > 0, token_scales, 1.0)[..., None]
    q = jnp.clip(jnp.round(normalised / safe), -QUANT_MAX, QUANT_MAX).astype(jnp.int8)
    return q, token_scales


def channel_scales_of(x: jax.Array, held: jax.Array) -> jax.Array:
    """f32 [..., H]: max |x| per channel over the held tokens of x [..., S, H] (1 where 0)."""
    largest = jnp.max(jnp.where(held[..., None], jnp.abs(x.astype(jnp.float32)), 0.0), axis=-2)
    return jnp.where(largest > 0, largest, 1.0)


def _held_channel_scales(kv: KVState) -> tuple[jax.Array, jax.Array]:
    """f32 [L, B, K, H] each for keys and values: `channel_scales_of` the model-dtype tokens
    `kv` holds now (all of them, before any moves to int8)."""
    pool, table = kv.pool, kv.page_table
    p, h = pool.k_pages.shape[1:]
    held = jnp.arange(table.shape[-1] * p) < kv.full_precision_lengths()[..., None]

    def scales(pages):
        gathered = pages[jnp.maximum(table, 0)]
        return channel_scales_of(gathered.reshape(*table.shape[:-1], -1, h), held)

    return scales(pool.k_pages), scales(pool.v_pages)


def create_tier(kv: KVState, window: int, num_pages: int, max_pages: int) -> Int8Tier:
    """An empty int8 tier for `kv`, channel scales from the tokens `kv` holds now."""
    if window < 0:
        raise ValueError(f"window={window} must be >= 0")
    p, h = kv.pool.k_pages.shape[1:]
    table = kv.page_table
    int8_pool = PagePool(
        k_pages=jnp.zeros((num_pages, p, h), jnp.int8),
        v_pages=jnp.zeros((num_pages, p, h), jnp.int8),
        token_positions=jnp.full((num_pages, p), -1, jnp.int32),
        token_scores=jnp.zeros((num_pages, p), jnp.float32),
        allocator=PageAllocator.create(num_pages),
        overflow=jnp.zeros((), bool),
        k_scales=jnp.zeros((num_pages, p), jnp.float32),
        v_scales=jnp.zeros((num_pages, p), jnp.float32),
    )
    k_scales, v_scales = _held_channel_scales(kv)
    tier = Int8Tier(
        pool=int8_pool,
        page_table=jnp.full((*table.shape[:-1], max_pages), -1, jnp.int32),
        lengths=jnp.zeros_like(kv.lengths),
        k_channel_scales=k_scales,
        v_channel_scales=v_scales,
        window=window,
    )
    return varying_like(tier, kv.lengths)  # on a mesh, typed as the state it joins


def start_int8(kv: KVState, window: int) -> KVState:
    """Mixed-precision storage from a model-dtype state: each head's tokens but the newest
    `window` move to a new int8 tier (sized for everything `kv` could hold)."""
    if kv.pool.int8 is not None:
        raise ValueError("the state already has int8 storage")
    check_dtype(kv.pool.k_pages.dtype)
    tier = create_tier(kv, window, kv.pool.num_pages, kv.page_table.shape[-1])
    return _spilled(dataclasses.replace(kv, pool=dataclasses.replace(kv.pool, int8=tier)))


def start_held(kv: KVState) -> KVState:
    """Mixed-precision storage of the tokens `kv` holds in its model-dtype pages, its int8 tier
    empty (rows that join an engine's tier once their prompt is compressed): channel scales
    from those tokens, then each head's tokens but the newest `window` moved to the tier."""
    k_scales, v_scales = _held_channel_scales(kv)
    tier = dataclasses.replace(kv.pool.int8, k_channel_scales=k_scales, v_channel_scales=v_scales)
    return _spilled(dataclasses.replace(kv, pool=dataclasses.replace(kv.pool, int8=tier)))


def _spilled(kv: KVState) -> KVState:
    """`spill_layer` of every layer of `kv` (int8 storage)."""

    def layer(pool, xs):
        page_table, lengths, index = xs
        pool, page_table, lengths = spill_layer(pool, page_table, lengths, index)
        return pool, (page_table, lengths)

    xs = (kv.page_table, kv.lengths, jnp.arange(kv.num_layers))
    pool, (page_table, lengths) = jax.lax.scan(layer, kv.pool, xs)
    return dataclasses.replace(kv, pool=pool, page_table=page_table, lengths=lengths)


def spill_layer(pool: PagePool, page_table, lengths, layer, most_held: int | None = None):
    """Moves each head's model-dtype tokens beyond the newest `window` into the int8 tier.

    One layer: page_table [B, K, M], lengths [B, K] (both tiers); layer: int32 [] its index.
    most_held (static): at most this many model-dtype tokens per head (during decode the
    window plus the step's writes), so only the table's first pages that hold them are
    compacted, and the first that hold the `most_held - window` leaving ones are read and
    quantised, not the table's whole width; a head holding more sets `overflow`.
    Returns (pool, page_table, lengths); lengths are unchanged unless the int8 tier overflowed.
    """
    tier = pool.int8
    int8_lengths = tier.lengths[layer]
    full_lengths = lengths - int8_lengths
    width = pages_holding(most_held, pool.page_size, page_table.shape[-1])
    most_leaving = None if most_held is None else most_held - tier.window
    table = page_table[..., : pages_holding(most_leaving, pool.page_size, width)]
    table = jnp.maximum(table, 0)
    b, k, m = table.shape
    leaving = jnp.arange(m * pool.page_size) < (full_lengths - tier.window)[..., None]

    def dense(pages):
        return pages[table].reshape(b, k, m * pool.page_size, *pages.shape[2:])

    k_q, k_scales = quantize(dense(pool.k_pages), tier.k_channel_scales[layer][:, :, None])
    v_q, v_scales = quantize(dense(pool.v_pages), tier.v_channel_scales[layer][:, :, None])
    int8_pool, int8_table, new_int8_lengths = write_tokens(
        tier.pool,
        tier.page_table[layer],
        int8_lengths,
        k_q,
        v_q,
        dense(pool.token_positions),
        leaving,
        dense(pool.token_scores),
        k_scales=k_scales,
        v_scales=v_scales,
    )
    moved = jnp.all(new_int8_lengths == int8_lengths + jnp.sum(leaving, -1, dtype=jnp.int32))
    # The moves below update the pool in place after the reads above; XLA keeps a read safe
    # from an in-place update only when the update depends on what was read (else it copies
    # the whole pool: K and V, every layer, every step), so they depend on the token scales
    # (>= 0; NaN only from a NaN key or value, which is flagged as an overflow).
    read = (jnp.min(k_scales) >= 0) & (jnp.min(v_scales) >= 0)
    leaving = leaving & moved & read  # an int8 overflow moves nothing (and is flagged)
    tier = dataclasses.replace(
        tier,
        pool=int8_pool,
        page_table=tier.page_table.at[layer].set(int8_table),
        lengths=tier.lengths.at[layer].set(new_int8_lengths),
    )
    staying = jnp.pad(
        ~leaving, ((0, 0), (0, 0), (0, (width - m) * pool.page_size)), constant_values=True
    )
    pool, page_table, full_lengths = compact_first_pages(
        pool, page_table, full_lengths, staying, width
    )
    overflow = pool.overflow | int8_pool.overflow | ~read
    pool = dataclasses.replace(pool, int8=tier, overflow=overflow)
    return pool, page_table, full_lengths + new_int8_lengths


__all__ = [
    "Int8Tier",
    "channel_scales_of",
    "check_dtype",
    "create_tier",
    "merge_slots",
    "quantize",
    "spill_layer",
    "split_slots",
    "start_held",
    "start_int8",
]
