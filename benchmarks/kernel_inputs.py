"""The kernel benchmarks' shapes and inputs: the sweeps (`FULL`, Llama-3.1-8B attention shapes;
`QUICK`, sizes that run in the Pallas interpreter), paged decode inputs in randomly placed pages
(`decode_inputs`) and random block lists of a causal prefill (`prefill_lists`). Shared by
`jaxkv bench kernels` and its launch-parameter sweep, `kernel_tuning`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import pallas_kernels as pk


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Shapes and sizes of one benchmark run."""

    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    decode_tokens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    densities: tuple[float, ...]
    block_q: int
    block_k: int
    wgkv_window: int
    wgkv_admission: tuple[float, ...]
    copy_bytes: int
    max_kv_bytes: int  # decode configs whose pool would exceed this are skipped


FULL = Sweep(
    heads=32,
    kv_heads=8,
    head_dim=128,
    page_size=16,
    decode_tokens=(4096, 16384, 65536, 262144),
    decode_batches=(1, 8, 32),
    prefill_tokens=(8192, 16384, 32768, 65536, 131072),
    densities=(1.0, 0.5, 0.25, 0.1),
    block_q=128,
    block_k=64,
    wgkv_window=256,
    wgkv_admission=(0.05, 0.1, 0.2),
    copy_bytes=1 << 30,
    max_kv_bytes=16 << 30,
)
QUICK = Sweep(
    heads=4,
    kv_heads=2,
    head_dim=64,
    page_size=16,
    decode_tokens=(256,),
    decode_batches=(1, 2),
    prefill_tokens=(128,),
    densities=(1.0, 0.5, 0.25, 0.1),
    block_q=32,
    block_k=32,
    wgkv_window=16,
    wgkv_admission=(0.1, 0.3),
    copy_bytes=16 << 20,
    max_kv_bytes=1 << 30,
)


def decode_inputs(sweep: Sweep, batch: int, tokens: int, int8: bool, key):
    """Decode inputs for one shape: q [B, N, H], pages, page table, lengths, int8 scales."""
    pages_per_head = tokens // sweep.page_size
    num_pages = batch * sweep.kv_heads * pages_per_head
    keys = jax.random.split(key, 5)
    pool_shape = (num_pages, sweep.page_size, sweep.head_dim)
    if int8:
        k_pages, v_pages = (
            jax.random.randint(k, pool_shape, -127, 128, jnp.int8) for k in keys[:2]
        )
        scales = jax.random.uniform(keys[2], pool_shape[:2], jnp.float32, 0.01, 0.02)
        quant = {"k_scales": scales, "v_scales": scales}
    else:
        k_pages, v_pages = (jax.random.normal(k, pool_shape, jnp.bfloat16) for k in keys[:2])
        quant = {}
    table = jax.random.permutation(keys[3], num_pages).astype(jnp.int32)
    table = table.reshape(batch, sweep.kv_heads, pages_per_head)
    lengths = jnp.full((batch, sweep.kv_heads), tokens, jnp.int32)
    q = jax.random.normal(keys[4], (batch, sweep.heads, sweep.head_dim), jnp.bfloat16)
    return q, k_pages, v_pages, table, lengths, quant


def prefill_lists(sweep: Sweep, tokens: int, density: float, seed: int):
    """Lists per KV head keeping a random `density` of the causal blocks, diagonal kept."""
    rng = np.random.default_rng(seed)
    q_first = np.arange(0, tokens, sweep.block_q)
    q_last = np.minimum(q_first + sweep.block_q, tokens) - 1
    k_first = np.arange(0, tokens, sweep.block_k)
    causal = k_first[None, :] <= q_last[:, None]
    shape = (1, sweep.kv_heads, *causal.shape)
    listed = causal & (rng.random(shape) < density)
    listed[..., np.arange(len(q_first)), q_first // sweep.block_k] = True
    idx, cnt = pk.block_lists_from_mask(jnp.asarray(listed))
    return idx, cnt, int(listed.sum())
