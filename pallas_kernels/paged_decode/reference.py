"""Plain-jnp oracle of the ragged paged decode kernel: gather, dequantise, masked softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dequantize_pages(
    pages: jax.Array,
    page_table: jax.Array,
    token_scales: jax.Array | None,
    channel_scales: jax.Array | None,
) -> jax.Array:
    """Dense f32 view [B, K, M * p, H] of pool `pages` [P, p, H] through `page_table` [B, K, M].

    token_scales f32 [P, p] and channel_scales f32 [B, K, H] multiply int8 pages (either or both).
    """
    safe_table = jnp.maximum(page_table, 0)
    values = pages[safe_table].astype(jnp.float32)  # [B, K, M, p, H]
    if token_scales is not None:
        values = values * token_scales[safe_table][..., None]
    if channel_scales is not None:
        values = values * channel_scales[:, :, None, None, :]
    b, k, m, p, h = values.shape
    return values.reshape(b, k, m * p, h)


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    k_channel_scales: jax.Array | None = None,
    v_channel_scales: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of one query per head over each (sequence, KV head)'s first `lengths` tokens.

    Args:
      q: [B, N, H]; query head n reads KV head n // (N // K).
      k_pages, v_pages: [P, p, H] the pool; page_table: int32 [B, K, M], -1 unallocated;
      lengths: int32 [B, K]; scales as in `dequantize_pages`.
    Returns:
      out f32 [B, N, H] (0 where nothing is held), lse f32 [B, N] (-inf there), probs f32
      [B, N, M * p] (softmax probability of every table slot, 0 past the length).
    """
    b, n, h = q.shape
    num_kv_heads = page_table.shape[1]
    k = dequantize_pages(k_pages, page_table, k_scales, k_channel_scales)
    v = dequantize_pages(v_pages, page_table, v_scales, v_channel_scales)
    qg = q.astype(jnp.float32).reshape(b, num_kv_heads, n // num_kv_heads, h)
    scores = jnp.einsum("bkgh,bksh->bkgs", qg, k, precision="highest") * sm_scale
    held = (jnp.arange(k.shape[2]) < lengths[..., None])[:, :, None, :]
    scores = jnp.where(held, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgs,bksh->bkgh", probs, v, precision="highest")
    lse = jnp.where(denom > 0, row_max + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out.reshape(b, n, h), lse.reshape(b, n), probs.reshape(b, n, -1)
