"""Plain-jnp oracle of the block-sparse prefill kernel: a dense token mask and a masked softmax.

Differentiable with `jax.grad` (the oracle of the kernel's custom VJP). Memory is O(T^2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_mask_from_block_lists(
    kv_block_idx: jax.Array, kv_block_cnt: jax.Array, num_tokens: int, block_q: int, block_k: int
) -> jax.Array:
    """bool [B, M, T, T]: query i sees key j iff j <= i and j's block is listed for i's block."""
    num_key_blocks = -(-num_tokens // block_k)
    valid = jnp.arange(kv_block_idx.shape[-1]) < kv_block_cnt[..., None]
    one_hot = kv_block_idx[..., None] == jnp.arange(num_key_blocks)
    listed = jnp.any(one_hot & valid[..., None], axis=-2)  # [B, M, nq, nkb]
    token = jnp.arange(num_tokens)
    mask = listed[:, :, token // block_q][:, :, :, token // block_k]
    return mask & (token[None, :] <= token[:, None])


def block_sparse_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_block_idx: jax.Array,
    kv_block_cnt: jax.Array,
    *,
    sm_scale: float,
    gate_bias: jax.Array | None = None,
    band: int | None = None,
    block_q: int,
    block_k: int,
) -> tuple[jax.Array, jax.Array]:
    """Same contract as `block_sparse_attention`; returns out f32 [B, N, T, H] and lse f32
    [B, N, T] (out 0 and lse -inf for a row that sees no key)."""
    b, n, t, h = q.shape
    num_kv_heads = k.shape[1]
    group = n // num_kv_heads
    mask = token_mask_from_block_lists(kv_block_idx, kv_block_cnt, t, block_q, block_k)
    mask = mask.reshape(b, num_kv_heads, -1, t, t)  # lists per query head or per KV head
    qg = q.astype(jnp.float32).reshape(b, num_kv_heads, group, t, h)
    scores = jnp.einsum("bkgth,bksh->bkgts", qg, k.astype(jnp.float32), precision="highest")
    scores = scores * sm_scale
    if gate_bias is not None:
        token = jnp.arange(t)
        outside_band = token[:, None] - token[None, :] >= band
        bias = jnp.where(outside_band, gate_bias[:, :, None, None, :].astype(jnp.float32), 0.0)
        scores = scores + bias
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    safe_denom = jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum(
        "bkgts,bksh->bkgth", weights / safe_denom, v.astype(jnp.float32), precision="highest"
    )
    lse = jnp.where(denom > 0, row_max + jnp.log(safe_denom), -jnp.inf)
    return out.reshape(b, n, t, h), lse.reshape(b, n, t)
