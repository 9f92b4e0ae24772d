"""jaxkv: KV-cache compression for long-context LLM inference on a ragged paged cache."""

from jaxkv import policies
from jaxkv.cache import CacheConfig, KVState, PoolExhaustedError, Storage
from jaxkv.generation import GenerateOutput, compress_prompt, generate
from jaxkv.sampling import Sampler

__all__ = [
    "CacheConfig",
    "GenerateOutput",
    "KVState",
    "PoolExhaustedError",
    "Sampler",
    "Storage",
    "compress_prompt",
    "generate",
    "policies",
]
