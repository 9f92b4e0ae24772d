"""One layer's attend-then-write step for a chunk: the one path for every storage tier.

A chunk (prefill chunk or decode token, C >= 1 tokens) reads, as partial attentions merged through
their logsumexps, in this order:
  1. the cached model-dtype pages (all of them, or the pages a page-selecting policy picks under
     `read_budget`), with per-slot probabilities when the policy accumulates attention mass
     (on "xla" a chunk's mass is recomputed block by block after the attention instead);
  2. the int8 tier's pages (mixed-precision storage), dequantised in the attention;
  3. the local ring (WG-KV and its static baselines): W dense keys, band or admitted;
  4. the chunk itself: causal, or WG-KV's vertical-slash pattern with a ring.
Then it writes: the policy's attention mass into the cached slots' scores, and the chunk's
admitted tokens into the pages (through the ring's lazy promotion with a ring).

The step without a ring writes first and then reads the cached pages up to the lengths held
before the write, which is the same attention: the written tokens lie past those lengths (a
page-selecting policy picks its pages from the page bounds as they were before the write).
So does the step with a ring (but for an attention-mass policy's): the push and the promotion
of the tokens it pushes out come first, and the reads take the pages up to the lengths held
before and the ring as it was before the push.
With int8 storage the spill out of the model-dtype window comes between the write and the
reads: a token pushed out by the chunk is read from the int8 tier already, and the chunk,
which stays in the window (C <= F), at its last slots is left out of the cached read.
An attention-mass policy's scores are set after the attention:
the cached slots' by accumulation, the chunk's own tokens' at the slots the write gave them.
The order matters for speed on "xla": XLA updates the
shared pool in place, and when reads of it had to come before an in-place write in the same
layer (the write, or the spill's moves), it copied the whole pool (K and V, every layer,
every step) to keep them safe.

Storage (`jaxkv.cache`) knows nothing of attention; this module composes the two.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv import attention as attention_ops
from jaxkv.attention import Backend
from jaxkv.cache.int8 import spill_layer
from jaxkv.cache.ring import promote_and_push
from jaxkv.cache.state import Int8Tier, LocalRing, PagePool
from jaxkv.cache.writes import accumulate_cached_mass, set_written_scores, write_tokens
from jaxkv.step.parts import PolicyParts


def int8_tier_attention(
    tier: Int8Tier,
    q: jax.Array,
    layer: jax.Array | int,
    *,
    sm_scale: float,
    return_probs: bool,
    backend: Backend,
) -> tuple[jax.Array, ...]:
    """`paged_attention` of q [B, N, C, H] over one layer's int8 tokens, dequantised inside
    the attention (out, lse and, with `return_probs`, per-slot probabilities)."""
    return attention_ops.paged_attention(
        q,
        tier.pool.k_pages,
        tier.pool.v_pages,
        tier.page_table[layer],
        tier.lengths[layer],
        sm_scale=sm_scale,
        k_scales=tier.pool.k_scales,
        v_scales=tier.pool.v_scales,
        k_channel_scales=tier.k_channel_scales[layer],
        v_channel_scales=tier.v_channel_scales[layer],
        return_probs=return_probs,
        backend=backend,
    )


def _check_step(
    policy: PolicyParts, pool: PagePool, ring: LocalRing | None, write_scores, chunk: int
) -> None:
    """Raises for combinations the step does not support (static, while tracing)."""
    scoring = policy.attention_scoring is not None
    if ring is not None and scoring:
        raise ValueError(
            f"policy {policy.name!r} accumulates attention mass, which a state with a local "
            "ring does not track"
        )
    if ring is not None and pool.int8 is not None:
        raise ValueError("a KV state with a local ring does not support int8 storage yet")
    if pool.int8 is not None and chunk > pool.int8.window:
        raise ValueError(
            f"a chunk of {chunk} tokens with int8 storage needs full_precision_window >= "
            f"{chunk} (the chunk is read in the model dtype); got {pool.int8.window}"
        )
    if scoring and write_scores is not None:
        raise ValueError(f"policy {policy.name!r} both accumulates attention and gates writes")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """The chunk a layer step attends for and writes: q [B, N, C, H], k, v [B, K, C, H],
    positions int32 [B, C] (-1 = padding), admitted bool [B, K, C] (the tokens it stores)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    positions: jax.Array
    admitted: jax.Array


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One layer's view of the KV state: the shared pool, this layer's page table int32
    [B, K, M], `held` int32 [B, K] the model-dtype tokens the cached read covers, `lengths`
    int32 [B, K] every tier's tokens per head before the chunk, the ring (or None) and the
    layer's index (the int8 tier's tables are indexed by it)."""

    pool: PagePool
    page_table: jax.Array
    held: jax.Array
    lengths: jax.Array
    ring: LocalRing | None
    layer: jax.Array | int


def _cached_partials(chunk: Chunk, cache: LayerCache, *, policy, read_budget, step):
    """Partial attentions over the cached pages, then the int8 tier's: [(out, lse[, probs])]."""
    q, pool = chunk.q, cache.pool
    page_mask = None
    if read_budget is not None:
        page_mask = policy.selection.select_pages(
            q, pool, cache.page_table, cache.held, read_budget
        )
    scoring = policy.attention_scoring is not None
    return_probs = scoring and attention_ops.probs_come_with_attention(q.shape[2])
    partials = [
        attention_ops.paged_attention(
            q,
            pool.k_pages,
            pool.v_pages,
            cache.page_table,
            cache.held,
            page_mask=page_mask,
            return_probs=return_probs,
            **step,
        )
    ]
    if pool.int8 is not None:
        partials.append(
            int8_tier_attention(pool.int8, q, cache.layer, return_probs=return_probs, **step)
        )
    return partials


