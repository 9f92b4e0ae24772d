"""CaM (kvpress's CAMPress): compression during generation that merges values before it evicts.

Every decode step adds each cached token's attention from the new query (averaged over the KV
head's query heads) to its cumulative attention A; the prompt's own queries add none. Every
`compression_interval` steps a layer over `target_size` tokens is compressed as kvpress's
DecodingPress compresses, but with the same tokens for every head: the cache-only inner
scores averaged over the layer's KV heads rank the tokens; the lowest len - target are evicted.
Before they go, the `compression_interval` best-scored evicted tokens (later ones first among
ties) merge: each into the `merge_budget` kept tokens after it (in position order), per head
with probability clamp(A_m / mean A over that window, 0, 1) (a Bernoulli draw from the step's
key), its value divided by the window's size and added to each of them. Keys are unchanged.

Paper (docs/references.md): "CaM: Cache Merging for Memory-efficient LLMs Inference" (ICML
2024). The heads of a layer must hold the same positions (CaM alone, the prompt kept whole).
Int8 storage is refused.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv import attention as attention_ops
from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, run_if
from jaxkv.policies import base
from jaxkv.policies.decoding import Decoding, TargetDecodeEviction
from jaxkv.policies.eviction import map_cache_layers
from jaxkv.policies.structure import cache_only_scorer
from jaxkv.step.parts import DecodeContext


def cam_choice(scores, held, target, merges: int):
    """One layer's choice for one row (its heads holding the same slots in position order):
    (keep, merging) bool [S], the slots kept and the evicted ones that may merge.

    scores f32 [S] the inner scores averaged over the KV heads; held bool [S]; target int []
    tokens kept (the held count when nothing is due); merges: how many evicted tokens may
    merge, the best-scored first (later slots first among ties).
    """
    slots = jnp.arange(held.shape[0])
    ascending = jnp.argsort(jnp.argsort(jnp.where(held, scores, jnp.inf), stable=True), stable=True)
    evicted = held & (ascending < jnp.sum(held) - target)
    order = jnp.lexsort((-slots, -jnp.where(evicted, scores, -jnp.inf)))
    return held & ~evicted, evicted & (jnp.argsort(order, stable=True) < merges)


def cam_merge(values, attention, keep, merging, target, merge_budget: int, uniform):
    """One row's merges of one layer: (probability f32 [K, S] of each slot's merge, values
    [K, S, H] after them).

    values [K, S, H]; attention f32 [K, S] cumulative decode attention; keep, merging bool [S]
    (`cam_choice`); target int [] the kept count; uniform f32 [K, S] U(0, 1) draws: a merging
    slot merges in a head where its draw is under its probability.
    """
    s = keep.shape[0]
    kept_rank = jnp.cumsum(keep) - 1  # each kept slot's index among the kept
    kept_slot = (
        jnp.zeros((s,), jnp.int32).at[jnp.where(keep, kept_rank, s)].set(jnp.arange(s), mode="drop")
    )
    window = jnp.cumsum(keep)[:, None] + jnp.arange(merge_budget)  # [S, m]: the next kept
    in_window = window < target
    targets = kept_slot[jnp.minimum(window, s - 1)]  # [S, m]
    size = jnp.sum(in_window, axis=-1)  # [S]
    window_attention = jnp.where(in_window, attention[:, targets], 0.0)  # [K, S, m]
    probability = attention / (jnp.sum(window_attention, axis=-1) / jnp.maximum(size, 1))
    probability = jnp.where(jnp.isnan(probability), 0.0, probability)
    probability = jnp.clip(jnp.where(jnp.isinf(probability), 1.0, probability), 0.0, 1.0)
    merged = merging & (uniform < probability) & (size > 0)  # [K, S]
    share = jnp.where(merged, 1.0 / jnp.maximum(size, 1), 0.0)
    v = values.astype(jnp.float32)
    contributions = (v * share[..., None])[:, :, None, :] * in_window[None, :, :, None]
    added = (
        jnp.zeros_like(v)
        .at[:, targets.reshape(-1)]
        .add(contributions.reshape(v.shape[0], -1, v.shape[-1]))
    )
    return probability, (v + added).astype(values.dtype)


@dataclasses.dataclass(frozen=True)
class DecodeSummedMass(base.SummedMass):
    """The attention scoring part: each token's attention from decode steps' queries (a chunk
    of one position), summed; the prompt's queries add none."""

    def mass_weights(self, positions: jax.Array, thresholds) -> tuple[jax.Array, jax.Array]:
        decay, weights = super().mass_weights(positions, thresholds)
        return decay, weights * (positions.shape[1] == 1)


