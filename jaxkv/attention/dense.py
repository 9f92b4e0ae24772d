"""Dense attention in jnp (the oracle of the kernels) and whole-sequence attention dispatch.

`grouped_scores` is the one grouped-query score product every dense attention, probability and
mass computation builds on. Whole-sequence causal attention (`causal_attention`,
`gated_causal_attention`, `block_sparse_attention`) and a chunk's attention to itself
(`chunk_attention`) run the block-sparse prefill kernel on a GPU's kernel backends and jax's
splash attention on a TPU's (jnp there for block lists and WG-KV's gate bias, which splash cannot
take); the WG-KV ring's `local_attention`,
observation-query probabilities and partial merges are jnp on every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv import pallas_kernels
from jaxkv.attention.dispatch import on_platform, prefill_block, resolve_backend, uses_kernels
from jaxkv.models import layers


def group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, N, T, H] -> [B, K, G, T, H]."""
    b, n, t, h = q.shape
    if n % num_kv_heads:
        raise ValueError(f"query heads N={n} must be a multiple of KV heads K={num_kv_heads}")
    return q.reshape(b, num_kv_heads, n // num_kv_heads, t, h)


def grouped_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """Unscaled scores f32 [B, K, G, T, S] of queries q [B, N, T, H] on keys k [B, K, S, H]:
    query head n = k * G + g reads KV head k."""
    qg = group_queries(q, k.shape[1])
    return jnp.einsum("bkgth,bksh->bkgts", qg, k, preferred_element_type=jnp.float32)


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sm_scale: float
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention in f32 with an explicit mask; fully masked rows give out 0, lse -inf.

    Args:
      q: [B, N, T, H]; k, v: [B, K, S, H]; mask: bool broadcastable to [B, K, G, T, S].
    Returns:
      out f32 [B, N, T, H], lse f32 [B, N, T].
    """
    scores = jnp.where(mask, grouped_scores(q, k) * sm_scale, -jnp.inf)
    return attention_from_scores(scores, v)


def attention_from_scores(scores: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax attention from scaled, masked (-inf) scores f32 [B, K, G, T, S] over values
    v [B, K, S, H]: out f32 [B, N, T, H], lse f32 [B, N, T]; fully masked rows give 0, -inf."""
    b, num_kv, g, t, _ = scores.shape
    n, h = num_kv * g, v.shape[-1]
    # The shift by the row max leaves the result unchanged: no gradient flows through it (as
    # in jax.nn.softmax), which also keeps -inf scores out of the backward pass.
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("bkgts,bksh->bkgth", probs, v.astype(jnp.float32))
    out = out / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom > 0, row_max + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out.reshape(b, n, t, h), lse.reshape(b, n, t)


def attention_probabilities(
    q: jax.Array, k: jax.Array, mask: jax.Array, sm_scale: float
) -> jax.Array:
    """Softmax probabilities f32 [B, N, T, S] under a mask (fully masked rows are 0).

    q [B, N, T, H], k [B, K, S, H], mask bool broadcastable to [B, K, G, T, S]. Plain jnp: used
    by policies that score keys from a few observation queries.
    """
    b, n, t, _ = q.shape
    scores = grouped_scores(q, k)
    scores = jnp.where(mask, scores * sm_scale, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    return probs.reshape(b, n, t, k.shape[2])


def merge_partials(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
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


def kernel_causal(
    q, k, v, *, sm_scale: float, backend, gate_bias=None, band=None, return_lse: bool = True
):
    """Dense causal attention on a kernel backend: out [B, N, T, H] in q's dtype and, with
    `return_lse`, lse [B, N, T].

    On a GPU through the block-sparse kernel; on a TPU through splash attention, or in jnp
    (`_jnp_causal`) with a gate bias, which splash cannot add, or for fewer tokens than
    `SPLASH_MIN_TOKENS` (a decode step's own token). With `gate_bias` f32 [B, K, T],
    key j's bias is added to the scores of queries i with i - j >= `band`. Differentiable
    without `return_lse`.
    """

    def on_gpu(q, k, v, gate_bias, *, interpret):
        b, _, t, _ = q.shape
        block = prefill_block(t)
        kv_block_idx, kv_block_cnt = pallas_kernels.dense_causal_block_lists(
            b, k.shape[1], t, block_q=block, block_k=block
        )
        out, lse = pallas_kernels.block_sparse_attention(
            q,
            k,
            v,
            kv_block_idx,
            kv_block_cnt,
            sm_scale=sm_scale,
            gate_bias=gate_bias,
            band=band,
            block_q=block,
            block_k=block,
            return_lse=True,
            interpret=interpret,
        )
        return (out, lse) if return_lse else out

    def on_tpu(q, k, v, gate_bias, *, interpret):
        if gate_bias is None and q.shape[2] >= pallas_kernels.SPLASH_MIN_TOKENS:
            return pallas_kernels.causal_attention_tpu(
                q, k, v, sm_scale=sm_scale, return_lse=return_lse, interpret=interpret
            )
        out, lse = _jnp_causal(q, k, v, gate_bias, sm_scale=sm_scale, band=band)
        return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)

    return on_platform(backend, q, k, v, gate_bias, gpu=on_gpu, tpu=on_tpu)


def _jnp_causal(q, k, v, gate_bias, *, sm_scale: float, band):
    """Causal attention in jnp, `gate_bias` [B, K, T] (or None) added outside the `band`:
    out f32 [B, N, T, H], lse f32 [B, N, T]."""
    t = q.shape[2]
    scores = grouped_scores(q, k) * sm_scale
    if gate_bias is not None:
        outside_band = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :]) >= band
        bias = gate_bias.astype(jnp.float32)[:, :, None, None, :]
        scores = scores + jnp.where(outside_band, bias, 0.0)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    return attention_from_scores(scores, v)


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float, backend: str = "xla"
) -> jax.Array:
    """Dense causal self-attention over whole sequences: q [B, N, T, H] -> [B, N, T, H]."""
    if uses_kernels(backend):
        return kernel_causal(q, k, v, sm_scale=sm_scale, backend=backend, return_lse=False)
    return layers.causal_attention(q, k, v, sm_scale=sm_scale)


