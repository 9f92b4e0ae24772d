"""Pallas kernels (Triton on NVIDIA GPUs, Mosaic on TPUs; the interpreters on CPU for tests).

- `block_sparse_attention`: block-sparse causal prefill attention over per-query-block lists of
  key blocks, with an optional gate bias outside a local band and a Pallas backward pass.
- `paged_decode_attention`: ragged paged decode attention over a shared page pool, split-K,
  optional int8 pages and softmax statistics; a Triton kernel and a Mosaic one (`target=`).
- `causal_attention_tpu`: causal prefill attention on TPUs through jax's splash attention.

Each kernel folder holds kernel.py (kernels and launches), ops.py (the public op) and
reference.py (the plain-jnp oracle).
"""

from jaxkv.pallas_kernels.block_sparse.block_lists import (
    block_lists_from_mask,
    dense_causal_block_lists,
    sliding_window_block_lists,
    vertical_slash_block_lists,
)
from jaxkv.pallas_kernels.block_sparse.kernel import BlockSizes as BlockSparseBlockSizes
from jaxkv.pallas_kernels.block_sparse.ops import block_sparse_attention
from jaxkv.pallas_kernels.block_sparse.reference import block_sparse_attention_reference
from jaxkv.pallas_kernels.paged_decode.kernel import BlockSizes as PagedDecodeBlockSizes
from jaxkv.pallas_kernels.paged_decode.ops import DecodeStats, paged_decode_attention
from jaxkv.pallas_kernels.paged_decode.reference import paged_decode_attention_reference
from jaxkv.pallas_kernels.splash import SPLASH_MIN_TOKENS, causal_attention_tpu

__all__ = [
    "SPLASH_MIN_TOKENS",
    "BlockSparseBlockSizes",
    "DecodeStats",
    "PagedDecodeBlockSizes",
    "block_lists_from_mask",
    "block_sparse_attention",
    "block_sparse_attention_reference",
    "causal_attention_tpu",
    "dense_causal_block_lists",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "sliding_window_block_lists",
    "vertical_slash_block_lists",
]