@dataclasses.dataclass(frozen=True)
class MergingDecodeEviction(TargetDecodeEviction):
    """CaM's decode eviction part (module docstring); attributes as `TargetDecodeEviction`'s,
    and merge_budget: kept tokens each merge spreads over."""

    merge_budget: int = 32

    def on_decode(self, kv: KVState, ctx: DecodeContext) -> KVState:
        pool = kv.pool
        if pool.v_scales is not None or pool.int8 is not None:
            raise ValueError("policy 'cam' cannot merge int8 values (int8 storage is on)")
        lengths = kv.lengths[0, :, 0]  # every head of every layer holds the same count
        due = (ctx.positions >= 0) & (lengths > self.target_size)
        target = jnp.where(due, self.target_size, lengths)
        k_local, s = kv.lengths.shape[2], kv.max_tokens_per_head

        def evict(kv: KVState) -> KVState:
            scores = map_cache_layers(kv, ctx.prompt_lengths, self.scorer.layer_scores)
            mean = collectives.over_all_heads(
                lambda x: jnp.broadcast_to(jnp.mean(x, axis=2, keepdims=True), x.shape),
                scores,
                axis=2,
            )[:, :, 0]  # [L, B, S]
            layers = jnp.arange(kv.num_layers)

            def draws(key, layer):  # every head's, so that a mesh draws the same
                shape = (k_local * collectives.head_shards(), s)
                return jax.random.uniform(jax.random.fold_in(key, layer), shape)

            uniform = jax.vmap(lambda layer: jax.vmap(draws, (0, None))(ctx.keys, layer))(layers)
            uniform = collectives.local_heads(uniform, axis=2)  # [L, B, K, S]

            def layer(xs):
                table, mean, lengths, attention, uniform = xs
                values = attention_ops.gather_pages(pool.v_pages, table)  # [B, K, S, H]
                held = jnp.arange(s) < lengths[:, :1]

                def row(values, scores, attention, held, target, uniform):
                    keep, merging = cam_choice(scores, held, target, self.interval)
                    _, merged = cam_merge(
                        values, attention, keep, merging, target, self.merge_budget, uniform
                    )
                    return merged, keep

                return jax.vmap(row)(values, mean, attention, held, target, uniform)

            xs = (kv.page_table, mean, kv.lengths, kv.token_scores(), uniform)
            values, keep = jax.lax.map(layer, xs)  # [L, B, K, S, H], [L, B, S]
            keep = jnp.broadcast_to(keep[:, :, None, :], kv.positions().shape)
            return compact(kv.with_values(values), keep)

        return run_if(collectives.any_shard(jnp.any(due)), evict, kv)


@base.register
@dataclasses.dataclass(frozen=True)
class CAM(Decoding):
    """CAMPress: `decoding` whose evicted tokens first merge into the kept ones after them
    (module docstring).

    Attributes:
      inner: the cache-only scoring policy (or its name; Knorm by default).
      compression_interval: decode steps between compressions (512), and how many evicted
        tokens may merge at each.
      target_size: tokens per head after a compression (2048).
      merge_budget: kept tokens each merge spreads over (32).
    """

    name: ClassVar[str] = "cam"
    merge_budget: int = 32

    def _check(self) -> None:
        super()._check()
        if isinstance(self.merge_budget, bool) or not isinstance(self.merge_budget, int):
            raise ValueError(f"merge_budget={self.merge_budget!r} must be an integer >= 1")
        if self.merge_budget < 1:
            raise ValueError(f"merge_budget={self.merge_budget} must be >= 1")

    def _parts(self) -> dict:
        scorer = cache_only_scorer(self.name, self.inner)
        eviction = MergingDecodeEviction(
            scorer, self.compression_interval, self.target_size, merge_budget=self.merge_budget
        )
        return {"decode_eviction": eviction, "attention_scoring": DecodeSummedMass()}
