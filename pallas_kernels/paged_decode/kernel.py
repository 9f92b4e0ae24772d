"""Ragged paged decode attention: the Pallas (Triton) kernel and its launch.

One program handles the G query heads of one (sequence, KV head) — padded to `block_h` rows so
the dots are at least 16 wide — over one split of that head's page list (split-K). Each head has
its own length; a program reads only the pages its head holds, so a split past the end costs a
launch and no reads. Programs write unnormalised partial results (accumulator, running max, sum)
that `ops.combine_splits` merges in jnp.

Page ids come from an ordinary kernel input (Triton has no scalar prefetch) and pick pages out of
the whole pool with a gather; -1 entries are clamped to page 0 and masked by the length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.pallas_kernels.common import (
    MASK_VALUE,
    check_tile,
    dot,
    next_power_of_two,
    round_up,
    triton_params,
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the paged decode kernel.

    Attributes:
      pages_per_block: pages gathered per inner step; `pages_per_block * page_size` keys are
        scored at a time (a power of two, at least 16 keys). None: 64 keys' worth, or one page
        when pages are larger (`resolve`).
      pages_per_split: pages of a head's table one program reads (split-K); a multiple of
        `pages_per_block`. None: enough splits for about `target_programs` programs in all.
        Fewer splits mean fewer partial results, more mean more programs.
      block_h: query rows per program. None: the G query heads of a KV head in one program,
        padded to the next power of two >= 16.
      num_warps, num_stages: Triton launch parameters.
      target_programs: programs the automatic split aims for (a few per streaming multiprocessor
        keeps the GPU busy when batch * KV heads is small).
    """

    pages_per_block: int | None = None
    pages_per_split: int | None = None
    block_h: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    target_programs: int = 1024

    def resolve(self, page_size: int) -> BlockSizes:
        """These sizes with `pages_per_block` filled in for pages of `page_size` tokens, checked.

        The defaults were the best or within 5% of it on an H100 for Llama-3.1-8B shapes at
        32K tokens per head, batch 1, 8 and 32 (benchmarks/kernel_tuning.py).
        """
        resolved = self
        if self.pages_per_block is None:
            resolved = dataclasses.replace(self, pages_per_block=max(1, 64 // page_size))
        resolved.validate(page_size)
        return resolved

    def validate(self, page_size: int) -> None:
        check_tile("block_sizes.pages_per_block", self.pages_per_block)
        if self.pages_per_split is not None:
            check_tile("block_sizes.pages_per_split", self.pages_per_split, self.pages_per_block)
        if self.pages_per_block * page_size < 16:
            raise ValueError(
                f"block_sizes.pages_per_block={self.pages_per_block} with page_size={page_size}: "
                "a block must hold at least 16 keys"
            )
        if self.block_h is not None:
            check_tile("block_sizes.block_h", self.block_h, 16)

    def rows_per_program(self, group: int) -> int:
        return self.block_h or max(16, next_power_of_two(group))

    def split_pages(self, max_pages: int, programs_per_split: int) -> int:
        """Pages per split for a table of `max_pages` entries (a multiple of pages_per_block)."""
        pages = self.pages_per_split
        if pages is None:
            splits = max(1, self.target_programs // programs_per_split)
            pages = -(-max_pages // splits)
        return min(round_up(pages, self.pages_per_block), round_up(max_pages, self.pages_per_block))


def paged_decode_kernel(
    q_ref,  # [block_h, H]
    k_pages_ref,  # [P, p, H]
    v_pages_ref,  # [P, p, H]
    page_table_ref,  # [pages_per_split] int32: this split's slice of one head's table
    length_ref,  # [] int32: tokens held by this (sequence, KV head)
    k_token_scales_ref,  # [P, p] f32 or None
    v_token_scales_ref,  # [P, p] f32 or None
    k_channel_scales_ref,  # [H] f32 or None
    v_channel_scales_ref,  # [H] f32 or None
    acc_ref,  # [block_h, H] f32: unnormalised output of this split
    max_ref,  # [block_h] f32: running max of the scores
    sum_ref,  # [block_h] f32: softmax denominator relative to the max
    *scores_ref,  # optional [block_h, pages_per_split * p] f32: scaled, masked scores
    sm_scale: float,
    pages_per_block: int,
):
    block_h, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    pages_per_split = page_table_ref.shape[0]
    block_tokens = pages_per_block * page_size
    split_first_page = pl.program_id(3) * pages_per_split
    length = length_ref[()]
    held_pages = lax.div(length + page_size - 1, page_size)
    pages_left = jnp.clip(held_pages - split_first_page, 0, pages_per_split)
    num_blocks = lax.div(pages_left + pages_per_block - 1, pages_per_block)

    q = q_ref[...]
    if k_channel_scales_ref is not None:
        # Per-channel key scales fold into the query: q . (k * c) == (q * c) . k.
        q = (q.astype(jnp.float32) * k_channel_scales_ref[...][None, :]).astype(q_ref.dtype)

    def body(block, carry):
        acc, row_max, row_sum = carry
        first = block * pages_per_block
        pages = jnp.maximum(page_table_ref[pl.ds(first, pages_per_block)], 0)
        k = k_pages_ref[pages].reshape(block_tokens, head_dim).astype(q.dtype)
        scores = dot(q, k, trans_b=True) * sm_scale  # [block_h, block_tokens]
        if k_token_scales_ref is not None:
            scores = scores * k_token_scales_ref[pages].reshape(1, block_tokens)
        token = (split_first_page + first) * page_size + jnp.arange(block_tokens)
        held = (token < length)[None, :]
        scores = jnp.where(held, scores, MASK_VALUE)
        if scores_ref:
            scores_ref[0][:, pl.ds(first * page_size, block_tokens)] = scores
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        rescale = jnp.exp(row_max - new_max)
        probs = jnp.where(held, jnp.exp(scores - new_max[:, None]), 0.0)
        row_sum = rescale * row_sum + jnp.sum(probs, axis=1)
        if v_token_scales_ref is not None:
            probs = probs * v_token_scales_ref[pages].reshape(1, block_tokens)
        v = v_pages_ref[pages].reshape(block_tokens, head_dim).astype(q.dtype)
        acc = rescale[:, None] * acc + dot(probs.astype(q.dtype), v)
        return acc, new_max, row_sum

    init = (
        jnp.zeros((block_h, head_dim), jnp.float32),
        jnp.full((block_h,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    acc, row_max, row_sum = lax.fori_loop(0, num_blocks, body, init)
    if v_channel_scales_ref is not None:
        acc = acc * v_channel_scales_ref[...][None, :]
    acc_ref[...] = acc
    max_ref[...] = row_max
    sum_ref[...] = row_sum


def paged_decode_partials(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    k_token_scales: jax.Array | None,
    v_token_scales: jax.Array | None,
    k_channel_scales: jax.Array | None,
    v_channel_scales: jax.Array | None,
    *,
    sm_scale: float,
    block_sizes: BlockSizes,
    block_h: int,
    pages_per_split: int,
    return_scores: bool,
    interpret: bool,
):
    """Runs the kernel over every (sequence, KV head, row block, split).

    Args:
      q: [B, K, R, H] query rows per KV head, R a multiple of `block_h`.
      k_pages, v_pages: [P, p, H] the pool; page_table: int32 [B, K, S * pages_per_split];
      lengths: int32 [B, K] (already clamped to the table's capacity).
      *_token_scales: f32 [P, p] or None; *_channel_scales: f32 [B, K, H] or None.
    Returns:
      acc f32 [B, K, S, R, H], max and sum f32 [B, K, S, R], and with `return_scores` the
      scaled, masked scores f32 [B, K, R, S * pages_per_split * p] (undefined past the length).
    """
    batch, num_kv_heads, rows, head_dim = q.shape
    num_pages, page_size, _ = k_pages.shape
    num_splits = page_table.shape[-1] // pages_per_split
    grid = (batch, num_kv_heads, rows // block_h, num_splits)

    def whole(shape):
        return pl.BlockSpec(shape, lambda b, h, r, s: (0,) * len(shape))

    def per_head(array):
        return (
            None
            if array is None
            else pl.BlockSpec((None, None, head_dim), lambda b, h, r, s: (b, h, 0))
        )

    def token_scales(array):
        return None if array is None else whole((num_pages, page_size))

    in_specs = [
        pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, r, s: (b, h, r, 0)),
        whole(k_pages.shape),
        whole(v_pages.shape),
        pl.BlockSpec((None, None, pages_per_split), lambda b, h, r, s: (b, h, s)),
        pl.BlockSpec((None, None), lambda b, h, r, s: (b, h)),
        token_scales(k_token_scales),
        token_scales(v_token_scales),
        per_head(k_channel_scales),
        per_head(v_channel_scales),
    ]
    split_rows = (batch, num_kv_heads, num_splits, rows)
    out_shape = [
        jax.ShapeDtypeStruct((*split_rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct(split_rows, jnp.float32),
        jax.ShapeDtypeStruct(split_rows, jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, r, s: (b, h, s, r, 0)),
        pl.BlockSpec((None, None, None, block_h), lambda b, h, r, s: (b, h, s, r)),
        pl.BlockSpec((None, None, None, block_h), lambda b, h, r, s: (b, h, s, r)),
    ]
    if return_scores:
        split_tokens = pages_per_split * page_size
        out_shape.append(
            jax.ShapeDtypeStruct(
                (batch, num_kv_heads, rows, num_splits * split_tokens), jnp.float32
            )
        )
        out_specs.append(
            pl.BlockSpec((None, None, block_h, split_tokens), lambda b, h, r, s: (b, h, r, s))
        )
    kernel = functools.partial(
        paged_decode_kernel, sm_scale=sm_scale, pages_per_block=block_sizes.pages_per_block
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        k_token_scales,
        v_token_scales,
        k_channel_scales,
        v_channel_scales,
    )
