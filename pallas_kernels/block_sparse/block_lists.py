"""Per-query-block lists of key blocks for the block-sparse prefill kernel (jittable jnp).

A list pair is `kv_block_idx` int32 [B, M, nq, nk] (key blocks to visit, valid entries first,
ascending) and `kv_block_cnt` int32 [B, M, nq] (how many are valid), M heads (query or KV heads),
nq = cdiv(T, block_q). Each builder lists exactly the blocks that hold at least one token pair
its token-level mask admits; the kernel then applies only the causal mask inside those blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def block_lists_from_mask(
    listed: jax.Array, max_entries: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Compacts a block mask bool [..., nq, nkb] into (kv_block_idx [..., nq, n], kv_block_cnt
    [..., nq]), n = `max_entries` or nkb; entries past the count are 0."""
    num_key_blocks = listed.shape[-1]
    order = jnp.argsort(jnp.logical_not(listed), axis=-1, stable=True).astype(jnp.int32)
    count = jnp.sum(listed, axis=-1, dtype=jnp.int32)
    entries = num_key_blocks if max_entries is None else min(max_entries, num_key_blocks)
    order = order[..., :entries]
    order = jnp.where(jnp.arange(entries) < count[..., None], order, 0)
    return order, jnp.minimum(count, entries)


def _block_bounds(num_tokens: int, block: int) -> tuple[jax.Array, jax.Array]:
    """First and last real token [n] of each block, the last block clipped to the sequence."""
    first = jnp.arange(0, num_tokens, block)
    return first, jnp.minimum(first + block, num_tokens) - 1


def _window_blocks(num_tokens: int, window: int, block_q: int, block_k: int) -> jax.Array:
    """bool [nq, nkb]: blocks holding a pair with 0 <= i - j < window (i query, j key)."""
    q_first, q_last = _block_bounds(num_tokens, block_q)
    k_first, k_last = _block_bounds(num_tokens, block_k)
    # Within a block pair, i - j takes every integer value in [q_first - k_last, q_last - k_first].
    reaches_diagonal = q_last[:, None] >= k_first[None, :]
    within_window = q_first[:, None] - k_last[None, :] <= window - 1
    return reaches_diagonal & within_window


def _broadcast_lists(listed, batch: int, num_heads: int, max_entries: int | None):
    listed = jnp.broadcast_to(listed, (batch, num_heads, *listed.shape))
    return block_lists_from_mask(listed, max_entries)


def dense_causal_block_lists(
    batch: int, num_heads: int, num_tokens: int, *, block_q: int, block_k: int
) -> tuple[jax.Array, jax.Array]:
    """Every key block up to the diagonal: full causal attention."""
    return sliding_window_block_lists(
        batch, num_heads, num_tokens, window=num_tokens, block_q=block_q, block_k=block_k
    )


def sliding_window_block_lists(
    batch: int, num_heads: int, num_tokens: int, *, window: int, block_q: int, block_k: int
) -> tuple[jax.Array, jax.Array]:
    """Key blocks holding some key j of query i with 0 <= i - j < window (window >= 1).

    Lists are [B, num_heads, nq, n] with n the most blocks a window spans.
    """
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    span = -(-(block_q + window - 1) // block_k) + 1
    listed = _window_blocks(num_tokens, window, block_q, block_k)
    return _broadcast_lists(listed, batch, num_heads, span)


def vertical_slash_block_lists(
    admitted: jax.Array, *, window: int, block_q: int, block_k: int
) -> tuple[jax.Array, jax.Array]:
    """Query i sees key j iff j <= i and (i - j < window or admitted[j]).

    Args:
      admitted: bool [B, K, T], the admitted key columns of each KV head; window >= 0.
    Returns:
      lists [B, K, nq, nkb] and counts [B, K, nq].
    """
    if window < 0:
        raise ValueError(f"window={window} must be >= 0")
    _, _, num_tokens = admitted.shape
    listed = jnp.zeros((1, 1), bool)
    if window:
        listed = _window_blocks(num_tokens, window, block_q, block_k)[None, None]
    # An admitted key j is seen by the block's last query iff j <= that query.
    _, q_last = _block_bounds(num_tokens, block_q)
    padded = -(-num_tokens // block_k) * block_k
    column = jnp.arange(padded)
    admitted = jnp.pad(admitted, ((0, 0), (0, 0), (0, padded - num_tokens)))
    first_admitted = jnp.where(admitted, column, padded).reshape(*admitted.shape[:2], -1, block_k)
    first_admitted = jnp.min(first_admitted, axis=-1)  # [B, K, nkb]
    listed = listed | (first_admitted[:, :, None, :] <= q_last[:, None])
    return block_lists_from_mask(listed)
