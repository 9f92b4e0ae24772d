"""The ragged paged KV state, its page allocator, and the writes into it."""

from jaxkv.cache.allocator import PageAllocator, allocate, release
from jaxkv.cache.repack import decode_geometry, int8_decode_geometry, repack
from jaxkv.cache.ring import attend_and_write_with_ring, check_ring_policy
from jaxkv.cache.state import KVState, LocalRing, PagePool, PoolExhaustedError
from jaxkv.cache.writes import attend_and_write, write_tokens

__all__ = [
    "KVState",
    "LocalRing",
    "PageAllocator",
    "PagePool",
    "PoolExhaustedError",
    "allocate",
    "attend_and_write",
    "attend_and_write_with_ring",
    "check_ring_policy",
    "decode_geometry",
    "int8_decode_geometry",
    "repack",
    "release",
    "write_tokens",
]
