"""The ragged paged KV state, its page allocator, and the writes into it."""

from jaxkv.cache.allocator import PageAllocator, allocate, release
from jaxkv.cache.repack import decode_geometry, int8_decode_geometry, repack
from jaxkv.cache.state import KVState, PagePool, PoolExhaustedError
from jaxkv.cache.writes import attend_and_write, write_tokens

__all__ = [
    "KVState",
    "PageAllocator",
    "PagePool",
    "PoolExhaustedError",
    "allocate",
    "attend_and_write",
    "decode_geometry",
    "int8_decode_geometry",
    "repack",
    "release",
    "write_tokens",
]
