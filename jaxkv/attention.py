"""Attention dispatch: every attention the models run goes through here.

Backends are chosen explicitly; there is no silent fallback:
  "xla"        plain jnp (CPU, TPU, and the oracle the kernels are tested against);
  "pallas"     Pallas kernels lowered through Triton (NVIDIA GPUs);
  "interpret"  the same Pallas kernels in the Pallas interpreter (CPU tests).

Shapes: B batch, N query heads, K KV heads, G = N // K, T/C query tokens, S key tokens, H head dim.
Queries are [B, N, T, H] and keys/values [B, K, S, H]; query head n reads KV head n // G.
Partial results carry a logsumexp so that attention over disjoint key sets (cached pages and the
current chunk) merges exactly (`merge_partials`).

What the kernels run: whole-sequence causal attention (`causal_attention`,
`gated_causal_attention`, `block_sparse_attention`) and a chunk's attention to itself
(`chunk_attention`) go through the block-sparse prefill kernel; attention over cached pages
(`paged_attention`, with its per-slot probabilities for attention-mass policies) through the ragged
paged decode kernel, a chunk's C queries per head sharing one program per `_CHUNK_ROWS` rows.
Small dense pieces (observation-query probabilities, the mass a chunk gives its own keys, partial
merges) are jnp on every backend.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels.common import round_up

# Tile of the block-sparse kernel (queries and keys); shorter sequences use the next power of two
# >= 16 (the kernel's minimum).
_PREFILL_BLOCK = 64
# Query rows of one paged-kernel program when a chunk's G * C rows of a KV head exceed it.
_CHUNK_ROWS = 64


class Backend(enum.Enum):
    XLA = "xla"
    PALLAS = "pallas"
    INTERPRET = "interpret"


def resolve_backend(backend: str | Backend) -> Backend:
    """Validates a backend name: "pallas" needs an NVIDIA GPU (Triton); the others run anywhere."""
    try:
        resolved = Backend(backend)
    except ValueError:
        allowed = ", ".join(repr(b.value) for b in Backend)
        raise ValueError(f"backend={backend!r}: allowed are {allowed}") from None
    if resolved is Backend.PALLAS and jax.default_backend() != "gpu":
        raise ValueError(
            f"backend='pallas' lowers through Triton and needs an NVIDIA GPU; the default JAX "
            f"backend here is {jax.default_backend()!r}: use backend='interpret' (the Pallas "
            "interpreter) or 'xla'"
        )
    return resolved


def _uses_kernels(backend: str | Backend) -> bool:
    return resolve_backend(backend) is not Backend.XLA


def _interpret(backend: str | Backend) -> bool:
    return resolve_backend(backend) is Backend.INTERPRET


def _prefill_block(num_tokens: int) -> int:
    return min(_PREFILL_BLOCK, max(16, 1 << max(num_tokens - 1, 0).bit_length()))


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


def _kernel_causal(q, k, v, *, sm_scale: float, backend, gate_bias=None, band=None):
    """Dense causal attention through the block-sparse kernel: out [B, N, T, H], lse [B, N, T]."""
    b, _, t, _ = q.shape
    block = _prefill_block(t)
    kv_block_idx, kv_block_cnt = pallas_kernels.dense_causal_block_lists(
        b, k.shape[1], t, block_q=block, block_k=block
    )
    return pallas_kernels.block_sparse_attention(
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
        interpret=_interpret(backend),
    )


def causal_attention(q, k, v, *, sm_scale: float, backend: str = "xla") -> jax.Array:
    """Dense causal self-attention over whole sequences: q [B, N, T, H] -> [B, N, T, H]."""
    if _uses_kernels(backend):
        out, _ = _kernel_causal(q, k, v, sm_scale=sm_scale, backend=backend)
        return out
    t = q.shape[2]
    causal = jnp.tril(jnp.ones((t, t), bool))
    out, _ = masked_attention(q, k, v, causal, sm_scale)
    return out.astype(q.dtype)


def gated_causal_attention(
    q, k, v, log_gate, *, band: int, sm_scale: float, backend: str = "xla"
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
    if _uses_kernels(backend):
        out, _ = _kernel_causal(
            q, k, v, sm_scale=sm_scale, backend=backend, gate_bias=log_gate, band=band
        )
        return out
    b, n, t, h = q.shape
    qg = _group_queries(q, k.shape[1])
    scores = jnp.einsum("bkgth,bksh->bkgts", qg, k, preferred_element_type=jnp.float32)
    outside_band = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :]) >= band
    bias = jnp.where(outside_band, log_gate.astype(jnp.float32)[:, :, None, None, :], 0.0)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores * sm_scale + bias, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bksh->bkgth", probs, v.astype(jnp.float32))
    return out.reshape(b, n, t, h).astype(q.dtype)


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
    if _uses_kernels(backend):
        return pallas_kernels.block_sparse_attention(
            q,
            k,
            v,
            kv_block_idx,
            kv_block_cnt,
            sm_scale=sm_scale,
            block_q=block_q,
            block_k=block_k,
            interpret=_interpret(backend),
        )
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
    """Causal attention within a chunk by original positions; -1 marks padding.

    q [B, N, C, H], k, v [B, K, C, H], positions [B, C]: the valid tokens are a prefix of the
    chunk with increasing positions (what `generate` writes), so position order is index order
    and the kernels' index-causal mask is the same mask; padded queries give out 0, lse -inf.
    Returns out f32 [B, N, C, H], lse [B, N, C].
    """
    if _uses_kernels(backend):
        out, lse = _kernel_causal(q, k, v, sm_scale=sm_scale, backend=backend)
        valid = (positions >= 0)[:, None, :]
        return jnp.where(valid[..., None], out.astype(jnp.float32), 0.0), jnp.where(
            valid, lse, -jnp.inf
        )
    key_pos = positions[:, None, None, None, :]
    query_pos = positions[:, None, None, :, None]
    mask = (key_pos >= 0) & (key_pos <= query_pos)
    return masked_attention(q, k, v, mask, sm_scale)


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Dense view [B, K, M * p, ...] of a page-aligned pool field [P, p, ...] through
    page_table [B, K, M]."""
    gathered = pages[jnp.maximum(page_table, 0)]
    b, k, m, p = gathered.shape[:4]
    return gathered.reshape(b, k, m * p, *gathered.shape[4:])


