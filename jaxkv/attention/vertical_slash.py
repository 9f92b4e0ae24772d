"""WG-KV's vertical-slash attention of a chunk to itself: key j is visible to query i when
j <= i and (i - j < window or admitted[j]). The xla backend runs one dense masked attention (the
oracle, and a TPU's kernel backends: jaxkv has no TPU block-sparse kernel); a GPU's kernel
backends split each query block's keys into the slash (block-sparse kernel over sliding-window
block lists) and the vertical (the admitted keys wholly outside the band, compacted and read
through the paged kernel), merged by their logsumexps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import pallas_kernels
from jaxkv.attention.dense import local_attention, merge_partials
from jaxkv.attention.dispatch import Backend, on_platform, prefill_block, uses_kernels
from jaxkv.attention.paged import paged_attention
from jaxkv.pallas_kernels.common import round_up

# Score bias for a key the write gate did not admit, seen from outside the band: the kernel's
# log-gate bias turned into a mask. Finite (with its log2(e) scaling it stays far from -inf), so
# the online softmax stays NaN-free; every row sees its own key (band >= 1), whose score wins.
_NOT_ADMITTED_BIAS = -1e30
# Page size of the compacted admitted keys the vertical part reads through the paged kernel.
_VERTICAL_PAGE = 16


def vertical_slash_chunk_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    admitted: jax.Array,
    *,
    window: int,
    sm_scale: float,
    backend: str = "xla",
) -> tuple[jax.Array, jax.Array]:
    """WG-KV's attention of a chunk to itself: the vertical-slash pattern.

    Key j is visible to query i when j <= i and (i - j < window or admitted[j]).
    q [B, N, C, H]; k, v [B, K, C, H]; positions [B, C] (valid tokens a prefix with consecutive
    positions, -1 padding after them, as `chunk_attention`); admitted bool [B, K, C]; window >= 1.
    Returns out f32 [B, N, C, H] and lse f32 [B, N, C] (-inf for padded queries).

    A GPU's kernel backends split the keys of each query block in two disjoint sets whose partial
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

    def in_jnp(q, k, v, positions, admitted, *, interpret=False):
        del interpret  # jnp
        return local_attention(
            q, k, v, positions, positions, admitted, window=window, sm_scale=sm_scale
        )

    def on_gpu(q, k, v, positions, admitted, *, interpret):
        kernels = Backend.INTERPRET if interpret else Backend.PALLAS
        out, lse = _slash_attention(
            q, k, v, admitted, window=window, sm_scale=sm_scale, interpret=interpret
        )
        if _far_key_blocks(q.shape[2], window)[-1] > 0:  # else no key is wholly outside the band
            vertical = _vertical_attention(
                q, k, v, admitted, window=window, sm_scale=sm_scale, backend=kernels
            )
            out, lse = merge_partials(out, lse, *vertical)
        valid = (positions >= 0)[:, None, :]
        return jnp.where(valid[..., None], out, 0.0), jnp.where(valid, lse, -jnp.inf)

    operands = (q, k, v, positions, admitted)
    if uses_kernels(backend):
        return on_platform(backend, *operands, gpu=on_gpu, tpu=in_jnp)
    return in_jnp(*operands)


def _slash_attention(q, k, v, admitted, *, window: int, sm_scale: float, interpret: bool):
    """Keys of the blocks reaching into the band: j <= i and (i - j < window or admitted[j])."""
    b, _, c, _ = q.shape
    block = prefill_block(c)
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
        interpret=interpret,
    )
    return out.astype(jnp.float32), lse


def _far_key_blocks(num_tokens: int, window: int) -> np.ndarray:
    """int [nq]: per query block qb, how many leading key blocks lie wholly outside the band of
    all its queries (those ending at or before qb * block - window). Static: a decode step or a
    chunk no longer than the band has none, and skips the vertical part."""
    block = prefill_block(num_tokens)
    starts = np.arange(-(-num_tokens // block)) * block
    return np.maximum((starts - window + 1) // block, 0)


def _vertical_attention(q, k, v, admitted, *, window: int, sm_scale: float, backend):
    """Admitted keys of the key blocks every query of a query block sees outside the band (all
    of them before the block's first query minus `window`): paged attention over the admitted
    keys compacted in position order, a query block reading their prefix up to its bound."""
    b, n, c, h = q.shape
    num_kv_heads = k.shape[1]
    block = prefill_block(c)
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
