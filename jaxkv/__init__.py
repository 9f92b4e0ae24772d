"""jaxkv: KV-cache compression for long-context LLM inference on a ragged paged cache."""

from jaxkv import policies
from jaxkv.cache import CacheConfig, KVState, PoolExhaustedError, Storage
from jaxkv.engine import Engine, TokenEvent
from jaxkv.generation import (
    AskOutput,
    GenerateOutput,
    Session,
    ask,
    compress_prompt,
    generate,
    generate_text,
)
from jaxkv.generation.budgets import prefill_at_budgets, prefill_each
from jaxkv.generation.decoding import decode
from jaxkv.generation.saved import load_session, save_session
from jaxkv.generation.session import extend, fork, prefill
from jaxkv.sampling import Sampler

__all__ = [
    "AskOutput",
    "CacheConfig",
    "Engine",
    "GenerateOutput",
    "KVState",
    "PoolExhaustedError",
    "Sampler",
    "Session",
    "Storage",
    "TokenEvent",
    "ask",
    "compress_prompt",
    "decode",
    "extend",
    "fork",
    "generate",
    "generate_text",
    "load_session",
    "policies",
    "prefill",
    "prefill_at_budgets",
    "prefill_each",
    "save_session",
]
