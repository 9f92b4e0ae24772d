"""jaxkv: KV-cache compression for long-context LLM inference on a ragged paged cache."""

from jaxkv import policies
from jaxkv.cache import KVState, PoolExhaustedError
from jaxkv.sampling import Sampler

# generate() builds on `models`, which itself builds on jaxkv's attention and cache: importing
# it lazily keeps `import models` and `import jaxkv` free of an import cycle.
_GENERATE_NAMES = ("GenerateOutput", "compress_prompt", "generate")


def __getattr__(name):
    if name in _GENERATE_NAMES:
        import importlib

        return getattr(importlib.import_module("jaxkv.generation"), name)
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")


__all__ = ["KVState", "PoolExhaustedError", "Sampler", "policies", *_GENERATE_NAMES]
