"""KeyRerotation as NVIDIA kvpress 0.5.5's KeyRerotationPress implements it: an inner scoring
policy compresses the prompt, then each head's kept keys are rotated (RoPE) to the positions
they would have had with nothing evicted between them: its i-th kept token (in position order)
is moved to position i. Values and the tokens' recorded positions are unchanged, and decode
tokens are written at their own positions, so a query after the prompt sees the kept context
as one run at its start (the SinkCache and FINCH use of rerotation).

Keys are stored post-RoPE, so the rotation by (i - position) is exact up to float rounding.
Int8 storage is refused (its keys are quantized after rotation). Paper (docs/references.md):
FINCH, "Prompt-guided Key-Value Cache Compression for Large Language Models" (TACL 2024).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv.cache import KVState
from jaxkv.cache.state import PagePool
from jaxkv.models import layers
from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, InnerScoredCompression
from jaxkv.policies.structure import scoring_compression
from jaxkv.step.parts import PrefillObservations


def page_first_slots(page_table: jax.Array, num_pages: int, page_size: int) -> jax.Array:
    """int32 [P]: the head slot of the first token of each page `page_table` (int32 [..., M])
    names, -1 for the pool's other pages (other rows' in a shared pool, or free)."""
    first = jnp.arange(page_table.shape[-1], dtype=jnp.int32) * page_size
    first = jnp.broadcast_to(first, page_table.shape)
    index = jnp.where(page_table >= 0, page_table, num_pages)
    return (
        jnp.full((num_pages,), -1, jnp.int32)
        .at[index.reshape(-1)]
        .set(first.reshape(-1), mode="drop")
    )


def rerotate_pool(pool: PagePool, page_table: jax.Array, config) -> PagePool:
    """`pool` with each held key rotated from its position to its head slot (which, after
    `compact`, is its rank in position order among the head's kept tokens)."""
    if pool.k_scales is not None or pool.int8 is not None:
        raise ValueError("policy 'key_rerotation' cannot rotate int8 keys (int8 storage is on)")
    first = page_first_slots(page_table, pool.num_pages, pool.page_size)[:, None]
    slots = first + jnp.arange(pool.page_size, dtype=jnp.int32)
    held = (pool.token_positions >= 0) & (first >= 0)  # [P, p]: this state's held tokens
    delta = jnp.where(held, slots - pool.token_positions, 0)
    cos, sin = layers.rope_cos_sin(config, delta)  # [P, p, H]
    keys = layers.apply_rope(pool.k_pages[:, None], cos, sin)[:, 0]
    rotated = {"k_pages": keys.astype(pool.k_pages.dtype)}
    if pool.key_min is not None:  # Quest's page bounds, of the rotated keys
        f32 = keys.astype(jnp.float32)
        named = first >= 0
        low = jnp.min(jnp.where(held[..., None], f32, jnp.inf), axis=1)
        high = jnp.max(jnp.where(held[..., None], f32, -jnp.inf), axis=1)
        rotated["key_min"] = jnp.where(named, low, pool.key_min)
        rotated["key_max"] = jnp.where(named, high, pool.key_max)
    return dataclasses.replace(pool, **rotated)


@dataclasses.dataclass(frozen=True)
class RerotatedCompression(InnerScoredCompression):
    """An inner `ScoredCompression`, then every kept key rotated to its rank's position."""

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        kv = self.inner.compress(kv, obs, model)
        return dataclasses.replace(kv, pool=rerotate_pool(kv.pool, kv.page_table, model.config))


@base.register
@dataclasses.dataclass(frozen=True)
class KeyRerotation(base.Policy):
    """KeyRerotationPress: an inner scoring policy's compression with each head's kept keys
    rotated to consecutive positions from 0 (module docstring).

    Attributes:
      budget: tokens kept per head: a ratio of the prompt or a token count.
      inner: the scoring eviction policy (or its name; Knorm by default).
    """

    name: ClassVar[str] = "key_rerotation"
    request_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    budget: base.Budget | float | int | None = None
    inner: EvictionPolicy | str = "knorm"

    def _check(self) -> None:
        super()._check()
        if self.budget is not None:
            object.__setattr__(self, "budget", base.Budget.parse(self.budget))

    def _parts(self) -> dict:
        compression = scoring_compression(self.name, self.inner)
        protected = compression.sinks + compression.protected_recent
        return {
            "prompt_compression": RerotatedCompression(compression),
            "budget_rule": base.PromptBudget(self.name, self.budget, protected),
        }