def _chunk_partials(chunk: Chunk, ring: LocalRing | None, *, step):
    """Partial attentions of the chunk to the ring (if any) and to itself: [(out, lse)]."""
    q, k, v, positions = chunk.q, chunk.k, chunk.v, chunk.positions
    if ring is None:
        return [attention_ops.chunk_attention(q, k, v, positions, **step)]
    ring_partial = attention_ops.local_attention(
        q,
        ring.k.astype(k.dtype),
        ring.v.astype(v.dtype),
        positions,
        ring.positions,
        ring.admitted,
        window=ring.window,
        **step,
    )
    chunk_partial = attention_ops.vertical_slash_chunk_attention(
        q, k, v, positions, chunk.admitted, window=ring.window, **step
    )
    return [ring_partial, chunk_partial]


def _accumulate_mass(chunk: Chunk, cache: LayerCache, cached, lse, *, scoring, thresholds, step):
    """Adds the chunk's attention mass to the cached slots' scores (pages, then the int8 tier)
    by the scoring's rule (`update_scores`). Returns (pool, the queries' mass weights)."""
    _, query_weights = scoring.mass_weights(chunk.positions, thresholds)
    num_kv_heads = cache.page_table.shape[1]
    update = functools.partial(
        scoring.update_scores,
        positions=chunk.positions,
        cached_lengths=cache.lengths,
        thresholds=thresholds,
    )

    def mass(partial, k_pages, table, tokens, k_scales=None, k_channel_scales=None):
        if len(partial) == 3:  # the probabilities came with the attention
            return attention_ops.mass_from_probs(
                partial[2], partial[1], lse, query_weights, num_kv_heads=num_kv_heads
            )
        return attention_ops.paged_attention_mass(
            chunk.q,
            k_pages,
            table,
            tokens,
            lse,
            query_weights,
            sm_scale=step["sm_scale"],
            k_scales=k_scales,
            k_channel_scales=k_channel_scales,
        )

    pool, table, held = cache.pool, cache.page_table, cache.held
    pool = accumulate_cached_mass(
        pool, table, held, mass(cached[0], pool.k_pages, table, held), update
    )
    tier = pool.int8
    if tier is not None:
        table, tier_held = tier.page_table[cache.layer], tier.lengths[cache.layer]
        tier_mass = mass(
            cached[1],
            tier.pool.k_pages,
            table,
            tier_held,
            tier.pool.k_scales,
            tier.k_channel_scales[cache.layer],
        )
        tier_pool = accumulate_cached_mass(tier.pool, table, tier_held, tier_mass, update)
        pool = dataclasses.replace(pool, int8=dataclasses.replace(tier, pool=tier_pool))
    return pool, query_weights


