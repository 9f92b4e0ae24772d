"""The cache's geometry and storage, one request's choice, separate from the policy.

A policy decides which tokens the cache keeps; `CacheConfig` decides how it holds them: page
size, pool size, the dtype of keys and values, and whether older tokens move to an int8 tier.
Any policy runs with any storage (except that int8 storage does not select pages).
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxkv.cache.int8 import check_dtype

DEFAULT_PAGE_SIZE = 16
DEFAULT_FULL_PRECISION_WINDOW = 128


class Storage(enum.Enum):
    """How the cache stores tokens: all in the kv dtype, or mixed precision (each head's newest
    `full_precision_window` tokens in the kv dtype, older ones int8, see `jaxkv.cache.int8`)."""

    MODEL = "model"
    INT8 = "int8"


def check_count(name: str, value, minimum: int) -> int:
    """`value` as an int; ValueError naming `name` unless it is an integer >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """How a request's paged KV cache holds its tokens; validated at construction (ValueError).

    Attributes:
      page_size: tokens per page, a power of two.
      num_pages: pages of the pool (per device on a mesh); None: what the policy holds during
        prefill (a full cache: the whole request). Decode then uses a pool sized for what is
        held and will be held, at most num_pages.
      kv_dtype: a float dtype of keys and values (float32, bfloat16, float16); None: the
        model's. Stored as a `numpy.dtype`.
      storage: Storage.MODEL (every token in kv_dtype) or Storage.INT8 (mixed precision); the
        names "model" / "int8" are accepted and stored as the enum.
      full_precision_window: F >= 1, the newest tokens per head kept in kv_dtype under int8
        storage (a decode step's token is read from there).
      int8_pages: with int8 storage, the pages of the int8 tier's pool where one is kept beside
        the pool (`jaxkv.Engine`'s, per device); None: num_pages. A request sizes its own.
    """

    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None
    kv_dtype: jnp.dtype | None = None
    storage: Storage = Storage.MODEL
    full_precision_window: int = DEFAULT_FULL_PRECISION_WINDOW
    int8_pages: int | None = None

    def __post_init__(self):
        page_size = check_count("page_size", self.page_size, 1)
        if page_size & (page_size - 1):
            raise ValueError(f"page_size={page_size} must be a positive power of two")
        if self.num_pages is not None:
            check_count("num_pages", self.num_pages, 1)
        try:
            storage = Storage(self.storage)
        except ValueError:
            allowed = ", ".join(repr(s.value) for s in Storage)
            raise ValueError(f"storage={self.storage!r}: allowed are {allowed}") from None
        if self.int8_pages is not None:
            check_count("int8_pages", self.int8_pages, 1)
            if storage is not Storage.INT8:
                raise ValueError("int8_pages sizes an int8 tier: give it with storage='int8'")
        window = check_count("full_precision_window", self.full_precision_window, 1)
        object.__setattr__(self, "page_size", page_size)
        object.__setattr__(self, "storage", storage)
        object.__setattr__(self, "full_precision_window", window)
        if self.kv_dtype is not None:
            object.__setattr__(self, "kv_dtype", _float_dtype(self.kv_dtype))
            if storage is Storage.INT8:
                check_dtype(self.kv_dtype)

    @property
    def int8_pool_pages(self) -> int:
        """Pages of the int8 tier's pool kept beside the pool (`int8_pages`, by default
        `num_pages`); 0 without int8 storage."""
        if self.storage is not Storage.INT8:
            return 0
        return self.num_pages if self.int8_pages is None else self.int8_pages

    @property
    def int8_window(self) -> int | None:
        """F when older tokens are stored in int8, else None."""
        return self.full_precision_window if self.storage is Storage.INT8 else None

    def dtype_for(self, model_dtype: DTypeLike) -> jnp.dtype:
        """The dtype of the cache's keys and values for a model of `model_dtype`."""
        dtype = jnp.dtype(model_dtype) if self.kv_dtype is None else self.kv_dtype
        if self.storage is Storage.INT8:
            check_dtype(dtype)
        return dtype


def _float_dtype(kv_dtype: DTypeLike) -> jnp.dtype:
    try:
        dtype = jnp.dtype(kv_dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"kv_dtype={kv_dtype!r}: the cache stores keys and values in a float dtype "
            "(float32, bfloat16, float16); for an int8 cache use CacheConfig(storage='int8')"
        )
    return dtype
