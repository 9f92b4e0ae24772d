"""Public block-sparse causal prefill attention op: validation, padding and the custom VJP.

The sequence is padded to a multiple of both tiles here (keys past the real length are masked in
the kernels), so any T works; the copy is skipped when T already is a multiple. The backward pass
needs, per key block, the query blocks whose lists hold it: built in jnp from a dense
[nq, nkb] block mask per head, which is small next to the attention itself.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.pallas_kernels.block_sparse import kernel
from jaxkv.pallas_kernels.block_sparse.block_lists import block_lists_from_mask
from jaxkv.pallas_kernels.block_sparse.kernel import BlockSizes, Masking
from jaxkv.pallas_kernels.common import check_tile, round_up


def block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_block_idx: jax.Array,
    kv_block_cnt: jax.Array,
    *,
    sm_scale: float,
    gate_bias: jax.Array | None = None,
    band: int | None = None,
    block_q: int,
    block_k: int,
    return_lse: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal attention over the listed (query block, key block) pairs; differentiable.

    Args:
      q: [B, N, T, H]; k, v: [B, K, T, H], same dtype; query head n reads KV head n // (N // K).
      kv_block_idx: int32 [B, M, nq, nk], M = N or K, nq = cdiv(T, block_q): per query block the
        key blocks (of `block_k` tokens) to visit, valid entries first, ascending, no repeats.
      kv_block_cnt: int32 [B, M, nq] valid entries per list (0 to nk).
      sm_scale: multiplies q . k.
      gate_bias: f32 [B, K, T] added to the score of key j for queries i with i - j >= band
        (WG-KV: log of the clamped gate); needs `band`. Differentiable.
      band: int >= 0, width of the local band the bias spares.
      block_q, block_k: tiles and list granularity, powers of two >= 16.
      return_lse: also return the logsumexp of each row (differentiable).
      num_warps, num_stages: Triton launch parameters.
      interpret: run the Pallas interpreter (CPU tests) instead of Triton.
    Returns:
      out [B, N, T, H] in q's dtype (0 for a row that sees no key) and, with `return_lse`,
      lse f32 [B, N, T] (-inf for such a row).
    """
    block_sizes = BlockSizes(block_q, block_k, num_warps, num_stages)
    _check_inputs(q, k, v, kv_block_idx, kv_block_cnt, block_sizes)
    _check_gate(q, k, gate_bias, band)
    static = _Static(Masking(q.shape[2], float(sm_scale), band), block_sizes, interpret)
    if gate_bias is not None:
        gate_bias = gate_bias.astype(jnp.float32)
    out, lse = _attention(q, k, v, kv_block_idx, kv_block_cnt, gate_bias, static)
    return (out, lse) if return_lse else out


