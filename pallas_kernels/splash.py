"""Causal prefill attention on TPUs through jax's splash attention kernel (Mosaic).

jaxkv's block-sparse prefill kernel is Triton's; on a TPU the dense causal case (a whole
sequence's attention, a prefill chunk's attention to itself) runs jax's own splash attention,
which skips the key blocks above the diagonal. Grouped queries: the G query heads of a KV head
are one multi-query call, mapped over batch and KV heads. The sequence is padded to a multiple
of 128 (the kernel's tile); padded keys come after every real query, so causality hides them,
and padded queries are dropped. The kernel takes no scale: the query is scaled first.

What splash does not cover stays jnp at the dispatch: WG-KV's gate bias outside the band and
block lists computed at run time (splash's masks are static).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from jaxkv.pallas_kernels.common import round_up

# The kernel's smallest tile (a TPU vector register's lanes), and the largest tile tried.
MIN_BLOCK = 128
MAX_BLOCK = 512
# Shorter sequences (a decode step's own token, short chunks) are better attended in jnp than
# padded to a tile: the dispatch sends only sequences of at least this many tokens here.
SPLASH_MIN_TOKENS = MIN_BLOCK


def causal_attention_tpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    sm_scale: float,
    return_lse: bool,
    interpret: bool = False,
):
    """Causal attention of q [B, N, T, H] over k, v [B, K, T, H] (query head n reads KV head
    n // (N // K)) through splash attention.

    Returns out [B, N, T, H] in q's dtype and, with `return_lse`, lse f32 [B, N, T]. Without it
    the call is differentiable (splash's own backward kernels); with it, not (splash has no
    derivative of its residuals).
    """
    b, n, t, h = q.shape
    dtype = q.dtype
    num_kv_heads = k.shape[1]
    group = n // num_kv_heads
    padded = round_up(t, MIN_BLOCK)
    pad = ((0, 0), (0, 0), (0, padded - t), (0, 0))
    q = jnp.pad((q.astype(jnp.float32) * sm_scale).astype(q.dtype), pad)
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    kernel = _multi_query_kernel(group, padded, return_lse, interpret)
    grouped = q.reshape(b, num_kv_heads, group, padded, h)
    result = jax.vmap(jax.vmap(kernel))(grouped, k, v)
    out = result[0] if return_lse else result
    out = out.reshape(b, n, padded, h)[:, :, :t].astype(dtype)
    if not return_lse:
        return out
    (lse,) = result[1]
    return out, lse.reshape(b, n, padded)[:, :, :t].astype(jnp.float32)


@functools.lru_cache(maxsize=64)
def _multi_query_kernel(group: int, tokens: int, return_lse: bool, interpret: bool):
    """Splash's multi-query kernel for `group` heads over `tokens` (a multiple of 128): q
    [G, T, H], k, v [T, H].

    The kernel holds its mask's block tables as arrays, and it is cached: they are built as
    concrete arrays even when the first call comes from inside a trace (a jit, the layer scan),
    or the cache would hand a later trace the first one's tracers.
    """
    block = max(b for b in (MAX_BLOCK, MAX_BLOCK // 2, MIN_BLOCK) if tokens % b == 0)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = masks.MultiHeadMask([masks.CausalMask((tokens, tokens)) for _ in range(group)])
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mqa(
            mask,
            head_shards=1,
            q_seq_shards=1,
            block_sizes=sizes,
            save_residuals=return_lse,
            interpret=interpret,
        )