def _mass_scores(chunk: Chunk, cache: LayerCache, cached, lse, *, scoring, thresholds, step):
    """The chunk's attention mass: added to the cached slots' scores (`_accumulate_mass`), and
    the chunk's own tokens' scores f32 [B, K, C] by the scoring's rule. Returns (pool, scores)."""
    pool, query_weights = _accumulate_mass(
        chunk, cache, cached, lse, scoring=scoring, thresholds=thresholds, step=step
    )
    chunk_mass = attention_ops.chunk_attention_mass(
        chunk.q, chunk.k, chunk.positions, lse, query_weights, **step
    )
    return pool, scoring.update_scores(
        None,
        chunk_mass,
        positions=chunk.positions,
        cached_lengths=cache.lengths,
        thresholds=thresholds,
    )


def _attend(chunk: Chunk, cache: LayerCache, *, policy, read_budget, step):
    """The chunk's attention over the cached pages (up to `held`), the ring and itself:
    (out f32 [B, N, C, H], lse [B, N, C], the cached partials with their probabilities)."""
    cached = _cached_partials(chunk, cache, policy=policy, read_budget=read_budget, step=step)
    partials = [partial[:2] for partial in cached]
    partials += _chunk_partials(chunk, cache.ring, step=step)
    out, lse = partials[0]
    for partial in partials[1:]:
        out, lse = attention_ops.merge_partials(out, lse, *partial)
    return out, lse, cached


def attend_and_write(
    pool: PagePool,
    page_table: jax.Array,
    lengths: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    layer: jax.Array | int,
    sm_scale: float,
    policy: PolicyParts,
    backend: Backend,
    read_budget: jax.Array | None = None,
    write_scores: jax.Array | None = None,
    thresholds: jax.Array | None = None,
    ring: LocalRing | None = None,
) -> tuple[jax.Array, PagePool, jax.Array, jax.Array, LocalRing | None]:
    """One layer's attention for a chunk over the cached tokens, the ring and itself, then write.

    Args:
      pool: the shared page pool; page_table int32 [B, K, M] and lengths int32 [B, K] this
        layer's (lengths count both tiers with int8 storage); ring: this layer's local ring, or
        None for a state without one.
      q [B, N, C, H]; k, v [B, K, C, H]; positions int32 [B, C] (-1 = padding: never attended
        from nor written). The chunk's queries see every cached token their head reads plus the
        chunk's earlier tokens, whether or not the policy admits those to the cache.
      layer: int32 [] this layer's index (the int8 tier's tables are indexed by it).
      policy: the static cache policy; the step reads its admission, attention scoring and
        selection parts (`jaxkv.step.parts`).
      read_budget: int32 [B] tokens' worth of pages the selection (Quest) reads.
      write_scores: f32 [B, K, C] a learned gate's per-token scores: they reach the admission's
        `admit` and are stored as the written tokens' scores.
      thresholds: f32 [B, n] the policy's thresholds (`Policy.thresholds`), for `admit` and
        the attention scoring.
    Returns:
      (attn [B, N, C, H] in q.dtype, pool, page_table, lengths, ring).
    """
    _check_step(policy, pool, ring, write_scores, k.shape[2])
    step = dict(sm_scale=sm_scale, backend=backend)
    tier = pool.int8
    held = lengths if tier is None else lengths - tier.lengths[layer]  # model-dtype tokens
    admitted = jnp.broadcast_to((positions >= 0)[:, None, :], k.shape[:3])
    if policy.admission is not None:
        admitted &= policy.admission.admit(
            layer=layer, k=k, v=v, positions=positions, scores=write_scores, thresholds=thresholds
        )
    chunk = Chunk(q, k, v, positions, admitted)
    cache = LayerCache(pool, page_table, held, lengths, ring, layer)
    scoring = policy.attention_scoring
    read = dict(policy=policy, read_budget=read_budget, step=step)
    mass = None if scoring is None else dict(scoring=scoring, thresholds=thresholds, step=step)
    if ring is None:
        out, cache = _write_then_attend(chunk, cache, write_scores, read=read, mass=mass)
        return out.astype(q.dtype), cache.pool, cache.page_table, cache.held, ring
    if mass is None:
        out, cache = _push_then_attend(chunk, cache, write_scores, read=read)
        return out.astype(q.dtype), cache.pool, cache.page_table, cache.held, cache.ring
    # A ring and attention mass: the mass of the cached slots is read before the push.
    out, lse, cached = _attend(chunk, cache, **read)
    pool, scores = _mass_scores(chunk, cache, cached, lse, **mass)
    pool, page_table, held, ring = promote_and_push(
        pool, page_table, held, ring, k, v, positions, scores, admitted
    )
    return out.astype(q.dtype), pool, page_table, held, ring