def dequantize(pages, page_table, token_scales, channel_scales, dtype=jnp.float32):
    """Dense [B, K, M * p, H] values of (int8) pages: stored * token_scale * channel_scale.

    token_scales f32 [P, p] or None; channel_scales f32 [B, K, H] or None.
    """
    values = gather_pages(pages, page_table).astype(dtype)
    if token_scales is not None:
        values = values * gather_pages(token_scales, page_table)[..., None]
    if channel_scales is not None:
        values = values * channel_scales[:, :, None, :]
    return values


def selected_page_table(page_table, lengths, page_mask, page_size: int):
    """The page table with each head's selected pages first (in order) and their token count.

    page_table int32 [B, K, M], lengths [B, K], page_mask bool [B, K, M]. A head's last page is
    its only partial one, so it stays last among the selected and the count stays exact.
    Returns (page_table [B, K, M], lengths [B, K]).
    """
    num_entries = page_table.shape[-1]
    slot = jnp.arange(num_entries)
    held = jnp.clip(lengths[..., None] - slot * page_size, 0, page_size)
    selected = page_mask & (held > 0)
    order = jnp.argsort(jnp.where(selected, slot, num_entries + slot), axis=-1, stable=True)
    table = jnp.take_along_axis(page_table, order, axis=-1)
    table = jnp.where(jnp.take_along_axis(selected, order, axis=-1), table, -1)
    return table, jnp.sum(jnp.where(selected, held, 0), axis=-1).astype(jnp.int32)


def paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    *,
    sm_scale: float,
    page_mask=None,
    k_scales=None,
    v_scales=None,
    k_channel_scales=None,
    v_channel_scales=None,
    return_probs: bool = False,
    backend: str = "xla",
):
    """Attention of q [B, N, C, H] over each (sequence, KV head)'s first `lengths` cached tokens.

    k_pages, v_pages [P, p, H] (float, or int8 with scales); page_table int32 [B, K, M]
    (-1 = unallocated); lengths [B, K]; page_mask bool [B, K, M] optionally restricts the read
    to selected pages (Quest). Int8 pages dequantise as stored * token scale ([P, p]) *
    channel scale ([B, K, H]), either scale optional. Every cached token precedes every query,
    so no causal mask applies.
    Returns out f32 [B, N, C, H], lse f32 [B, N, C] (-inf where nothing is read) and, with
    `return_probs`, each page-table slot's probability f32 [B, N, C, M * p] (0 where unread):
    policies accumulate attention mass from it without a second pass over the cache.
    """
    scales = (k_scales, v_scales, k_channel_scales, v_channel_scales)
    if return_probs and page_mask is not None:
        raise ValueError("return_probs=True with a page_mask: selection reads no mass statistics")
    if _uses_kernels(backend):
        return _kernel_paged_attention(
            q,
            k_pages,
            v_pages,
            page_table,
            lengths,
            scales,
            sm_scale,
            page_mask,
            return_probs,
            backend,
        )
    k = dequantize(k_pages, page_table, k_scales, k_channel_scales, q.dtype)
    v = dequantize(v_pages, page_table, v_scales, v_channel_scales, q.dtype)
    slots = jnp.arange(k.shape[2])
    read = slots < lengths[..., None]
    if page_mask is not None:
        read = read & page_mask[..., slots // k_pages.shape[1]]
    out, lse = masked_attention(q, k, v, read[:, :, None, None, :], sm_scale)
    if not return_probs:
        return out, lse
    scores = jnp.einsum(
        "bkgch,bksh->bkgcs", _group_queries(q, k.shape[1]), k, preferred_element_type=jnp.float32
    )
    b, n, c, _ = q.shape
    probs = jnp.where(
        read[:, :, None, None, :] & jnp.isfinite(lse.reshape(scores.shape[:4]))[..., None],
        jnp.exp(scores * sm_scale - lse.reshape(scores.shape[:4])[..., None]),
        0.0,
    )
    return out, lse, probs.reshape(b, n, c, -1)


def _kernel_paged_attention(
    q, k_pages, v_pages, page_table, lengths, scales, sm_scale, page_mask, return_probs, backend
):
    """`paged_attention` through the ragged paged decode kernel (C queries per head as rows)."""
    b, n, c, h = q.shape
    k_scales, v_scales, k_channel_scales, v_channel_scales = scales
    capacity = page_table.shape[-1] * k_pages.shape[1]
    if page_mask is not None:
        page_table, lengths = selected_page_table(page_table, lengths, page_mask, k_pages.shape[1])
    rows = n // page_table.shape[1] * c
    block_sizes = pallas_kernels.PagedDecodeBlockSizes(
        block_h=_CHUNK_ROWS if rows > _CHUNK_ROWS else None
    )
    out, stats = pallas_kernels.paged_decode_attention(
        q.reshape(b, n * c, h),
        k_pages,
        v_pages,
        page_table,
        lengths,
        sm_scale=sm_scale,
        k_scales=k_scales,
        v_scales=v_scales,
        k_channel_scales=k_channel_scales,
        v_channel_scales=v_channel_scales,
        return_stats=True,
        return_probs=return_probs,
        block_sizes=block_sizes,
        interpret=_interpret(backend),
    )
    out, lse = out.reshape(b, n, c, h), stats.lse.reshape(b, n, c)
    if not return_probs:
        return out, lse
    return out, lse, stats.probs.reshape(b, n, c, capacity)


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


def mass_from_probs(probs, part_lse, total_lse, query_weights, num_kv_heads: int):
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
    q, k, positions, lse, query_weights, *, sm_scale: float, backend: str = "xla"
):
    """Per chunk token [B, K, C]: attention mass from the chunk's own causal queries, weighted.

    jnp on every backend: C x C scores per head, small next to the chunk's attention itself."""
    resolve_backend(backend)
    key_pos = positions[:, None, None, None, :]
    query_pos = positions[:, None, None, :, None]
    mask = (key_pos >= 0) & (key_pos <= query_pos)
    return _attention_mass(q, k, mask, lse, query_weights, sm_scale)


# Score bias for a key the write gate did not admit, seen from outside the band: the kernel's
# log-gate bias turned into a mask. Finite (with its log2(e) scaling it stays far from -inf), so
# the online softmax stays NaN-free; every row sees its own key (band >= 1), whose score wins.
_NOT_ADMITTED_BIAS = -1e30
# Page size of the compacted admitted keys the vertical part reads through the paged kernel.
_VERTICAL_PAGE = 16


def vertical_slash_chunk_attention(
    q, k, v, positions, admitted, *, window: int, sm_scale: float, backend: str = "xla"
):
    """WG-KV's attention of a chunk to itself: the vertical-slash pattern.

    Key j is visible to query i when j <= i and (i - j < window or admitted[j]).
    q [B, N, C, H]; k, v [B, K, C, H]; positions [B, C] (valid tokens a prefix with consecutive
    positions, -1 padding after them, as `chunk_attention`); admitted bool [B, K, C]; window >= 1.
    Returns out f32 [B, N, C, H] and lse f32 [B, N, C] (-inf for padded queries).

    The kernel backends split the keys of each query block in two disjoint sets whose partial
    attentions merge: the slash, the key blocks holding a pair inside the band (block-sparse
    kernel over sliding-window lists; there the unadmitted keys outside the band are masked by
    the gate bias), and the vertical, the admitted keys of the blocks wholly outside the band,
    compacted per head and read through the paged kernel with one length per query block. The
    work is the band plus the admitted columns, however the admitted columns are spread.
    """
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    valid = positions >= 0
    admitted = admitted & valid[:, None, :]
    if not _uses_kernels(backend):
        return local_attention(
            q, k, v, positions, positions, admitted, window=window, sm_scale=sm_scale
        )
    out, lse = _slash_attention(
        q, k, v, admitted, window=window, sm_scale=sm_scale, backend=backend
    )
    if _far_key_blocks(q.shape[2], window)[-1] > 0:  # else no key lies wholly outside the band
        vertical = _vertical_attention(
            q, k, v, admitted, window=window, sm_scale=sm_scale, backend=backend
        )
        out, lse = merge_partials(out, lse, *vertical)
    valid = valid[:, None, :]
    return jnp.where(valid[..., None], out, 0.0), jnp.where(valid, lse, -jnp.inf)


