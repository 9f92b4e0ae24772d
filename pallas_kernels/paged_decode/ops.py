"""Public ragged paged decode attention op: validation, padding, split-K combine, statistics.

Quantised pages: int8 `k_pages`/`v_pages` carry per-token scales `[P, p]` (page-aligned like the
other per-token metadata, so they move with their token through compaction) and/or per-channel
scales `[B, K, H]` per (sequence, KV head); a stored value dequantises as
`int8 * token_scale[t] * channel_scale[c]`. The kernel folds key channel scales into the query,
key token scales into the scores, value token scales into the probabilities and value channel
scales into the output, so nothing is dequantised tile by tile.

Two kernels compute it: `target="triton"` (NVIDIA GPUs, split-K over a head's pages, `kernel.py`)
and `target="mosaic"` (TPUs, one page per pipelined grid step, `mosaic.py`); both return the same
outputs and statistics, and `interpret=True` runs either in its interpreter on a CPU.

A second key segment (WG-KV's local ring of recent tokens, a chunk's own keys) is not an input:
attend to it separately and merge the two partial results through their logsumexps
(`jaxkv.attention.merge_partials`), which is exact. A ring kept in reserved pool pages is a second
call of this op with its own page table and lengths.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.pallas_kernels.common import check_tile, round_up
from jaxkv.pallas_kernels.paged_decode.kernel import BlockSizes, paged_decode_partials
from jaxkv.pallas_kernels.paged_decode.mosaic import paged_decode_mosaic

TARGETS = ("triton", "mosaic")


class DecodeStats(NamedTuple):
    """Softmax statistics of a paged decode call.

    Attributes:
      lse: f32 [B, N] logsumexp of the scaled scores over the held keys; -inf where a head holds
        nothing (its output is then 0), so `merge_partials` gives the other part weight 1.
      probs: f32 [B, N, M * p] softmax probability of each page-table slot (slot m * p + i is
        token i of table entry m), 0 past the length; None unless `return_probs`.
    """

    lse: jax.Array
    probs: jax.Array | None


def paged_decode_attention(
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
    return_stats: bool = False,
    return_probs: bool = False,
    block_sizes: BlockSizes | None = None,
    target: str = "triton",
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, DecodeStats]:
    """Attention of one query per head over its KV head's own ragged list of pages.

    Args:
      q: [B, N, H] float. Query head n reads KV head n // G (G = N // K). A chunk of C queries
        per head is passed as `q.reshape(B, N * C, H)` from [B, N, C, H]: row n * C + c still
        maps to KV head n // G, and the G * C rows of a KV head share one program.
      k_pages, v_pages: [P, p, H] the shared pool (float, or int8 with scales); p and H powers
        of two.
      page_table: int32 [B, K, M]; page ids in token order, -1 where unallocated.
      lengths: int32 [B, K]; tokens held per (sequence, KV head), 0 to M * p. Concrete values
        are checked; traced values are clamped to [0, M * p].
      sm_scale: multiplies q . k.
      k_scales, v_scales: f32 [P, p] per-token scales of int8 pages.
      k_channel_scales, v_channel_scales: f32 [B, K, H] per-channel scales of int8 pages.
      return_stats: also return `DecodeStats` (the logsumexp per query head).
      return_probs: with `return_stats`, also the per-slot probabilities.
      block_sizes: tiles and launch parameters of the Triton kernel; None takes `BlockSizes()`
        (tuned defaults). The Mosaic kernel has no tiles to choose: None only.
      target: "triton" (NVIDIA GPUs) or "mosaic" (TPUs).
      interpret: run the target's interpreter on the CPU (tests) instead of compiling.
    Returns:
      out f32 [B, N, H] (0 for a head holding nothing), and `DecodeStats` with `return_stats`.
    """
    if target not in TARGETS:
        raise ValueError(f"target={target!r}: allowed are {', '.join(map(repr, TARGETS))}")
    _check_inputs(q, k_pages, v_pages, page_table, lengths)
    if target == "triton":
        _check_triton_offsets(k_pages)
    elif block_sizes is not None:
        raise ValueError("block_sizes tile the Triton kernel: give None with target='mosaic'")
    _check_scales(k_pages, page_table, "k", k_scales, k_channel_scales)
    _check_scales(v_pages, page_table, "v", v_scales, v_channel_scales)
    if return_probs and not return_stats:
        raise ValueError("return_probs=True needs return_stats=True")
    if target == "triton":
        block_sizes = (block_sizes or BlockSizes()).resolve(k_pages.shape[1])
    return _paged_decode(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        k_scales,
        v_scales,
        k_channel_scales,
        v_channel_scales,
        sm_scale=float(sm_scale),
        block_sizes=block_sizes,
        return_stats=return_stats,
        return_probs=return_probs,
        target=target,
        interpret=interpret,
    )


def offsets_would_wrap(pages) -> bool:
    """Whether the Triton lowering would address `pages` with wrapping offsets: it picks int32
    element offsets for arrays of at most 2^32 bytes, so 1-byte arrays of 2^31..2^32 elements
    overflow (wider dtypes stay below 2^31 elements, larger arrays get int64 offsets)."""
    return pages.dtype.itemsize == 1 and 2**31 <= pages.size <= 2**32


def _check_inputs(q, k_pages, v_pages, page_table, lengths) -> None:
    if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a float [B, N, H] array, got {q.dtype}{list(q.shape)}")
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if pages.ndim != 3 or not (
            jnp.issubdtype(pages.dtype, jnp.floating) or pages.dtype == jnp.int8
        ):
            raise ValueError(
                f"{name} must be a float or int8 [P, p, H] pool, got {pages.dtype}"
                f"{list(pages.shape)}"
            )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} differs from k_pages {k_pages.shape}")
    batch, num_heads, head_dim = q.shape
    if k_pages.shape[2] != head_dim:
        raise ValueError(f"k_pages head dim {k_pages.shape[2]} differs from q's {head_dim}")
    check_tile("head_dim", head_dim, 16)
    check_tile("page_size (k_pages.shape[1])", k_pages.shape[1])
    if page_table.ndim != 3 or page_table.dtype != jnp.int32 or page_table.shape[0] != batch:
        raise ValueError(
            f"page_table must be int32 [B={batch}, K, M], got {page_table.dtype}"
            f"{list(page_table.shape)}"
        )
    num_kv_heads = page_table.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q has N={num_heads} heads, not a multiple of page_table's K={num_kv_heads}"
        )
    if lengths.shape != (batch, num_kv_heads) or lengths.dtype != jnp.int32:
        raise ValueError(
            f"lengths must be int32 [B={batch}, K={num_kv_heads}], got {lengths.dtype}"
            f"{list(lengths.shape)}"
        )
    capacity = page_table.shape[2] * k_pages.shape[1]
    try:
        held = np.asarray(lengths)
    except jax.errors.TracerArrayConversionError:
        return
    if held.size and (held.min() < 0 or held.max() > capacity):
        raise ValueError(
            f"lengths must lie in [0, {capacity}] (page_table capacity), got "
            f"[{held.min()}, {held.max()}]"
        )


def _check_triton_offsets(k_pages) -> None:
    if offsets_would_wrap(k_pages):
        raise ValueError(
            f"int8 k_pages of {k_pages.size} elements: the Triton lowering addresses arrays of "
            "at most 2^32 bytes with int32 element offsets, which wrap from 2^31 elements on; "
            "give the pool fewer than 2^31 or more than 2^32 elements"
        )


def _check_scales(pages, page_table, prefix, token_scales, channel_scales) -> None:
    quantized = pages.dtype == jnp.int8
    given = token_scales is not None or channel_scales is not None
    if quantized and not given:
        raise ValueError(
            f"{prefix}_pages is int8: give {prefix}_scales and/or {prefix}_channel_scales"
        )
    if given and not quantized:
        raise ValueError(f"{prefix}_scales apply to int8 pages, {prefix}_pages is {pages.dtype}")
    expected = {
        f"{prefix}_scales": (token_scales, pages.shape[:2]),
        f"{prefix}_channel_scales": (channel_scales, (*page_table.shape[:2], pages.shape[2])),
    }
    for name, (scales, shape) in expected.items():
        if scales is not None and (scales.shape != shape or scales.dtype != jnp.float32):
            raise ValueError(
                f"{name} must be f32{list(shape)}, got {scales.dtype}{list(scales.shape)}"
            )


def combine_splits(acc, row_max, row_sum):
    """Merges split-K partials: acc [..., S, R, H], max/sum [..., S, R] -> out, lse [..., R].

    A split that read nothing has sum 0 and the finite MASK_VALUE as max, so it gets no weight
    next to a split that read something, and all-empty rows end with denominator 0.
    """
    top = jnp.max(row_max, axis=-2)
    weight = jnp.exp(row_max - top[..., None, :])
    denom = jnp.sum(weight * row_sum, axis=-2)
    safe_denom = jnp.where(denom > 0, denom, 1.0)
    out = jnp.sum(weight[..., None] * acc, axis=-3) / safe_denom[..., None]
    lse = jnp.where(denom > 0, top + jnp.log(safe_denom), -jnp.inf)
    return out, lse


def _slot_probs(scores, lse, held, group: int, capacity: int):
    """scores [B, K, R, >= capacity], lse [B, K, G], held [B, K] -> probs [B, K * G, capacity]."""
    scores = scores[:, :, :group, :capacity]
    in_cache = (jnp.arange(capacity) < held[..., None])[:, :, None, :]
    probs = jnp.where(in_cache, jnp.exp(scores - lse[..., None]), 0.0)
    b, k = held.shape
    return probs.reshape(b, k * group, capacity)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "block_sizes",
        "return_stats",
        "return_probs",
        "target",
        "interpret",
    ),
)
def _paged_decode(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    k_scales,
    v_scales,
    k_channel_scales,
    v_channel_scales,
    *,
    sm_scale: float,
    block_sizes: BlockSizes | None,
    return_stats: bool,
    return_probs: bool,
    target: str,
    interpret: bool,
):
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, max_pages = page_table.shape
    group = num_heads // num_kv_heads
    capacity = max_pages * k_pages.shape[1]
    held = jnp.clip(lengths, 0, capacity)
    scales = (k_scales, v_scales, k_channel_scales, v_channel_scales)
    q_rows = q.reshape(batch, num_kv_heads, group, head_dim)
    rows_kernel = (
        paged_decode_mosaic
        if target == "mosaic"
        else functools.partial(_triton_rows, block_sizes=block_sizes)
    )
    out, lse, *scores = rows_kernel(
        q_rows,
        k_pages,
        v_pages,
        page_table,
        held,
        *scales,
        sm_scale=sm_scale,
        return_scores=return_probs,
        interpret=interpret,
    )
    out = out.reshape(batch, num_heads, head_dim)
    if not return_stats:
        return out
    probs = _slot_probs(scores[0], lse, held, group, capacity) if return_probs else None
    return out, DecodeStats(lse.reshape(batch, num_heads), probs)


def _triton_rows(
    q_rows,
    k_pages,
    v_pages,
    page_table,
    held,
    *scales,
    sm_scale,
    block_sizes,
    return_scores,
    interpret,
):
    """The Triton kernel over q_rows [B, K, G, H] (the arguments of `paged_decode_mosaic`, plus
    its tiles): out [B, K, G, H], lse [B, K, G] and with `return_scores` the scores
    [B, K, >= G, >= M * p]."""
    batch, num_kv_heads, group, head_dim = q_rows.shape
    max_pages = page_table.shape[-1]
    block_h = block_sizes.rows_per_program(group)
    rows = round_up(group, block_h)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    pages_per_split = block_sizes.split_pages(max_pages, batch * num_kv_heads * rows // block_h)
    padded_pages = round_up(max_pages, pages_per_split) - max_pages
    table = jnp.pad(page_table, ((0, 0), (0, 0), (0, padded_pages)), constant_values=-1)
    acc, row_max, row_sum, *scores = paged_decode_partials(
        q_rows,
        k_pages,
        v_pages,
        table,
        held,
        *scales,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        block_h=block_h,
        pages_per_split=pages_per_split,
        return_scores=return_scores,
        interpret=interpret,
    )
    out, lse = combine_splits(acc, row_max, row_sum)
    return out[:, :, :group], lse[:, :, :group], *scores
