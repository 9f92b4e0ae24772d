"""Attention dispatch: every attention the models run goes through here.

Backends are chosen explicitly; there is no silent fallback:
  "xla"        plain jnp (CPU, TPU, and the oracle the kernels are tested against);
  "pallas"     Pallas kernels lowered through Triton (NVIDIA GPUs);
  "interpret"  the same Pallas kernels in the Pallas interpreter (CPU tests).

Shapes: B batch, N query heads, K KV heads, G = N // K, T/C query tokens, S key tokens, H head dim.
Queries are [B, N, T, H] and keys/values [B, K, S, H]; query head n reads KV head n // G.
Partial results carry a logsumexp so that attention over disjoint key sets (cached pages and the
current chunk) merges exactly (`merge_partials`).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp


class Backend(enum.Enum):
    XLA = "xla"
    PALLAS = "pallas"
    INTERPRET = "interpret"


def resolve_backend(backend: str | Backend) -> Backend:
    """Validates a backend name; raises for backends that cannot run the requested op."""
    try:
        resolved = Backend(backend)
    except ValueError:
        allowed = ", ".join(repr(b.value) for b in Backend)
        raise ValueError(f"backend={backend!r}: allowed are {allowed}") from None
    if resolved is not Backend.XLA:
        raise NotImplementedError(
            f"backend={resolved.value!r}: the Pallas kernels are not part of this build yet; "
            "use backend='xla'"
        )
    return resolved


def _group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, N, T, H] -> [B, K, G, T, H]."""
    b, n, t, h = q.shape
    if n % num_kv_heads:
        raise ValueError(f"query heads N={n} must be a multiple of KV heads K={num_kv_heads}")
    return q.reshape(b, num_kv_heads, n // num_kv_heads, t, h)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sm_scale: float):
    """Softmax attention in f32 with an explicit mask; fully masked rows give out 0, lse -inf.

    Args:
      q: [B, N, T, H]; k, v: [B, K, S, H]; mask: bool broadcastable to [B, K, G, T, S].
    Returns:
      out f32 [B, N, T, H], lse f32 [B, N, T].
    """
    b, n, t, h = q.shape
    qg = _group_queries(q, k.shape[1])
    scores = jnp.einsum("bkgth,bksh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * sm_scale, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("bkgts,bksh->bkgth", probs, v.astype(jnp.float32))
    out = out / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom > 0, row_max + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out.reshape(b, n, t, h), lse.reshape(b, n, t)


def attention_probabilities(q, k, mask, sm_scale: float) -> jax.Array:
    """Softmax probabilities f32 [B, N, T, S] under a mask (fully masked rows are 0).

    q [B, N, T, H], k [B, K, S, H], mask bool broadcastable to [B, K, G, T, S]. Plain jnp: used
    by policies that score keys from a few observation queries.
    """
    b, n, t, _ = q.shape
    qg = _group_queries(q, k.shape[1])
    scores = jnp.einsum("bkgth,bksh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * sm_scale, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    return probs.reshape(b, n, t, k.shape[2])


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combines attention over two disjoint key sets from their outputs and logsumexps."""
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_a = jnp.exp(lse_a - m)[..., None]
    w_b = jnp.exp(lse_b - m)[..., None]
    total = w_a + w_b
    out = (w_a * out_a + w_b * out_b) / jnp.where(total > 0, total, 1.0)
    lse = jnp.where(
        total[..., 0] > 0, m + jnp.log(jnp.where(total[..., 0] > 0, total[..., 0], 1.0)), -jnp.inf
    )
    return out, lse


def causal_attention(q, k, v, *, sm_scale: float, backend: str = "xla") -> jax.Array:
    """Dense causal self-attention over whole sequences: q [B, N, T, H] -> [B, N, T, H]."""
    resolve_backend(backend)
    t = q.shape[2]
    causal = jnp.tril(jnp.ones((t, t), bool))
    out, _ = masked_attention(q, k, v, causal, sm_scale)
    return out.astype(q.dtype)


def block_mask_from_lists(
    kv_block_idx, kv_block_cnt, num_tokens: int, block_q: int, block_k: int
) -> jax.Array:
    """Token mask [B, ., T, T] (causal) from per-query-block lists of key blocks.

    kv_block_idx [B, M, nq, nk] lists key blocks (valid entries first), kv_block_cnt [B, M, nq]
    says how many are valid; M is N or K.
    """
    nk = kv_block_idx.shape[-1]
    valid_entry = jnp.arange(nk) < kv_block_cnt[..., None]
    num_kv_blocks = -(-num_tokens // block_k)
    listed = jnp.any(
        (kv_block_idx[..., None] == jnp.arange(num_kv_blocks)) & valid_entry[..., None], axis=-2
    )
    token_q_block = jnp.arange(num_tokens) // block_q
    token_k_block = jnp.arange(num_tokens) // block_k
    mask = listed[..., token_q_block, :][..., token_k_block]
    return mask & jnp.tril(jnp.ones((num_tokens, num_tokens), bool))


def block_sparse_attention(
    q,
    k,
    v,
    kv_block_idx,
    kv_block_cnt,
    *,
    sm_scale: float,
    block_q: int,
    block_k: int,
    backend: str = "xla",
) -> jax.Array:
    """Causal attention restricted to listed (query block, key block) pairs; [B, N, T, H].

    Block lists are given per query head ([B, N, nq, nk]) or per KV head ([B, K, nq, nk]).
    Rows with no visible key give 0.
    """
    resolve_backend(backend)
    b, n, t, _ = q.shape
    num_kv_heads = k.shape[1]
    mask = block_mask_from_lists(kv_block_idx, kv_block_cnt, t, block_q, block_k)
    if mask.shape[1] == n:
        mask = mask.reshape(b, num_kv_heads, n // num_kv_heads, t, t)
    elif mask.shape[1] == num_kv_heads:
        mask = mask[:, :, None]
    else:
        raise ValueError(
            f"kv_block_idx has {mask.shape[1]} heads: expected N={n} or K={num_kv_heads}"
        )
    out, _ = masked_attention(q, k, v, mask, sm_scale)
    return out.astype(q.dtype)


def chunk_attention(q, k, v, positions, *, sm_scale: float, backend: str = "xla"):
    """Causal attention within a chunk by original positions; -1 marks padding keys.

    q [B, N, C, H], k, v [B, K, C, H], positions [B, C].
    Returns out f32 [B, N, C, H], lse [B, N, C].
    """
    resolve_backend(backend)
    key_pos = positions[:, None, None, None, :]
    query_pos = positions[:, None, None, :, None]
    mask = (key_pos >= 0) & (key_pos <= query_pos)
    return masked_attention(q, k, v, mask, sm_scale)


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Dense view [B, K, M * p, H] of a page pool [P, p, H] through page_table [B, K, M]."""
    gathered = pages[jnp.maximum(page_table, 0)]
    b, k, m, p, h = gathered.shape
    return gathered.reshape(b, k, m * p, h)


def paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    *,
    sm_scale: float,
    page_mask=None,
    backend: str = "xla",
):
    """Attention of q [B, N, C, H] over each (sequence, KV head)'s first `lengths` cached tokens.

    k_pages, v_pages [P, p, H]; page_table int32 [B, K, M] (-1 = unallocated); lengths [B, K];
    page_mask bool [B, K, M] optionally restricts the read to selected pages (Quest).
    Every cached token precedes every query, so no causal mask applies.
    Returns out f32 [B, N, C, H] and lse f32 [B, N, C] (-inf where nothing is read).
    """
    resolve_backend(backend)
    k = gather_pages(k_pages, page_table)
    v = gather_pages(v_pages, page_table)
    slots = jnp.arange(k.shape[2])
    read = slots < lengths[..., None]
    if page_mask is not None:
        read = read & page_mask[..., slots // k_pages.shape[1]]
    return masked_attention(q, k, v, read[:, :, None, None, :], sm_scale)


def _attention_mass(q, k, mask, lse, query_weights, sm_scale: float):
    """Attention each key receives, weighted over queries and averaged over the group's heads.

    q [B, N, T, H], k [B, K, S, H], mask bool broadcastable to [B, K, G, T, S], lse [B, N, T]
    (the logsumexp over all keys the queries attend to), query_weights f32 [B, T].
    Returns f32 [B, K, S].
    """
    b, n, t, _ = q.shape
    num_kv_heads = k.shape[1]
    qg = _group_queries(q, num_kv_heads)
    scores = jnp.einsum("bkgth,bksh->bkgts", qg, k, preferred_element_type=jnp.float32)
    lse = lse.reshape(b, num_kv_heads, n // num_kv_heads, t, 1)
    probs = jnp.where(mask & jnp.isfinite(lse), jnp.exp(scores * sm_scale - lse), 0.0)
    probs = probs * query_weights[:, None, None, :, None]
    return jnp.sum(probs, axis=(2, 3)) / (n // num_kv_heads)


def paged_attention_mass(
    q, k_pages, page_table, lengths, lse, query_weights, *, sm_scale: float, backend: str = "xla"
):
    """Per cached slot [B, K, M * p]: attention mass received, queries weighted [B, T]."""
    resolve_backend(backend)
    k = gather_pages(k_pages, page_table)
    held = jnp.arange(k.shape[2]) < lengths[..., None]
    return _attention_mass(q, k, held[:, :, None, None, :], lse, query_weights, sm_scale)


def chunk_attention_mass(
    q, k, positions, lse, query_weights, *, sm_scale: float, backend: str = "xla"
):
    """Per chunk token [B, K, C]: attention mass from the chunk's own causal queries, weighted."""
    resolve_backend(backend)
    key_pos = positions[:, None, None, None, :]
    query_pos = positions[:, None, None, :, None]
    mask = (key_pos >= 0) & (key_pos <= query_pos)
    return _attention_mass(q, k, mask, lse, query_weights, sm_scale)
