"""Block-sparse causal flash attention: forward, dQ and dK/dV/dgate Pallas (Triton) kernels.

Every launch works on sequences already padded to a multiple of both tiles (`ops` pads); keys at
or past `num_tokens` are masked. Scores are `sm_scale * q . k`, plus `gate_bias[j]` where
`i - j >= band` (WG-KV's log-gate outside the local band); inside a listed block the causal mask
`j <= i` applies. Softmax runs online in f32 with a finite mask value; a row that sees no key gets
output 0 and lse -inf. Query head n reads KV head n // G.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.pallas_kernels.common import MASK_VALUE, check_tile, dot, triton_params

LOG2_E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the block-sparse kernels.

    Attributes:
      block_q, block_k: query and key tile; also the granularity of the block lists.
      num_warps, num_stages: Triton launch parameters (shared by forward and backward).
    """

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_tile("block_q", self.block_q, 16)
        check_tile("block_k", self.block_k, 16)


@dataclasses.dataclass(frozen=True)
class Masking:
    """Static masking parameters of one call: sequence length, score scale and gate band."""

    num_tokens: int
    sm_scale: float
    band: int | None


def _key_block(kv_block_idx_ref, entry, num_key_blocks: int, block_k: int):
    """Start of listed key block `entry`, for loading (clamped) and masking (past the end when
    the entry is out of range, so nothing in it is visible)."""
    block = kv_block_idx_ref[entry]
    in_range = (block >= 0) & (block < num_key_blocks)
    load_start = jnp.clip(block, 0, num_key_blocks - 1) * block_k
    return load_start, jnp.where(in_range, load_start, num_key_blocks * block_k)


def _tile_scores(q, k, bias, row_start, col_start, masking: Masking):
    """Scores f32 [block_q, block_k] (masked to MASK_VALUE), visibility, and the gate band mask.

    q [block_q, H], k [block_k, H], bias f32 [block_k] or None.
    """
    rows = row_start + jnp.arange(q.shape[0])[:, None]
    cols = col_start + jnp.arange(k.shape[0])[None, :]
    visible = (cols <= rows) & (cols < masking.num_tokens)
    scores = dot(q, k, trans_b=True) * masking.sm_scale
    outside_band = None
    if bias is not None:
        outside_band = rows - cols >= masking.band
        scores = scores + jnp.where(outside_band, bias[None, :], 0.0)
    return jnp.where(visible, scores, MASK_VALUE), visible, outside_band


