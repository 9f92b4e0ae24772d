"""jaxkv: KV-cache compression for long-context LLM inference on a ragged paged cache."""

from jaxkv import policies
from jaxkv.cache import KVState, PoolExhaustedError
from jaxkv.generation import GenerateOutput, compress_prompt, generate
from jaxkv.sampling import Sampler

__all__ = [
    "GenerateOutput",
    "KVState",
    "PoolExhaustedError",
    "Sampler",
    "compress_prompt",
    "generate",
    "policies",
]
