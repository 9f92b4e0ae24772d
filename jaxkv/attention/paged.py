"""Attention over cached pages: each (sequence, KV head) reads its first `lengths` tokens.

On "xla" the page table is read in blocks of `XLA_BLOCK_TOKENS` tokens, only as many blocks as the
longest head holds (a loop with a trip count from `lengths`, not from the table's width): each block
is gathered into a dense view (int8 pages dequantised there), attended in jnp, and merged into the
running result by its logsumexp (an online softmax at block granularity), so a step costs what the
heads hold however wide the bucketed table is. On the kernel backends the ragged paged decode kernel
(Triton on a GPU, Mosaic on a TPU) reads them in place, a chunk's C queries as extra rows of their
KV head (`CHUNK_ROWS` rows a Triton program), dequantising int8 inside the kernel. Quest's page
mask becomes a compacted page table (`selected_page_table`) so unselected pages are never read.
With `return_probs` both paths give each slot's probability, so attention-mass policies need no
second pass over the cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv import pallas_kernels
from jaxkv.attention.dense import attention_from_scores, grouped_scores, merge_partials
from jaxkv.attention.dispatch import CHUNK_ROWS, on_platform, uses_kernels
from jaxkv.collectives import varying_like

# Tokens of one block of the XLA path: large enough that the loop's per-block overhead is small
# next to a block's work, small enough that a chunk's scores per block stay a few MB.
XLA_BLOCK_TOKENS = 512
# At most this many blocks per table (wider tables get longer blocks): the blocks are unrolled.
XLA_MAX_BLOCKS = 16
# In a decode step (one query per sequence), the block that holds the longest head's last token
# is read in parts of 1/XLA_BLOCK_PARTS of a block (whole pages), only as many as it holds: a
# compressed cache's last block is mostly empty. A prefill chunk reads whole blocks (its
# compute dwarfs the last block's waste, and each part is another branch to compile).
XLA_BLOCK_PARTS = 4


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Dense view [B, K, M * p, ...] of a page-aligned pool field [P, p, ...] through
    page_table [B, K, M]."""
    gathered = pages[jnp.maximum(page_table, 0)]
    b, k, m, p = gathered.shape[:4]
    return gathered.reshape(b, k, m * p, *gathered.shape[4:])


def dequantize(
    pages: jax.Array,
    page_table: jax.Array,
    token_scales: jax.Array | None,
    channel_scales: jax.Array | None,
    dtype=jnp.float32,
) -> jax.Array:
    """Dense [B, K, M * p, H] values of (int8) pages: stored * token_scale * channel_scale.

    token_scales f32 [P, p] or None; channel_scales f32 [B, K, H] or None.
    """
    values = gather_pages(pages, page_table).astype(dtype)
    if token_scales is not None:
        values = values * gather_pages(token_scales, page_table)[..., None]
    if channel_scales is not None:
        values = values * channel_scales[:, :, None, :]
    return values


def selected_page_table(
    page_table: jax.Array, lengths: jax.Array, page_mask: jax.Array, page_size: int
) -> tuple[jax.Array, jax.Array]:
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
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float,
    page_mask: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    k_channel_scales: jax.Array | None = None,
    v_channel_scales: jax.Array | None = None,
    return_probs: bool = False,
    backend: str = "xla",
) -> tuple[jax.Array, ...]:
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
    if uses_kernels(backend):
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
    return _xla_paged_attention(
        q, k_pages, v_pages, page_table, lengths, scales, sm_scale, page_mask, return_probs
    )