def gated_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_gate: jax.Array,
    *,
    band: int,
    sm_scale: float,
    backend: str = "xla",
) -> jax.Array:
    """Causal attention with a per-key bias outside a local band (WG-KV's training attention).

    The score of query i on key j <= i gets `log_gate[j]` added when i - j >= band; keys inside
    the band are untouched. q [B, N, T, H], k, v [B, K, T, H], log_gate f32 [B, K, T] (the log of
    the clamped write gate); differentiable in q, k, v and log_gate on every backend (the
    kernels through their custom VJP). Returns [B, N, T, H] in q's dtype.
    """
    if band < 0:
        raise ValueError(f"band={band} must be >= 0")
    if log_gate.shape != (*k.shape[:3],):
        raise ValueError(f"log_gate has shape {log_gate.shape}: expected [B, K, T] = {k.shape[:3]}")
    if uses_kernels(backend):
        return kernel_causal(
            q,
            k,
            v,
            sm_scale=sm_scale,
            backend=backend,
            gate_bias=log_gate,
            band=band,
            return_lse=False,
        )
    out, _ = _jnp_causal(q, k, v, log_gate, sm_scale=sm_scale, band=band)
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

    def on_gpu(q, k, v, kv_block_idx, kv_block_cnt, *, interpret):
        return pallas_kernels.block_sparse_attention(
            q,
            k,
            v,
            kv_block_idx,
            kv_block_cnt,
            sm_scale=sm_scale,
            block_q=block_q,
            block_k=block_k,
            interpret=interpret,
        )

    def in_jnp(q, k, v, kv_block_idx, kv_block_cnt, *, interpret=False):
        del interpret  # jnp
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

    operands = (q, k, v, kv_block_idx, kv_block_cnt)
    if uses_kernels(backend):
        return on_platform(backend, *operands, gpu=on_gpu, tpu=in_jnp)
    return in_jnp(*operands)


def chunk_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float,
    backend: str = "xla",
) -> tuple[jax.Array, jax.Array]:
    """Causal attention within a chunk by original positions; -1 marks padding.

    q [B, N, C, H], k, v [B, K, C, H], positions [B, C]: the valid tokens are a prefix of the
    chunk with increasing positions (what `generate` writes), so position order is index order
    and the kernels' index-causal mask is the same mask; padded queries give out 0, lse -inf.
    Returns out f32 [B, N, C, H], lse [B, N, C].
    """
    if uses_kernels(backend):
        out, lse = kernel_causal(q, k, v, sm_scale=sm_scale, backend=backend)
        valid = (positions >= 0)[:, None, :]
        return jnp.where(valid[..., None], out.astype(jnp.float32), 0.0), jnp.where(
            valid, lse, -jnp.inf
        )
    key_pos = positions[:, None, None, None, :]
    query_pos = positions[:, None, None, :, None]
    mask = (key_pos >= 0) & (key_pos <= query_pos)
    return masked_attention(q, k, v, mask, sm_scale)


def local_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_positions: jax.Array,
    key_positions: jax.Array,
    key_admitted: jax.Array,
    *,
    window: int,
    sm_scale: float,
    backend: str = "xla",
) -> tuple[jax.Array, jax.Array]:
    """WG-KV's attention to the local ring (W keys, any slot order): small and dense, jnp.

    A key at position j is visible to a query at position i when it is causal (j <= i) and
    inside the band (i - j < window) or admitted to the global cache (`key_admitted`).
    q [B, N, C, H]; k, v [B, K, S, H]; query_positions [B, C], key_positions [B, S] (-1 = empty
    or padding); key_admitted bool [B, K, S].
    Returns out f32 [B, N, C, H] and lse f32 [B, N, C] (-inf where nothing is visible).
    """
    resolve_backend(backend)
    query_pos = query_positions[:, None, None, :, None]
    key_pos = key_positions[:, None, None, None, :]
    in_band = query_pos - key_pos < window
    visible = in_band | key_admitted[:, :, None, None, :]
    mask = (key_pos >= 0) & (key_pos <= query_pos) & visible
    return masked_attention(q, k, v, mask, sm_scale)