def _write_then_attend(chunk: Chunk, cache: LayerCache, write_scores, *, read, mass):
    """The step without a ring: write the chunk to slots past `held`, spill to the int8 tier,
    then read the written pool up to the old `held`, which sees exactly the cached tokens (the
    module docstring: XLA then needs no copy of the pool). Returns (out f32, the layer's view
    after the step, its `held` counting every tier)."""
    pool, layer, held = cache.pool, cache.layer, cache.held
    bounds = dict(key_min=pool.key_min, key_max=pool.key_max)  # before the write
    pool, page_table, new_held = write_tokens(
        pool,
        cache.page_table,
        held,
        chunk.k,
        chunk.v,
        chunk.positions,
        chunk.admitted,
        write_scores,
    )
    if pool.int8 is not None:  # the chunk stays in the window, in the last slots
        written = new_held - held
        pool, page_table, new_held = _spill(pool, page_table, new_held, layer, chunk.k.shape[2])
        held = new_held - written
    cache = dataclasses.replace(cache, pool=pool, page_table=page_table, held=held)
    out, lse, cached = _attend(
        chunk, dataclasses.replace(cache, pool=dataclasses.replace(pool, **bounds)), **read
    )
    if mass is not None:
        pool, scores = _mass_scores(chunk, cache, cached, lse, **mass)
        pool = set_written_scores(pool, page_table, held, new_held, chunk.admitted, scores)
    if pool.int8 is not None:
        new_held = new_held + pool.int8.lengths[layer]
    return out, dataclasses.replace(cache, pool=pool, page_table=page_table, held=new_held)


def _push_then_attend(chunk: Chunk, cache: LayerCache, write_scores, *, read):
    """The step with a ring and no attention scoring: the chunk pushed into the ring and the
    tokens it pushes out promoted first, then the pool read up to the old `held` and the ring
    as it was, which is the same attention (the promoted tokens lie past `held`; the ring
    before the push still holds them), and XLA needs no copy of the pool (module docstring).
    Returns (out f32, the layer's view after the step)."""
    pool = cache.pool
    bounds = dict(key_min=pool.key_min, key_max=pool.key_max)  # before the write
    scores = jnp.zeros(chunk.k.shape[:3], jnp.float32) if write_scores is None else write_scores
    pool, page_table, held, ring = promote_and_push(
        pool,
        cache.page_table,
        cache.held,
        cache.ring,
        chunk.k,
        chunk.v,
        chunk.positions,
        scores,
        chunk.admitted,
    )
    before = dataclasses.replace(
        cache, pool=dataclasses.replace(pool, **bounds), page_table=page_table
    )
    out, _, _ = _attend(chunk, before, **read)
    return out, dataclasses.replace(
        cache, pool=pool, page_table=page_table, held=held, lengths=held, ring=ring
    )


def _spill(pool: PagePool, page_table, held, layer, chunk: int):
    """`spill_layer` after a write of `chunk` (static) tokens, with held [B, K] the model-dtype
    tokens (before the write a head held at most the window). Returns (pool, page_table,
    held)."""
    lengths = held + pool.int8.lengths[layer]
    most_held = pool.int8.window + chunk
    pool, page_table, lengths = spill_layer(pool, page_table, lengths, layer, most_held)
    return pool, page_table, lengths - pool.int8.lengths[layer]
