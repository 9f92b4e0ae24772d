"""Merging as NVIDIA kvpress 0.5.5's MergingPress implements it: an inner scoring policy picks
the tokens each head keeps, and each evicted token's value is folded into the kept token whose
key is most cosine-similar, before the evicted tokens' pages are freed.

Per head: an evicted token merges when its best cosine similarity s reaches
`similarity_threshold` (and, with `merge_fraction` < 1, is among that share of the evicted
tokens by s); its weight is max(s, 0) x |v_e| / (|v_e| + |v_t| + 1e-6) (v_t: its target's
value). A kept token that receives merges holds (v + sum w v_e) / (1 + sum w). Keys are
unchanged (RoPE-safe). The similarities are an [evicted x kept] matrix per head, O(T^2) memory
per layer during the prompt's compression, as kvpress's. Int8 storage is refused. Inspired by
Token Merging (arXiv:2210.09461) and D2O (arXiv:2406.13035); docs/references.md.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv import attention as attention_ops
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact
from jaxkv.policies import base
from jaxkv.policies.eviction import (
    EvictionPolicy,
    InnerScoredCompression,
    scored_keep_mask,
)
from jaxkv.policies.structure import scoring_compression
from jaxkv.step.parts import PrefillObservations

_EPS = 1e-6  # kvpress's


def merge_weights(keys, values, keep, held, threshold: float, fraction: float):
    """(weight f32 [B, K, S] of each evicted slot's merge (0: none), its target slot int32
    [B, K, S]) for one layer's keys, values [B, K, S, H] and keep/held masks bool [B, K, S]."""
    unit = keys.astype(jnp.float32)
    unit = unit / jnp.maximum(jnp.linalg.norm(unit, axis=-1, keepdims=True), _EPS)
    similarity = jnp.einsum("bkeh,bksh->bkes", unit, unit, precision="highest")
    similarity = jnp.where((keep & held)[:, :, None, :], similarity, -jnp.inf)
    best, target = jnp.max(similarity, axis=-1), jnp.argmax(similarity, axis=-1)
    evicted = held & ~keep
    merges = evicted & (best >= threshold)
    if fraction < 1.0:
        candidates = jnp.where(evicted, jnp.where(merges, best, -jnp.inf), jnp.nan)
        cut = jnp.nanquantile(candidates, 1.0 - fraction, axis=-1, keepdims=True)
        merges = merges & (best >= cut)
    norms = jnp.linalg.norm(values.astype(jnp.float32), axis=-1)
    target_norms = jnp.take_along_axis(norms, target, axis=-1)
    weights = jnp.where(merges, jnp.maximum(best, 0.0), 0.0)
    return weights * norms / (norms + target_norms + _EPS), target


def merged_layer_values(keys, values, keep, held, threshold: float, fraction: float):
    """[B, K, S, H]: one layer's values with each head's evicted values folded into their
    targets (the module docstring's rule); the other slots unchanged."""
    weights, target = merge_weights(keys, values, keep, held, threshold, fraction)
    v = values.astype(jnp.float32)

    def per_head(weights, target, v):  # [S], [S], [S, H]
        added = (
            jnp.zeros_like(v)
            .at[target]
            .add(jnp.where(weights[:, None] > 0, weights[:, None] * v, 0.0))
        )
        total = jnp.zeros(weights.shape, jnp.float32).at[target].add(weights)
        merged = (v + added) / (1.0 + total)[:, None]
        return jnp.where((total > 0)[:, None], merged.astype(values.dtype), v.astype(values.dtype))

    return jax.vmap(jax.vmap(per_head))(weights, target, v)


@dataclasses.dataclass(frozen=True)
class MergedCompression(InnerScoredCompression):
    """An inner `ScoredCompression`'s choice, the evicted values merged into the kept ones."""

    similarity_threshold: float
    merge_fraction: float

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        pool = kv.pool
        if pool.v_scales is not None or pool.int8 is not None:
            raise ValueError("policy 'merging' cannot merge int8 values (int8 storage is on)")
        keep = scored_keep_mask(self.inner, kv, obs, model)
        held = kv.positions() >= 0

        def layer(xs):
            table, keep, held = xs
            keys = attention_ops.gather_pages(pool.k_pages, table)
            values = attention_ops.gather_pages(pool.v_pages, table)
            return merged_layer_values(
                keys, values, keep, held, self.similarity_threshold, self.merge_fraction
            )

        values = jax.lax.map(layer, (kv.page_table, keep, held))  # [L, B, K, S, H]
        return compact(kv.with_values(values), keep)


@base.register
@dataclasses.dataclass(frozen=True)
class Merging(base.Policy):
    """MergingPress: an inner scoring policy's eviction, each evicted value merged into its
    most similar kept token's (module docstring).

    Attributes:
      budget: tokens kept per head: a ratio of the prompt or a token count.
      inner: the scoring eviction policy (or its name; Knorm by default).
      similarity_threshold: the least cosine similarity that merges, in [0, 1].
      merge_fraction: the share of the evicted tokens (most similar first) that merge, in
        (0, 1].
    """

    name: ClassVar[str] = "merging"
    request_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    budget: base.Budget | float | int | None = None
    inner: EvictionPolicy | str = "knorm"
    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0

    def _check(self) -> None:
        super()._check()
        if self.budget is not None:
            object.__setattr__(self, "budget", base.Budget.parse(self.budget))
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(f"similarity_threshold={self.similarity_threshold} must be in [0, 1]")
        if not 0.0 < self.merge_fraction <= 1.0:
            raise ValueError(f"merge_fraction={self.merge_fraction} must be in (0, 1]")

    def _parts(self) -> dict:
        compression = scoring_compression(self.name, self.inner)
        protected = compression.sinks + compression.protected_recent
        merged = MergedCompression(compression, self.similarity_threshold, self.merge_fraction)
        return {
            "prompt_compression": merged,
            "budget_rule": base.PromptBudget(self.name, self.budget, protected),
        }
