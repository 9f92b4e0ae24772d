"""Ragged paged decode attention: the Pallas (Mosaic) kernel for TPUs and its launch.

The grid is (sequence, KV head, table entry). The page table and the lengths are scalar-prefetched
into SMEM, and the block index of the K and V pools reads the page id from them, so the pipeline
copies exactly one page [p, H] of the pool per step into VMEM (no gather of the table's width).
Entries past a head's last held page repeat that page's block index, which the pipeline does not
copy again, and their step does no work: a step costs what the head holds. The running max, sum
and accumulator live in VMEM scratch across a head's entries (the "arbitrary" grid axis) and
the output and logsumexp are written at its last entry.

Rows: the G query heads of a KV head (a chunk's C queries per head as more rows), padded to a
multiple of 8 (a TPU sublane tile). The logsumexp comes out broadcast over 128 lanes and is read
at lane 0, as jax's own TPU flash attention does with its statistics.

What the interpreter and lowering check here (CPU): values against the jnp oracle, and that the
kernel lowers to a Mosaic custom call for "tpu". What they cannot: Mosaic's compilation in libtpu
(layouts, VMEM limits) and speed; one page per grid step is the simple tiling, not a tuned one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.pallas_kernels.common import MASK_VALUE, round_up

# Sublane tile of a TPU vector register (rows) and its lane width (the statistics' last dim).
SUBLANES = 8
LANES = 128


def paged_decode_mosaic_kernel(
    page_table_ref,  # SMEM int32 [B * K * M] (scalar prefetch)
    lengths_ref,  # SMEM int32 [B * K] (scalar prefetch)
    q_ref,  # [R, H]
    k_page_ref,  # [p, H]: this step's page of the key pool
    v_page_ref,  # [p, H]
    k_token_scales_ref,  # [1, p] f32 or None
    v_token_scales_ref,  # [1, p] f32 or None
    k_channel_scales_ref,  # [1, H] f32 or None
    v_channel_scales_ref,  # [1, H] f32 or None
    out_ref,  # [R, H] f32
    lse_ref,  # [R, LANES] f32
    *rest,  # optional scores [R, p] f32, then scratch: acc [R, H], max and sum [R, LANES]
    sm_scale: float,
    num_kv_heads: int,
    return_scores: bool,
):
    del page_table_ref  # read by the block index maps only
    scores_ref = rest[0] if return_scores else None
    acc_ref, max_ref, sum_ref = rest[-3:]
    sequence, head, entry = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size = k_page_ref.shape[0]
    length = lengths_ref[sequence * num_kv_heads + head]

    @pl.when(entry == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        max_ref[...] = jnp.full_like(max_ref, MASK_VALUE)
        sum_ref[...] = jnp.zeros_like(sum_ref)

    @pl.when(entry * page_size < length)
    def _read_page():
        # Products in the query's dtype with f32 results, as the Triton kernel computes them
        # (f32 operands in full f32).
        q = q_ref[...]
        precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        if k_channel_scales_ref is not None:
            # Per-channel key scales fold into the query: q . (k * c) == (q * c) . k.
            q = (q.astype(jnp.float32) * k_channel_scales_ref[...]).astype(q_ref.dtype)
        k = k_page_ref[...].astype(q.dtype)
        scores = lax.dot_general(
            q,
            k,
            (((1,), (1,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        scores = scores * sm_scale
        if k_token_scales_ref is not None:
            scores = scores * k_token_scales_ref[...]
        token = entry * page_size + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        held = token < length
        scores = jnp.where(held, scores, MASK_VALUE)
        if scores_ref is not None:
            scores_ref[...] = scores
        old_max = max_ref[...][:, :1]
        new_max = jnp.maximum(old_max, jnp.max(scores, axis=1, keepdims=True))
        rescale = jnp.exp(old_max - new_max)
        probs = jnp.where(held, jnp.exp(scores - new_max), 0.0)
        row_sum = rescale * sum_ref[...][:, :1] + jnp.sum(probs, axis=1, keepdims=True)
        if v_token_scales_ref is not None:
            probs = probs * v_token_scales_ref[...]
        v = v_page_ref[...].astype(q.dtype)
        values = lax.dot_general(
            probs.astype(q.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        acc_ref[...] = rescale * acc_ref[...] + values
        max_ref[...] = jnp.broadcast_to(new_max, max_ref.shape)
        sum_ref[...] = jnp.broadcast_to(row_sum, sum_ref.shape)

    if scores_ref is not None:

        @pl.when(entry * page_size >= length)
        def _unheld_scores():
            scores_ref[...] = jnp.full_like(scores_ref, MASK_VALUE)

    @pl.when(entry == pl.num_programs(2) - 1)
    def _write():
        row_sum = sum_ref[...]
        safe_sum = jnp.where(row_sum > 0, row_sum, 1.0)
        acc = acc_ref[...]
        if v_channel_scales_ref is not None:
            acc = acc * v_channel_scales_ref[...]
        out_ref[...] = acc / safe_sum[:, :1]
        lse_ref[...] = jnp.where(row_sum > 0, max_ref[...] + jnp.log(safe_sum), -jnp.inf)


def paged_decode_mosaic(
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
    return_scores: bool,
    interpret: bool,
):
    """Runs the kernel over every (sequence, KV head, table entry).

    Args:
      q: [B, K, R, H] query rows per KV head.
      k_pages, v_pages: [P, p, H] the pool; page_table: int32 [B, K, M] (-1 unallocated);
      lengths: int32 [B, K] (already clamped to the table's capacity).
      *_token_scales: f32 [P, p] or None; *_channel_scales: f32 [B, K, H] or None.
      interpret: run in the TPU interpreter (DMAs and semaphores simulated on the CPU).
    Returns:
      out f32 [B, K, R, H] (normalised; 0 where nothing is held), lse f32 [B, K, R] (-inf
      there), and with `return_scores` the scaled, masked scores f32 [B, K, R, M * p] (undefined
      past the length).
    """
    batch, num_kv_heads, rows, head_dim = q.shape
    max_pages = page_table.shape[-1]
    page_size = k_pages.shape[1]
    padded_rows = round_up(rows, SUBLANES)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))

    def page_block(sequence, head, entry, table, held):
        row = sequence * num_kv_heads + head
        last_held = jnp.maximum(lax.div(held[row] + page_size - 1, page_size) - 1, 0)
        return jnp.maximum(table[row * max_pages + jnp.minimum(entry, last_held)], 0)

    def per_head(shape):
        return pl.BlockSpec((None, None, *shape), lambda b, h, m, *_: (b, h) + (0,) * len(shape))

    def pool_spec(shape):
        return pl.BlockSpec(
            (None, *shape), lambda b, h, m, *prefetch: (page_block(b, h, m, *prefetch), 0, 0)
        )

    token_scales = [
        None if scales is None else scales.reshape(scales.shape[0], 1, page_size)
        for scales in (k_token_scales, v_token_scales)
    ]
    channel_scales = [
        None if scales is None else scales.reshape(batch, num_kv_heads, 1, head_dim)
        for scales in (k_channel_scales, v_channel_scales)
    ]
    in_specs = [
        per_head((padded_rows, head_dim)),
        pool_spec((page_size, head_dim)),
        pool_spec((page_size, head_dim)),
        *[None if s is None else pool_spec((1, page_size)) for s in token_scales],
        *[None if s is None else per_head((1, head_dim)) for s in channel_scales],
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, num_kv_heads, padded_rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, padded_rows, LANES), jnp.float32),
    ]
    out_specs = [per_head((padded_rows, head_dim)), per_head((padded_rows, LANES))]
    if return_scores:
        out_shape.append(
            jax.ShapeDtypeStruct(
                (batch, num_kv_heads, max_pages, padded_rows, page_size), jnp.float32
            )
        )
        out_specs.append(
            pl.BlockSpec(
                (None, None, None, padded_rows, page_size), lambda b, h, m, *_: (b, h, m, 0, 0)
            )
        )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, num_kv_heads, max_pages),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((padded_rows, head_dim), jnp.float32),
            pltpu.VMEM((padded_rows, LANES), jnp.float32),
            pltpu.VMEM((padded_rows, LANES), jnp.float32),
        ],
    )
    kernel = functools.partial(
        paged_decode_mosaic_kernel,
        sm_scale=sm_scale,
        num_kv_heads=num_kv_heads,
        return_scores=return_scores,
    )
    out, lse, *scores = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_decode_attention_tpu",
    )(
        page_table.reshape(-1),
        lengths.reshape(-1),
        q,
        k_pages,
        v_pages,
        *token_scales,
        *channel_scales,
    )
    out, lse = out[:, :, :rows], lse[:, :, :rows, 0]
    if not return_scores:
        return out, lse
    # [B, K, M, R, p] -> [B, K, R, M * p]: slot m * p + i is token i of entry m.
    scores = jnp.moveaxis(scores[0][:, :, :, :rows], 3, 2)
    return out, lse, scores.reshape(batch, num_kv_heads, rows, max_pages * page_size)
