"""KVCompose as NVIDIA kvpress 0.5.5's KVComposePress implements it: the prompt, replayed once
after itself, scores each cached token by the attention the replay pays it; composite scores
give each layer its share of one budget over all layers, and each head keeps its best tokens.

1. Replay: the prompt's tokens run again at positions T..2T-1, each replay query attending to
   the whole cached prompt and causally to the replay (one pass, the softmax over all of it).
   A token's score for a query head is the largest (`task="max"`) or mean (`"mean"`)
   probability any replay query gives it; a KV head's is the mean (`group="mean"`) or largest
   (`"max"`) over its query heads.
2. With `mean_across_heads` (the default) the layer's mean over KV heads is added to each
   head's scores. (kvpress's add_v_norm, scores times value norms, fails in 0.5.5: its cache
   holds the replay too, twice the scores' length; it is not offered here.)
3. Composite scores: each head's scores sorted in descending order; a layer's composite is the
   mean (`aggregate_heads="mean"`) or largest (`"max"`) of its heads' sorted scores, rank by
   rank; the first layer's is the largest of every layer's (so it keeps the most). The first
   `lower_bound` ranks of every composite are raised by 1e9.
4. Budget: of all L x T composite entries, floor(share x L x T) are kept (one threshold; ties:
   the lower layer and rank first); a layer keeps as many tokens per head as it has entries
   kept, and each head keeps its best-scored tokens (ties: the lower position).
   `structured=False` ranks the heads' own sorted scores instead, over L x K x T entries:
   each head of each layer gets its own count (kvpress masks those keys; here they free pages).

The replay is one forward pass of the padded prompt over the cache (its attention over itself
is [T x T] per head, as kvpress's eager pass): memory grows with the square of the prompt.
Paper (docs/references.md): KVCompose (arXiv:2509.05165).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, rank_descending
from jaxkv.policies import base
from jaxkv.policies.kvzip import replay_scores
from jaxkv.policies.structure import SpreadShareBudget, share_of
from jaxkv.step.parts import PrefillObservations

AGGREGATIONS = ("max", "mean")
_LOWER_BOUND_BOOST = 1e9  # kvpress's


def _aggregate(x: jax.Array, how: str, axis: int, count=None) -> jax.Array:
    """max or mean of x over `axis` (the mean over `count` entries where given)."""
    if how == "max":
        return jnp.max(x, axis=axis)
    total = jnp.sum(x, axis=axis)
    return total / (x.shape[axis] if count is None else count)


def replay_received(task: str, group: str):
    """The `replay_attention` reduction of KVCompose's step 1: probs [B, K, G, C, S] (0 for
    invalid queries), query_valid bool [B, 1, 1, C, 1] -> f32 [B, K, S]."""

    def received(probs: jax.Array, query_valid: jax.Array) -> jax.Array:
        count = jnp.sum(query_valid, axis=3, dtype=jnp.float32)  # [B, 1, 1, 1]
        per_query_head = _aggregate(probs, task, axis=3, count=jnp.maximum(count, 1.0))
        return _aggregate(per_query_head, group, axis=2)

    return received


def _replay_positions(width: int, lengths: jax.Array) -> jax.Array:
    """int32 [B, width]: the positions of each prompt read again after itself (-1: padding)."""
    columns = jnp.arange(width)
    return jnp.where(columns < lengths[:, None], lengths[:, None] + columns, -1)


def composite_keep(
    scores: jax.Array,
    held: jax.Array,
    total: jax.Array,
    *,
    structured: bool,
    aggregate_heads: str,
    lower_bound: int,
) -> jax.Array:
    """bool [L, B, K, S] the slots KVCompose keeps (steps 3-4 of the module docstring).

    scores f32 [L, B, K, S] (after step 2); held bool [L, B, K, S] (every head of a layer holds
    the same count); total int [B] the entries kept over all layers (and heads if unstructured).
    """
    num_layers, b, k, s = scores.shape
    ranked = jnp.where(held, scores, -jnp.inf)
    sorted_desc = -jnp.sort(-ranked, axis=-1)  # [L, B, K, S], empty slots last
    boost = jnp.where(jnp.arange(s) < lower_bound, _LOWER_BOUND_BOOST, 0.0)
    if structured:
        composite = _aggregate(sorted_desc, aggregate_heads, axis=2) + boost  # [L, B, S]
        composite = composite.at[0].set(jnp.max(composite, axis=0))
    else:
        composite = sorted_desc + boost  # [L, B, K, S]
    per_row = jnp.moveaxis(composite, 1, 0)  # [B, L, ...]
    chosen = rank_descending(per_row.reshape(b, -1)) < total[:, None]
    counts = jnp.sum(chosen.reshape(per_row.shape), axis=-1)  # [B, L] or [B, L, K]
    counts = jnp.moveaxis(counts, 0, 1)  # [L, B] or [L, B, K]
    if structured:
        counts = jnp.broadcast_to(counts[..., None], (num_layers, b, k))
    return (rank_descending(ranked) < counts[..., None]) & held


@dataclasses.dataclass(frozen=True)
class ComposedReplayCompression(base.PromptCompressionPart):
    """KVCompose's prompt compression part (module docstring). Attributes: as `KVCompose`'s,
    `share` static (each share compiles its own program)."""

    share: float | None  # None only where `SpreadShareBudget.tokens` refuses the policy first
    structured: bool
    task: str
    group: str
    aggregate_heads: str
    mean_across_heads: bool
    lower_bound: int

    needs_prompt_tokens: ClassVar[bool] = True

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        ids = obs.prompt_tokens
        positions = _replay_positions(ids.shape[1], obs.prompt_lengths)
        received = replay_received(self.task, self.group)
        scores = replay_scores(model, kv, ids, positions, received)  # [L, B, K, S]
        held = kv.positions() >= 0
        num_layers = kv.num_layers
        entries = obs.prompt_lengths * num_layers
        if not self.structured:
            entries = entries * kv.lengths.shape[2] * collectives.head_shards()
        total = share_of(entries, self.share)

        def keep(scores, held):
            if self.mean_across_heads:
                counted = jnp.sum(held, axis=2, keepdims=True)
                mean = jnp.sum(jnp.where(held, scores, 0.0), axis=2, keepdims=True)
                scores = scores + mean / jnp.maximum(counted, 1)
            return composite_keep(
                scores,
                held,
                total,
                structured=self.structured,
                aggregate_heads=self.aggregate_heads,
                lower_bound=self.lower_bound,
            )

        return compact(kv, collectives.over_all_heads(keep, scores, held, axis=2))


@base.register
@dataclasses.dataclass(frozen=True)
class KVCompose(base.Policy):
    """KVComposePress: replayed-prompt attention, composite layer budgets (module docstring).

    Attributes:
      ratio: the share of all KV pairs kept, in (0, 1] (kvpress's 1 - compression_ratio);
        floor(ratio x L x T) composite entries are kept.
      structured: every head of a layer keeps the same count (kvpress's default); False gives
        each head its own.
      task, group, aggregate_heads: "max" or "mean" (kvpress's agg_task, agg_group, agg_head).
      mean_across_heads: the layer's mean over KV heads added (kvpress's add_mean_across_heads).
      lower_bound: ranks every composite keeps (kvpress's keep_token_lower_bound).
    """

    name: ClassVar[str] = "kvcompose"
    decides_across_heads: ClassVar[bool] = True

    ratio: float | None = None
    structured: bool = True
    task: str = "max"
    group: str = "mean"
    aggregate_heads: str = "mean"
    mean_across_heads: bool = True
    lower_bound: int = 0

    def _check(self) -> None:
        super()._check()
        if self.ratio is not None:
            base.Budget(ratio=self.ratio)  # validates (0, 1]
        for field in ("task", "group", "aggregate_heads"):
            if getattr(self, field) not in AGGREGATIONS:
                raise ValueError(
                    f"{field}={getattr(self, field)!r} must be one of {', '.join(AGGREGATIONS)}"
                )
        if isinstance(self.lower_bound, bool) or not isinstance(self.lower_bound, int):
            raise ValueError(f"lower_bound={self.lower_bound!r} must be an integer >= 0")
        if self.lower_bound < 0:
            raise ValueError(f"lower_bound={self.lower_bound} must be >= 0")

    def _parts(self) -> dict:
        share = None if self.ratio is None else float(self.ratio)
        compression = ComposedReplayCompression(
            share,
            self.structured,
            self.task,
            self.group,
            self.aggregate_heads,
            self.mean_across_heads,
            self.lower_bound,
        )
        return {
            "prompt_compression": compression,
            "budget_rule": SpreadShareBudget(self.name, share),
        }