def _slash_attention(q, k, v, admitted, *, window: int, sm_scale: float, backend):
    """Keys of the blocks reaching into the band: j <= i and (i - j < window or admitted[j])."""
    b, _, c, _ = q.shape
    block = _prefill_block(c)
    kv_block_idx, kv_block_cnt = pallas_kernels.sliding_window_block_lists(
        b, k.shape[1], c, window=window, block_q=block, block_k=block
    )
    out, lse = pallas_kernels.block_sparse_attention(
        q,
        k,
        v,
        kv_block_idx,
        kv_block_cnt,
        sm_scale=sm_scale,
        gate_bias=jnp.where(admitted, 0.0, _NOT_ADMITTED_BIAS),
        band=window,
        block_q=block,
        block_k=block,
        return_lse=True,
        interpret=_interpret(backend),
    )
    return out.astype(jnp.float32), lse


def _far_key_blocks(num_tokens: int, window: int) -> np.ndarray:
    """int [nq]: per query block qb, how many leading key blocks lie wholly outside the band of
    all its queries (those ending at or before qb * block - window). Static: a decode step or a
    chunk no longer than the band has none, and skips the vertical part."""
    block = _prefill_block(num_tokens)
    starts = np.arange(-(-num_tokens // block)) * block
    return np.maximum((starts - window + 1) // block, 0)


def _vertical_attention(q, k, v, admitted, *, window: int, sm_scale: float, backend):
    """Admitted keys of the key blocks every query of a query block sees outside the band (all
    of them before the block's first query minus `window`): paged attention over the admitted
    keys compacted in position order, a query block reading their prefix up to its bound."""
    b, n, c, h = q.shape
    num_kv_heads = k.shape[1]
    block = _prefill_block(c)
    num_blocks = -(-c // block)
    padded = round_up(c, _VERTICAL_PAGE)
    # Admitted keys first, in position order; the rest follow and are never read.
    order = jnp.argsort(~admitted, axis=-1, stable=True)
    order = jnp.pad(order, ((0, 0), (0, 0), (0, padded - c)))

    def compacted(x):  # [B, K, C, H] -> pool [B * K * padded / page, page, H]
        x = jnp.take_along_axis(x, order[..., None], axis=2)
        return x.reshape(-1, _VERTICAL_PAGE, h)

    far_blocks = jnp.asarray(_far_key_blocks(c, window))
    admitted_before = jnp.pad(
        jnp.cumsum(admitted, axis=-1, dtype=jnp.int32), ((0, 0), (0, 0), (1, 0))
    )
    lengths = admitted_before[..., jnp.minimum(far_blocks * block, c)]  # [B, K, nq]
    pages_per_head = padded // _VERTICAL_PAGE
    table = (jnp.arange(b * num_kv_heads) * pages_per_head)[:, None] + jnp.arange(pages_per_head)
    table = jnp.broadcast_to(
        table.reshape(b, 1, num_kv_heads, pages_per_head),
        (b, num_blocks, num_kv_heads, pages_per_head),
    )
    q_blocks = jnp.pad(q, ((0, 0), (0, 0), (0, num_blocks * block - c), (0, 0)))
    q_blocks = q_blocks.reshape(b, n, num_blocks, block, h).transpose(0, 2, 1, 3, 4)
    out, lse = paged_attention(
        q_blocks.reshape(b * num_blocks, n, block, h),
        compacted(k),
        compacted(v),
        table.reshape(b * num_blocks, num_kv_heads, pages_per_head).astype(jnp.int32),
        jnp.swapaxes(lengths, 1, 2).reshape(b * num_blocks, num_kv_heads),
        sm_scale=sm_scale,
        backend=backend,
    )
    out = out.reshape(b, num_blocks, n, block, h).transpose(0, 2, 1, 3, 4)
    lse = lse.reshape(b, num_blocks, n, block).transpose(0, 2, 1, 3)
    return out.reshape(b, n, -1, h)[:, :, :c], lse.reshape(b, n, -1)[:, :, :c]


def local_attention(
    q,
    k,
    v,
    query_positions,
    key_positions,
    key_admitted,
    *,
    window: int,
    sm_scale: float,
    backend: str = "xla",
):
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
