"""The cache-policy protocol: small frozen strategy objects, static under jit.

A policy may implement any hook; the defaults keep everything:
  admit(...)      at write time, which new tokens each (sequence, KV head) stores;
  compress(...)   after prefill, which cached tokens to keep (eviction);
  on_decode(...)  after each decode step.
Values that vary per request (budgets, thresholds) are passed as arrays, never as fields that
would force a recompile.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: makes `cls` available as `policies.get(cls.name, ...)`."""
    if cls.name in _REGISTRY:
        raise ValueError(f"policy name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def get(name: str, **kwargs) -> Policy:
    """Builds a registered policy by name, e.g. `get("full")`."""
    if name not in _REGISTRY:
        raise KeyError(f"policy={name!r}: registered policies are {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


def registered() -> list[str]:
    return sorted(_REGISTRY)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base class of cache policies; every hook defaults to keeping everything."""

    name: ClassVar[str] = "base"
    # Whether every token's received attention mass is accumulated into its score (H2O).
    accumulates_attention: ClassVar[bool] = False

    def admit(
        self, *, layer: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> jax.Array | None:
        """bool [B, K, C] tokens to store, or None to store every valid token.

        layer: int32 [] index of the layer; k, v [B, K, C, H]; positions [B, C] (-1 = padding).
        """
        del layer, k, v, positions
        return None

    def compress(self, kv):
        """The state after prefill, compressed; identity by default."""
        return kv

    def on_decode(self, kv):
        """The state after a decode step; identity by default."""
        return kv


@register
@dataclasses.dataclass(frozen=True)
class FullCache(Policy):
    """Keep every token: the uncompressed baseline."""

    name: ClassVar[str] = "full"