def _check_inputs(q, k, v, kv_block_idx, kv_block_cnt, block_sizes: BlockSizes) -> None:
    if q.ndim != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a float [B, N, T, H] array, got {q.dtype}{list(q.shape)}")
    batch, num_heads, num_tokens, head_dim = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or x.dtype != q.dtype:
            raise ValueError(f"{name} must be {q.dtype}[B, K, T, H], got {x.dtype}{list(x.shape)}")
        if (x.shape[0], *x.shape[2:]) != (batch, num_tokens, head_dim) or x.shape != k.shape:
            raise ValueError(
                f"{name} shape {list(x.shape)} does not match q [B={batch}, N, T={num_tokens}, "
                f"H={head_dim}] and k {list(k.shape)}"
            )
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"q has N={num_heads} heads, not a multiple of k's K={num_kv_heads}")
    check_tile("head_dim", head_dim, 16)
    num_query_blocks = -(-num_tokens // block_sizes.block_q)
    if (
        kv_block_idx.ndim != 4
        or kv_block_idx.dtype != jnp.int32
        or kv_block_idx.shape[0] != batch
        or kv_block_idx.shape[1] not in (num_heads, num_kv_heads)
        or kv_block_idx.shape[2] != num_query_blocks
    ):
        raise ValueError(
            f"kv_block_idx must be int32 [B={batch}, N={num_heads} or K={num_kv_heads}, "
            f"nq={num_query_blocks}, nk], got {kv_block_idx.dtype}{list(kv_block_idx.shape)}"
        )
    if kv_block_cnt.shape != kv_block_idx.shape[:3] or kv_block_cnt.dtype != jnp.int32:
        raise ValueError(
            f"kv_block_cnt must be int32{list(kv_block_idx.shape[:3])}, got "
            f"{kv_block_cnt.dtype}{list(kv_block_cnt.shape)}"
        )
    _check_list_values(kv_block_idx, kv_block_cnt, -(-num_tokens // block_sizes.block_k))


def _check_list_values(kv_block_idx, kv_block_cnt, num_key_blocks: int) -> None:
    """Checks concrete block lists (traced ones are used as given; see the kernel's clamping)."""
    try:
        idx, cnt = np.asarray(kv_block_idx), np.asarray(kv_block_cnt)
    except jax.errors.TracerArrayConversionError:
        return
    if cnt.size and (cnt.min() < 0 or cnt.max() > idx.shape[-1]):
        raise ValueError(f"kv_block_cnt must lie in [0, {idx.shape[-1]}]")
    valid = np.arange(idx.shape[-1]) < cnt[..., None]
    if np.any(valid & ((idx < 0) | (idx >= num_key_blocks))):
        raise ValueError(f"kv_block_idx: valid entries must lie in [0, {num_key_blocks})")
    if np.any(valid[..., 1:] & (np.diff(idx, axis=-1) <= 0)):
        raise ValueError("kv_block_idx: valid entries must be strictly ascending")


def _check_gate(q, k, gate_bias, band) -> None:
    if gate_bias is None:
        if band is not None:
            raise ValueError("band is only used with gate_bias")
        return
    expected = (k.shape[0], k.shape[1], q.shape[2])
    if gate_bias.shape != expected or not jnp.issubdtype(gate_bias.dtype, jnp.floating):
        raise ValueError(
            f"gate_bias must be float{list(expected)} [B, K, T], got "
            f"{gate_bias.dtype}{list(gate_bias.shape)}"
        )
    if not isinstance(band, int) or band < 0:
        raise ValueError(f"band={band!r} must be an int >= 0 when gate_bias is given")


@dataclasses.dataclass(frozen=True)
class _Static:
    masking: Masking
    block_sizes: BlockSizes
    interpret: bool


def _pad_axis(x, axis: int, size: int, value=0):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _padded(q, k, v, kv_block_idx, kv_block_cnt, gate_bias, block_sizes: BlockSizes):
    """Pads the token axis to a multiple of both tiles, and the lists to the padded query blocks
    (extra query blocks list nothing)."""
    tokens = round_up(q.shape[2], max(block_sizes.block_q, block_sizes.block_k))
    query_blocks = tokens // block_sizes.block_q
    return (
        _pad_axis(q, 2, tokens),
        _pad_axis(k, 2, tokens),
        _pad_axis(v, 2, tokens),
        _pad_axis(kv_block_idx, 2, query_blocks),
        _pad_axis(kv_block_cnt, 2, query_blocks),
        _pad_axis(gate_bias, 2, tokens),
    )


def _forward(q, k, v, kv_block_idx, kv_block_cnt, gate_bias, static: _Static):
    """out [B, N, T, H], lse [B, N, T] and the padded lse the backward pass reads."""
    num_tokens = q.shape[2]
    out, lse = kernel.forward(
        *_padded(q, k, v, kv_block_idx, kv_block_cnt, gate_bias, static.block_sizes),
        masking=static.masking,
        block_sizes=static.block_sizes,
        interpret=static.interpret,
    )
    return out[:, :, :num_tokens], lse[:, :, :num_tokens], lse


def transpose_block_lists(kv_block_idx, kv_block_cnt, num_key_blocks: int):
    """Per key block, the query blocks whose lists hold it.

    kv_block_idx [B, M, nq, nk], kv_block_cnt [B, M, nq] -> q_block_idx int32 [B, M, nkb, nq]
    (ascending, valid first) and q_block_cnt int32 [B, M, nkb]. Out-of-range entries are dropped.
    """
    entries = kv_block_idx.shape[-1]
    valid = (jnp.arange(entries) < kv_block_cnt[..., None]) & (kv_block_idx >= 0)
    target = jnp.where(valid & (kv_block_idx < num_key_blocks), kv_block_idx, num_key_blocks)
    listed = jnp.zeros((*kv_block_idx.shape[:-1], num_key_blocks + 1), bool)
    listed = jnp.put_along_axis(listed, target, True, axis=-1, inplace=False)
    return block_lists_from_mask(jnp.swapaxes(listed[..., :num_key_blocks], -1, -2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention_vjp(q, k, v, kv_block_idx, kv_block_cnt, gate_bias, static: _Static):
    out, lse, _ = _forward(q, k, v, kv_block_idx, kv_block_cnt, gate_bias, static)
    return out, lse


def _attention_fwd(q, k, v, kv_block_idx, kv_block_cnt, gate_bias, static: _Static):
    out, lse, padded_lse = _forward(q, k, v, kv_block_idx, kv_block_cnt, gate_bias, static)
    return (out, lse), (q, k, v, kv_block_idx, kv_block_cnt, gate_bias, out, padded_lse)


def _attention_bwd(static: _Static, residuals, cotangents):
    q, k, v, kv_block_idx, kv_block_cnt, gate_bias, out, padded_lse = residuals
    d_out, d_lse = cotangents
    num_tokens = q.shape[2]
    block_sizes = static.block_sizes
    # d lse_i / d s_ij = p_ij, so the lse cotangent enters as a shift of delta.
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1) - d_lse
    q, k, v, kv_block_idx, kv_block_cnt, gate_bias = _padded(
        q, k, v, kv_block_idx, kv_block_cnt, gate_bias, block_sizes
    )
    tokens = q.shape[2]
    d_out = _pad_axis(d_out.astype(q.dtype), 2, tokens)
    delta = _pad_axis(delta, 2, tokens)
    common = dict(masking=static.masking, block_sizes=block_sizes, interpret=static.interpret)
    dq = kernel.backward_dq(
        q, k, v, kv_block_idx, kv_block_cnt, gate_bias, d_out, padded_lse, delta, **common
    )
    q_block_idx, q_block_cnt = transpose_block_lists(
        kv_block_idx, kv_block_cnt, tokens // block_sizes.block_k
    )
    dk, dv, *d_gate_bias = kernel.backward_dkv(
        q, k, v, q_block_idx, q_block_cnt, gate_bias, d_out, padded_lse, delta, **common
    )
    d_gate_bias = d_gate_bias[0][:, :, :num_tokens] if d_gate_bias else None
    return (
        dq[:, :, :num_tokens],
        dk[:, :, :num_tokens],
        dv[:, :, :num_tokens],
        None,
        None,
        d_gate_bias,
    )


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)
_attention = jax.jit(_attention_vjp, static_argnums=6)