def xla_block_pages(entries: int, page_size: int) -> int:
    """Pages per block of the XLA path for a table of `entries` pages: `XLA_BLOCK_TOKENS`, or
    twice, four times... that for wide tables, so that a table has at most `XLA_MAX_BLOCKS`
    blocks. Powers of two times the base: the lengths prefill chunks leave (multiples of the
    chunk) then end on block boundaries whatever the table's width (8 widths per octave), where
    blocks of width / 16 read up to a block past them in every chunk."""
    block = max(1, XLA_BLOCK_TOKENS // page_size)
    while -(-entries // block) > XLA_MAX_BLOCKS:
        block *= 2
    return max(1, min(entries, block))


def xla_blocks_read(lengths: jax.Array, entries: int, page_size: int) -> jax.Array:
    """How many blocks the XLA path reads: enough for the longest head, not the table's width."""
    block_tokens = xla_block_pages(entries, page_size) * page_size
    return (jnp.max(lengths) + block_tokens - 1) // block_tokens


def _blocked_table(page_table: jax.Array, page_size: int) -> tuple[jax.Array, int, int]:
    """(the table padded with -1 to whole blocks, pages per block, number of blocks) of the
    XLA path's block-by-block reads."""
    entries = page_table.shape[-1]
    block = xla_block_pages(entries, page_size)
    num_blocks = -(-entries // block)
    padding = ((0, 0), (0, 0), (0, num_blocks * block - entries))
    return jnp.pad(page_table, padding, constant_values=-1), block, num_blocks


def _xla_paged_attention(
    q, k_pages, v_pages, page_table, lengths, scales, sm_scale, page_mask, return_probs
):
    """`paged_attention` in jnp, block by block up to the longest head (module docstring).

    The blocks are unrolled, each under a `lax.switch` on how many of its parts
    (`XLA_BLOCK_PARTS` in a decode step, one in a chunk) hold a token of the longest head: none
    skips it, the block that holds its end reads only its held parts, earlier blocks read whole.
    A loop would carry the pool through its state, and XLA copies a loop's read-only operand
    when the caller goes on to update it in place (the cache write after attention), a copy of
    the whole pool per layer and step.
    """
    b, n, c, h = q.shape
    page_size, entries = k_pages.shape[1], page_table.shape[-1]
    if page_mask is not None:  # Quest: read the selected pages only, compacted first
        page_table, lengths = selected_page_table(page_table, lengths, page_mask, page_size)
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
    k_scales, v_scales, k_channel_scales, v_channel_scales = (
        None if scale is None else jnp.asarray(scale) for scale in scales
    )
    table, block, num_blocks = _blocked_table(page_table, page_size)
    block_tokens = block * page_size
    part = max(1, block // XLA_BLOCK_PARTS) if c == 1 else block  # pages
    num_parts = -(-block // part)
    longest = jnp.max(lengths)
    num_kv = page_table.shape[1]
    scores_shape = (b, num_kv, n // num_kv, c, block_tokens)

    def attend_block(index, pages, out, lse):
        """The block's first `pages` pages (static) attended and merged into (out, lse)."""
        columns = table[:, :, index * block : index * block + pages]
        tokens = pages * page_size
        k = dequantize(k_pages, columns, k_scales, k_channel_scales, q.dtype)
        v = dequantize(v_pages, columns, v_scales, v_channel_scales, q.dtype)
        read = index * block_tokens + jnp.arange(tokens) < lengths[..., None]
        scores = jnp.where(read[:, :, None, None, :], grouped_scores(q, k) * sm_scale, -jnp.inf)
        v = jnp.where(read[..., None], v, 0)  # whatever lies past a head's tokens stays out
        merged = merge_partials(out, lse, *attention_from_scores(scores, v))
        if not return_probs:  # only mass policies need the scores, as wide as the block
            return merged
        padding = [(0, 0)] * (scores.ndim - 1) + [(0, block_tokens - tokens)]
        return (*merged, jnp.pad(scores, padding, constant_values=-jnp.inf))

    def skip_block(out, lse):
        """The partial result as it is: a block past the longest head costs nothing (not even
        a merge over [B, N, C, H], which for a prefill chunk is as large as its output)."""
        if not return_probs:
            return out, lse
        nothing_read = jnp.full(scores_shape, -jnp.inf, jnp.float32)
        return out, lse, varying_like(nothing_read, q, k_pages, page_table, lengths)

    out = jnp.zeros((b, n, c, h), jnp.float32)
    lse = jnp.full((b, n, c), -jnp.inf, jnp.float32)
    out, lse = varying_like((out, lse), q, k_pages, page_table, lengths)
    block_scores = []
    for index in range(num_blocks):
        held_in_block = longest - index * block_tokens
        parts_read = jnp.clip(-(-held_in_block // (part * page_size)), 0, num_parts)
        reads = [
            functools.partial(attend_block, index, min(parts * part, block))
            for parts in range(1, num_parts + 1)
        ]
        out, lse, *scores = jax.lax.switch(parts_read, [skip_block, *reads], out, lse)
        block_scores += scores
    if not return_probs:
        return out, lse
    all_scores = jnp.concatenate(block_scores, axis=-1)
    grouped_lse = lse.reshape(scores_shape[:4])[..., None]
    probs = jnp.where(jnp.isfinite(grouped_lse), jnp.exp(all_scores - grouped_lse), 0.0)
    return out, lse, probs.reshape(b, n, c, -1)[..., : entries * page_size]


def probs_come_with_attention(num_queries: int) -> bool:
    """Whether a step's attention mass over the cached pages is taken from `paged_attention`'s
    per-slot probabilities: only for a single query (decode), on every backend. A chunk's would
    be f32 [B, N, C, M * p] at once (16 GiB for 8 x 32K-token prompts, 32 query heads, 512-token
    chunks; H2O's peak on an H100 was 14.7 GiB above SnapKV's there, results/system/h100), so
    its mass is recomputed block by block after the attention (`paged_attention_mass`)."""
    return num_queries == 1


def paged_attention_mass(
    q: jax.Array,
    k_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    total_lse: jax.Array,
    query_weights: jax.Array,
    *,
    sm_scale: float,
    k_scales: jax.Array | None = None,
    k_channel_scales: jax.Array | None = None,
) -> jax.Array:
    """The attention mass each cached slot receives, f32 [B, K, M * p] (0 past a head's tokens):
    sum over the queries of q [B, N, C, H] (weighted by query_weights [B, C]) of
    exp(score - total_lse), averaged over each KV head's G query heads; total_lse [B, N, C] is
    over everything the queries saw. Equals `mass_from_probs` of `paged_attention`'s
    probabilities, computed in jnp block by block as `paged_attention` reads (a second pass over
    the keys), so a chunk's probabilities [B, N, C, M * p] never exist beyond one block."""
    b, n, c, _ = q.shape
    page_size, entries = k_pages.shape[1], page_table.shape[-1]
    k_pages = jnp.asarray(k_pages)
    k_scales, k_channel_scales = (
        None if scale is None else jnp.asarray(scale) for scale in (k_scales, k_channel_scales)
    )
    table, block, num_blocks = _blocked_table(page_table, page_size)
    block_tokens = block * page_size
    blocks_held = xla_blocks_read(lengths, entries, page_size)
    num_kv = page_table.shape[1]
    group = n // num_kv
    lse = total_lse.reshape(b, num_kv, group, c)[..., None]
    weights = jnp.where(jnp.isfinite(lse), query_weights[:, None, None, :, None], 0.0)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def block_mass(index):
        columns = table[:, :, index * block : (index + 1) * block]
        k = dequantize(k_pages, columns, k_scales, k_channel_scales, q.dtype)
        read = index * block_tokens + jnp.arange(block_tokens) < lengths[..., None]
        probs = jnp.exp(grouped_scores(q, k) * sm_scale - lse) * weights
        probs = jnp.where(read[:, :, None, None, :], probs, 0.0)
        return jnp.sum(probs, axis=(2, 3)) / group

    def skip_block():
        nothing = jnp.zeros((b, num_kv, block_tokens), jnp.float32)
        return varying_like(nothing, q, k_pages, page_table, lengths)

    masses = [
        jax.lax.cond(index < blocks_held, lambda i=index: block_mass(i), skip_block)
        for index in range(num_blocks)
    ]
    return jnp.concatenate(masses, axis=-1)[..., : entries * page_size]


def _kernel_paged_attention(
    q, k_pages, v_pages, page_table, lengths, scales, sm_scale, page_mask, return_probs, backend
):
    """`paged_attention` through the ragged paged decode kernel (C queries per head as rows)."""
    b, n, c, h = q.shape
    capacity = page_table.shape[-1] * k_pages.shape[1]
    if page_mask is not None:
        page_table, lengths = selected_page_table(page_table, lengths, page_mask, k_pages.shape[1])
    rows = n // page_table.shape[1] * c
    triton_tiles = pallas_kernels.PagedDecodeBlockSizes(
        block_h=CHUNK_ROWS if rows > CHUNK_ROWS else None
    )

    def kernel(target, block_sizes, q, k_pages, v_pages, page_table, lengths, scales, *, interpret):
        k_scales, v_scales, k_channel_scales, v_channel_scales = scales
        return pallas_kernels.paged_decode_attention(
            q,
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
            target=target,
            interpret=interpret,
        )

    out, stats = on_platform(
        backend,
        q.reshape(b, n * c, h),
        k_pages,
        v_pages,
        page_table,
        lengths,
        scales,
        gpu=functools.partial(kernel, "triton", triton_tiles),
        tpu=functools.partial(kernel, "mosaic", None),
    )
    out, lse = out.reshape(b, n, c, h), stats.lse.reshape(b, n, c)
    if not return_probs:
        return out, lse
    return out, lse, stats.probs.reshape(b, n, c, capacity)