def forward_kernel(
    q_ref,  # [block_q, H]
    k_ref,  # [Tp, H] keys of this query head's KV head
    v_ref,  # [Tp, H]
    kv_block_idx_ref,  # [nk] int32: key blocks listed for this query block
    kv_block_cnt_ref,  # [] int32
    kv_block_unmasked_ref,  # [] int32: leading entries whose keys are all visible to all rows
    gate_bias_ref,  # [Tp] f32 or None
    out_ref,  # [block_q, H]
    lse_ref,  # [block_q] f32
    *,
    masking: Masking,
    block_k: int,
):
    block_q, head_dim = q_ref.shape
    num_key_blocks = k_ref.shape[0] // block_k
    row_start = pl.program_id(2) * block_q
    q = q_ref[...]
    # Scores in base 2 (exp2 is the hardware's exponential): scale and bias carry log2(e).
    masking = dataclasses.replace(masking, sm_scale=masking.sm_scale * LOG2_E)

    def body(entry, carry, *, needs_mask: bool):
        acc, row_max, row_sum = carry
        load_start, mask_start = _key_block(kv_block_idx_ref, entry, num_key_blocks, block_k)
        keys = pl.ds(load_start, block_k)
        bias = None if gate_bias_ref is None else gate_bias_ref[keys] * LOG2_E
        k = k_ref[keys, :]
        if needs_mask:
            scores, visible, _ = _tile_scores(q, k, bias, row_start, mask_start, masking)
        else:  # below the diagonal and inside the sequence: nothing to mask
            scores = _unmasked_scores(q, k, bias, row_start, load_start, masking)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        rescale = jnp.exp2(row_max - new_max)
        probs = jnp.exp2(scores - new_max[:, None])
        if needs_mask:
            probs = jnp.where(visible, probs, 0.0)
        row_sum = rescale * row_sum + jnp.sum(probs, axis=1)
        v = v_ref[keys, :]
        acc = rescale[:, None] * acc + dot(probs.astype(v.dtype), v)
        return acc, new_max, row_sum

    num_entries = jnp.clip(kv_block_cnt_ref[()], 0, kv_block_idx_ref.shape[0])
    num_unmasked = jnp.clip(kv_block_unmasked_ref[()], 0, num_entries)
    init = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    carry = lax.fori_loop(0, num_unmasked, functools.partial(body, needs_mask=False), init)
    acc, row_max, row_sum = lax.fori_loop(
        num_unmasked, num_entries, functools.partial(body, needs_mask=True), carry
    )
    sees_any = row_sum > 0
    safe_sum = jnp.where(sees_any, row_sum, 1.0)
    out_ref[...] = (acc / safe_sum[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(sees_any, (row_max + jnp.log2(safe_sum)) / LOG2_E, -jnp.inf)


def _unmasked_scores(q, k, bias, row_start, col_start, masking: Masking):
    """`_tile_scores` for a tile every key of which every row sees: f32 [block_q, block_k]."""
    scores = dot(q, k, trans_b=True) * masking.sm_scale
    if bias is None:
        return scores
    rows = row_start + jnp.arange(q.shape[0])[:, None]
    cols = col_start + jnp.arange(k.shape[0])[None, :]
    return scores + jnp.where(rows - cols >= masking.band, bias[None, :], 0.0)


def unmasked_prefix(kv_block_idx, kv_block_cnt, *, block_q: int, block_k: int, num_tokens: int):
    """Entries at the head of each list whose key blocks every row of the query block sees in
    full (below the diagonal and inside the sequence): int32 [B, M, nq]. The forward kernel
    skips masking them. Only a prefix counts, so unordered traced lists stay correct."""
    entries = kv_block_idx.shape[-1]
    query_start = block_q * jnp.arange(kv_block_idx.shape[2])[:, None]
    key_end = (kv_block_idx + 1) * block_k  # one past the last key of the block
    inside = (kv_block_idx >= 0) & (key_end <= jnp.minimum(query_start + 1, num_tokens))
    inside &= jnp.arange(entries) < kv_block_cnt[..., None]
    return jnp.sum(jnp.cumprod(inside, axis=-1), axis=-1).astype(jnp.int32)


def dq_kernel(
    q_ref,  # [block_q, H]
    k_ref,  # [Tp, H]
    v_ref,  # [Tp, H]
    kv_block_idx_ref,  # [nk] int32
    kv_block_cnt_ref,  # [] int32
    gate_bias_ref,  # [Tp] f32 or None
    d_out_ref,  # [block_q, H]
    lse_ref,  # [block_q] f32
    delta_ref,  # [block_q] f32: rowsum(out * d_out) - d_lse
    dq_ref,  # [block_q, H]
    *,
    masking: Masking,
    block_k: int,
):
    block_q, head_dim = q_ref.shape
    num_key_blocks = k_ref.shape[0] // block_k
    row_start = pl.program_id(2) * block_q
    q, d_out = q_ref[...], d_out_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(entry, dq):
        load_start, mask_start = _key_block(kv_block_idx_ref, entry, num_key_blocks, block_k)
        keys = pl.ds(load_start, block_k)
        bias = None if gate_bias_ref is None else gate_bias_ref[keys]
        k = k_ref[keys, :]
        scores, visible, _ = _tile_scores(q, k, bias, row_start, mask_start, masking)
        probs = jnp.where(visible, jnp.exp(scores - lse[:, None]), 0.0)
        d_probs = dot(d_out, v_ref[keys, :], trans_b=True)
        d_scores = probs * (d_probs - delta[:, None])
        return dq + dot(d_scores.astype(k.dtype), k)

    num_entries = jnp.clip(kv_block_cnt_ref[()], 0, kv_block_idx_ref.shape[0])
    dq = lax.fori_loop(0, num_entries, body, jnp.zeros((block_q, head_dim), jnp.float32))
    dq_ref[...] = (dq * masking.sm_scale).astype(dq_ref.dtype)


def dkv_kernel(
    q_ref,  # [G, Tp, H] the query heads of this KV head
    k_ref,  # [block_k, H]
    v_ref,  # [block_k, H]
    q_block_idx_ref,  # [L, nqp] int32: query blocks listing this key block (L = G or 1)
    q_block_cnt_ref,  # [L] int32
    gate_bias_ref,  # [block_k] f32 or None
    d_out_ref,  # [G, Tp, H]
    lse_ref,  # [G, Tp] f32
    delta_ref,  # [G, Tp] f32
    dk_ref,  # [block_k, H]
    dv_ref,  # [block_k, H]
    *d_gate_bias_ref,  # optional [block_k] f32
    masking: Masking,
    block_q: int,
):
    group = q_ref.shape[0]
    block_k, head_dim = k_ref.shape
    lists_per_query_head = q_block_idx_ref.shape[0] == group
    col_start = pl.program_id(2) * block_k
    k, v = k_ref[...], v_ref[...]
    bias = None if gate_bias_ref is None else gate_bias_ref[...]

    def head_body(head, carry):
        list_row = head if lists_per_query_head else 0

        def block_body(entry, carry):
            dk, dv, d_bias = carry
            row_start = q_block_idx_ref[list_row, entry] * block_q
            rows = pl.ds(row_start, block_q)
            q = q_ref[head, rows, :]
            d_out = d_out_ref[head, rows, :]
            scores, visible, outside_band = _tile_scores(q, k, bias, row_start, col_start, masking)
            probs = jnp.where(visible, jnp.exp(scores - lse_ref[head, rows][:, None]), 0.0)
            dv = dv + dot(probs.astype(d_out.dtype), d_out, trans_a=True)
            d_probs = dot(d_out, v, trans_b=True)
            d_scores = probs * (d_probs - delta_ref[head, rows][:, None])
            dk = dk + dot(d_scores.astype(q.dtype), q, trans_a=True)
            if outside_band is not None:
                d_bias = d_bias + jnp.sum(jnp.where(outside_band, d_scores, 0.0), axis=0)
            return dk, dv, d_bias

        return lax.fori_loop(0, q_block_cnt_ref[list_row], block_body, carry)

    init = (
        jnp.zeros((block_k, head_dim), jnp.float32),
        jnp.zeros((block_k, head_dim), jnp.float32),
        jnp.zeros((block_k,), jnp.float32),
    )
    dk, dv, d_bias = lax.fori_loop(0, group, head_body, init)
    dk_ref[...] = (dk * masking.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    if d_gate_bias_ref:
        d_gate_bias_ref[0][...] = d_bias


def _list_head(lists_per_query_head: bool, group: int):
    """Maps a query head to the row of the block lists it reads."""
    return (lambda n: n) if lists_per_query_head else (lambda n: lax.div(n, group))


def _query_block_specs(q, k, kv_block_idx, gate_bias, block_q: int):
    """BlockSpecs of a (batch, query head, query block) grid: the query tile, the whole keys of
    its KV head, its block list and count, its KV head's gate bias, and a per-row tile."""
    _, num_heads, padded, head_dim = q.shape
    group = num_heads // k.shape[1]
    list_head = _list_head(kv_block_idx.shape[1] == num_heads, group)
    bias_spec = None
    if gate_bias is not None:
        bias_spec = pl.BlockSpec((None, None, padded), lambda b, n, i: (b, lax.div(n, group), 0))
    return dict(
        q_tile=pl.BlockSpec((None, None, block_q, head_dim), lambda b, n, i: (b, n, i, 0)),
        kv_head=pl.BlockSpec(
            (None, None, padded, head_dim), lambda b, n, i: (b, lax.div(n, group), 0, 0)
        ),
        block_list=pl.BlockSpec(
            (None, None, None, kv_block_idx.shape[-1]), lambda b, n, i: (b, list_head(n), i, 0)
        ),
        block_count=pl.BlockSpec((None, None, None), lambda b, n, i: (b, list_head(n), i)),
        gate_bias=bias_spec,
        row_tile=pl.BlockSpec((None, None, block_q), lambda b, n, i: (b, n, i)),
    )


def forward(q, k, v, kv_block_idx, kv_block_cnt, gate_bias, *, masking, block_sizes, interpret):
    """Launches the forward kernel on padded inputs.

    q [B, N, Tp, H], k, v [B, K, Tp, H], kv_block_idx [B, M, Tp / block_q, nk], kv_block_cnt
    [B, M, Tp / block_q], gate_bias f32 [B, K, Tp] or None. Returns out [B, N, Tp, H] (q.dtype)
    and lse f32 [B, N, Tp].
    """
    batch, num_heads, padded, _ = q.shape
    block_q = block_sizes.block_q
    specs = _query_block_specs(q, k, kv_block_idx, gate_bias, block_q)
    kv_block_unmasked = unmasked_prefix(
        kv_block_idx,
        kv_block_cnt,
        block_q=block_q,
        block_k=block_sizes.block_k,
        num_tokens=masking.num_tokens,
    )
    return pl.pallas_call(
        functools.partial(forward_kernel, masking=masking, block_k=block_sizes.block_k),
        grid=(batch, num_heads, padded // block_q),
        in_specs=[
            specs["q_tile"],
            specs["kv_head"],
            specs["kv_head"],
            specs["block_list"],
            specs["block_count"],
            specs["block_count"],
            specs["gate_bias"],
        ],
        out_specs=[specs["q_tile"], specs["row_tile"]],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, padded), jnp.float32),
        ],
        compiler_params=triton_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="block_sparse_attention_fwd",
    )(q, k, v, kv_block_idx, kv_block_cnt, kv_block_unmasked, gate_bias)


def backward_dq(
    q,
    k,
    v,
    kv_block_idx,
    kv_block_cnt,
    gate_bias,
    d_out,
    lse,
    delta,
    *,
    masking,
    block_sizes,
    interpret,
):
    """dQ [B, N, Tp, H] (q.dtype) over the forward's block lists; shapes as in `forward`, d_out
    like q, lse and delta f32 [B, N, Tp]."""
    batch, num_heads, padded, _ = q.shape
    block_q = block_sizes.block_q
    specs = _query_block_specs(q, k, kv_block_idx, gate_bias, block_q)
    return pl.pallas_call(
        functools.partial(dq_kernel, masking=masking, block_k=block_sizes.block_k),
        grid=(batch, num_heads, padded // block_q),
        in_specs=[
            specs["q_tile"],
            specs["kv_head"],
            specs["kv_head"],
            specs["block_list"],
            specs["block_count"],
            specs["gate_bias"],
            specs["q_tile"],
            specs["row_tile"],
            specs["row_tile"],
        ],
        out_specs=specs["q_tile"],
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="block_sparse_attention_dq",
    )(q, k, v, kv_block_idx, kv_block_cnt, gate_bias, d_out, lse, delta)


def backward_dkv(
    q,
    k,
    v,
    q_block_idx,
    q_block_cnt,
    gate_bias,
    d_out,
    lse,
    delta,
    *,
    masking,
    block_sizes,
    interpret,
):
    """dK, dV [B, K, Tp, H] (k.dtype) and, with a gate bias, d gate_bias f32 [B, K, Tp].

    q_block_idx int32 [B, M, Tp / block_k, Tp / block_q] lists, per key block, the query blocks
    whose lists hold it (ascending, q_block_cnt [B, M, Tp / block_k] valid); M is N or K.
    """
    batch, num_heads, padded, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    block_q, block_k = block_sizes.block_q, block_sizes.block_k
    list_rows = group if q_block_idx.shape[1] == num_heads else 1
    query_heads = pl.BlockSpec((None, group, padded, head_dim), lambda b, h, j: (b, h, 0, 0))
    query_rows = pl.BlockSpec((None, group, padded), lambda b, h, j: (b, h, 0))
    k_tile = pl.BlockSpec((None, None, block_k, head_dim), lambda b, h, j: (b, h, j, 0))
    key_tile = pl.BlockSpec((None, None, block_k), lambda b, h, j: (b, h, j))
    out_specs = [k_tile, k_tile]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if gate_bias is not None:
        out_specs.append(key_tile)
        out_shape.append(jax.ShapeDtypeStruct(gate_bias.shape, jnp.float32))
    return pl.pallas_call(
        functools.partial(dkv_kernel, masking=masking, block_q=block_q),
        grid=(batch, num_kv_heads, padded // block_k),
        in_specs=[
            query_heads,
            k_tile,
            k_tile,
            pl.BlockSpec(
                (None, list_rows, None, q_block_idx.shape[-1]), lambda b, h, j: (b, h, j, 0)
            ),
            pl.BlockSpec((None, list_rows, None), lambda b, h, j: (b, h, j)),
            None if gate_bias is None else key_tile,
            query_heads,
            query_rows,
            query_rows,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="block_sparse_attention_dkv",
    )(q, k, v, q_block_idx, q_block_cnt, gate_bias, d_out, lse, delta)
