"""The ragged paged KV state, its page allocator, and the writes into it (storage only: the
attention that reads it lives in `jaxkv.attention`, the step that reads then writes it in
`jaxkv.step.layer`)."""

from jaxkv.cache.allocator import PageAllocator, allocate, release
from jaxkv.cache.config import CacheConfig, Storage
from jaxkv.cache.repack import (
    decode_geometry,
    int8_decode_geometry,
    keeps_prefill_pool,
    repack,
    retable,
)
from jaxkv.cache.ring import promote_and_push
from jaxkv.cache.state import Int8Tier, KVState, LocalRing, PagePool, PoolExhaustedError
from jaxkv.cache.writes import accumulate_cached_mass, write_tokens

__all__ = [
    "CacheConfig",
    "Int8Tier",
    "KVState",
    "LocalRing",
    "PageAllocator",
    "PagePool",
    "PoolExhaustedError",
    "Storage",
    "accumulate_cached_mass",
    "allocate",
    "decode_geometry",
    "int8_decode_geometry",
    "keeps_prefill_pool",
    "promote_and_push",
    "repack",
    "retable",
    "release",
    "write_tokens",
]
