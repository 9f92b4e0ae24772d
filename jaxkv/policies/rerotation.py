"""KeyRerotation as NVIDIA kvpress 0.5.5 runs KeyRerotationPress: an inner scoring policy
compresses the prompt, then each head's kept keys are rotated (RoPE) to consecutive positions.
kvpress rotates a head's kept keys to positions 0, 1, ... and its pipeline reads on from
position n, layer 0's kept count (`cache.get_seq_length()`); jaxkv reads on from the prompt's
length T, so it rotates the i-th kept key (in position order) of every head to T - n + i.
Attention depends on positions only through their differences, so every later query sees the
kept keys at kvpress's distances; with as many kept in every head (FINCH, a uniform budget)
they are the run of tokens just before the next. Values and the tokens' recorded positions are
unchanged (the SinkCache and FINCH use of rerotation).

Keys are stored post-RoPE, so the rotation by (target - position) is exact up to float
rounding. Int8 storage starts after the compression (`start_int8`), so it quantizes the
rotated keys; a pool already holding int8 tokens is refused. Paper (docs/references.md):
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


def per_page(page_table: jax.Array, values: jax.Array, num_pages: int) -> jax.Array:
    """int32 [P]: for each page `page_table` (int32 [..., M]) names, its entry of `values`
    (int32, broadcast to the table's shape); -1 for the pool's other pages (other rows' in a
    shared pool, or free)."""
    values = jnp.broadcast_to(values, page_table.shape)
    index = jnp.where(page_table >= 0, page_table, num_pages)
    return (
        jnp.full((num_pages,), -1, jnp.int32)
        .at[index.reshape(-1)]
        .set(values.reshape(-1), mode="drop")
    )


def rerotate_pool(
    pool: PagePool, page_table: jax.Array, lengths: jax.Array, prompt_lengths: jax.Array, config
) -> PagePool:
    """`pool` with each held key rotated from its position to T - n + s: s its head slot
    (after `compact`, the token's rank in position order among the head's kept), T its row's
    prompt length, n its row's layer-0 kept count (the most of its heads).

    page_table: int32 [L, B, K, M]; lengths: int32 [L, B, K] kept per head; prompt_lengths:
    int32 [B]."""
    if pool.k_scales is not None or pool.int8 is not None:
        raise ValueError("policy 'key_rerotation' cannot rotate int8 keys (int8 storage is on)")
    first_slot = jnp.arange(page_table.shape[-1], dtype=jnp.int32) * pool.page_size
    offset = prompt_lengths - jnp.max(lengths[0], axis=-1)  # [B]: T - n
    named = per_page(page_table, jnp.zeros((), jnp.int32), pool.num_pages)[:, None] >= 0
    first = per_page(page_table, first_slot + offset[None, :, None, None], pool.num_pages)
    # A head holds its first `lengths` slots (a page's later slots may keep stale tokens).
    count = per_page(page_table, lengths[..., None] - first_slot, pool.num_pages)
    slot = jnp.arange(pool.page_size, dtype=jnp.int32)
    held = named & (slot < count[:, None])  # [P, p]: this state's held tokens
    targets = first[:, None] + slot
    delta = jnp.where(held, targets - pool.token_positions, 0)
    cos, sin = layers.rope_cos_sin(config, delta)  # [P, p, H]
    keys = layers.apply_rope(pool.k_pages[:, None], cos, sin)[:, 0]
    rotated = {"k_pages": keys.astype(pool.k_pages.dtype)}
    if pool.key_min is not None:  # Quest's page bounds, of the rotated keys
        f32 = keys.astype(jnp.float32)
        low = jnp.min(jnp.where(held[..., None], f32, jnp.inf), axis=1)
        high = jnp.max(jnp.where(held[..., None], f32, -jnp.inf), axis=1)
        rotated["key_min"] = jnp.where(named, low, pool.key_min)
        rotated["key_max"] = jnp.where(named, high, pool.key_max)
    return dataclasses.replace(pool, **rotated)


@dataclasses.dataclass(frozen=True)
class RerotatedCompression(InnerScoredCompression):
    """An inner `ScoredCompression`, then every head's kept keys rotated to the consecutive
    positions that end just before the next token's."""

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        kv = self.inner.compress(kv, obs, model)
        pool = rerotate_pool(kv.pool, kv.page_table, kv.lengths, obs.prompt_lengths, model.config)
        return dataclasses.replace(kv, pool=pool)


@base.register
@dataclasses.dataclass(frozen=True)
class KeyRerotation(base.Policy):
    """KeyRerotationPress: an inner scoring policy's compression with each head's kept keys
    rotated to consecutive positions, the last just before the next token's (module
    docstring).

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
