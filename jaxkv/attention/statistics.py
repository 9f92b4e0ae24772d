"""Attention-mass statistics: how much attention each key receives, for the policies that
accumulate it (H2O, Conf-KV, TOVA). Cached keys' mass comes from the paged attention's per-slot
probabilities (`mass_from_probs`, no second pass over the cache); a chunk's own keys' mass from
C x C dense scores (`chunk_attention_mass`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention.dense import grouped_scores
from jaxkv.attention.dispatch import resolve_backend


def attention_mass(
    q: jax.Array,
    k: jax.Array,
    mask: jax.Array,
    lse: jax.Array,
    query_weights: jax.Array,
    sm_scale: float,
) -> jax.Array:
    """Attention each key receives, weighted over queries and averaged over the group's heads.

    q [B, N, T, H], k [B, K, S, H], mask bool broadcastable to [B, K, G, T, S], lse [B, N, T]
    (the logsumexp over all keys the queries attend to), query_weights f32 [B, T].
    Returns f32 [B, K, S].
    """
    b, n, t, _ = q.shape
    num_kv_heads = k.shape[1]
    scores = grouped_scores(q, k)
    lse = lse.reshape(b, num_kv_heads, n // num_kv_heads, t, 1)
    probs = jnp.where(mask & jnp.isfinite(lse), jnp.exp(scores * sm_scale - lse), 0.0)
    probs = probs * query_weights[:, None, None, :, None]
    return jnp.sum(probs, axis=(2, 3)) / (n // num_kv_heads)


def mass_from_probs(
    probs: jax.Array,
    part_lse: jax.Array,
    total_lse: jax.Array,
    query_weights: jax.Array,
    num_kv_heads: int,
) -> jax.Array:
    """Attention mass per key [B, K, S] from a partial attention's probabilities.

    probs f32 [B, N, C, S] are relative to the partial logsumexp part_lse [B, N, C]; rescaled by
    exp(part_lse - total_lse) they are the probabilities under the whole attention (total_lse
    over every key the queries saw). Weighted by query_weights [B, C], summed over queries and
    averaged over each KV head's G query heads.
    """
    b, n, c, s = probs.shape
    rescale = jnp.where(jnp.isfinite(part_lse), jnp.exp(part_lse - total_lse), 0.0)
    weighted = probs * (rescale * query_weights[:, None, :])[..., None]
    group = n // num_kv_heads
    return jnp.sum(weighted.reshape(b, num_kv_heads, group, c, s), axis=(2, 3)) / group


def chunk_attention_mass(
    q: jax.Array,
    k: jax.Array,
    positions: jax.Array,
    lse: jax.Array,
    query_weights: jax.Array,
    *,
    sm_scale: float,
    backend: str = "xla",
) -> jax.Array:
    """Per chunk token [B, K, C]: attention mass from the chunk's own causal queries, weighted.

    jnp on every backend: C x C scores per head, small next to the chunk's attention itself."""
    resolve_backend(backend)
    key_pos = positions[:, None, None, None, :]
    query_pos = positions[:, None, None, :, None]
    mask = (key_pos >= 0) & (key_pos <= query_pos)
    return attention_mass(q, k, mask, lse, query_weights, sm_scale)
