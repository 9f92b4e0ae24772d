"""Scissorhands: tokens that were unimportant to many queries stay unimportant, so drop them.

Paper: Liu et al. 2023, "Scissorhands: Exploiting the Persistence of Importance Hypothesis for
LLM KV Cache Compression at Test Time" (arXiv:2305.17118), Algorithms 1 (budget KV cache) and 2
(compress KV cache); Conf-KV's main baseline (docs/confkv.md). During generation every cached
token counts the queries that gave it less attention than the average 1/n (n the tokens the
query attends to); when the cache exceeds its budget B, the recent window r stays and the tokens
with the most such counts go, m at a time.

Readings (docs/confkv.md, "Scissorhands"):
- The count lives in the token's score (`token_scores`) during decode. Each decode step adds,
  to every slot its query's head held before the step, the indicator "attention < 1 / n" with
  n = the head's held tokens + 1 (the query sees itself); with grouped queries the attention is
  the mean over the KV head's G query heads (one query per step, so this is exactly that
  step's group-mean attention: the mass H2O accumulates, `update_scores`). The new token's own
  count starts at 0. The paper's history window w is unbounded: the count runs over every
  decode query since the prompt was compressed.
- The prompt is compressed once after prefill as H2O does it (attention received, summed over
  the prompt's queries and averaged over the group, with the same sinks and recent window), as
  Scissorhands' public code does for the prompt; the counts then start at 0 for every kept
  token. A prefill chunk is told from a decode step by its width (one query), so prefill chunks
  of one token are refused.
- Drop amount m is `evict_every`: every m decode steps a head over its budget keeps its sinks,
  its newest `recent` positions and the tokens with the lowest counts (ties: the newer first),
  budget tokens in all (the paper drops m from a cache of B + m).
- Int8 storage keeps the counts (the spill moves scores with their tokens, and the int8 tier's
  attention adds to them like the model-dtype pages'); a local ring is refused, like every
  policy that accumulates attention.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import KVState
from jaxkv.policies import base
from jaxkv.policies.eviction import DecodeEvictionPolicy, DecodeScorer, LayerView


@dataclasses.dataclass(frozen=True)
class UnimportanceCount(base.SummedMass):
    """Scissorhands' attention scoring part: over the prompt H2O's summed attention; at each
    decode step a held token's count grows by 1 when the step's attention to it is below
    average (1 / n)."""

    def update_scores(
        self,
        old: jax.Array | None,
        mass: jax.Array,
        *,
        positions: jax.Array,
        cached_lengths: jax.Array,
        thresholds,
    ) -> jax.Array:
        """Prefill chunks: H2O's accumulated attention. A decode step: old + (mass < 1 / n)
        for each held slot (n = cached_lengths + 1), 0 for the new token, unchanged for a
        finished sequence (position -1)."""
        if positions.shape[-1] > 1:
            return super().update_scores(
                old, mass, positions=positions, cached_lengths=cached_lengths, thresholds=thresholds
            )
        if old is None:
            return jnp.zeros_like(mass)
        below_average = mass < 1.0 / (cached_lengths + 1).astype(jnp.float32)[..., None]
        counted = below_average & (positions >= 0)[:, :, None]
        return old + counted.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class UnimportanceScores(DecodeScorer):
    """Scissorhands' scores: over the prompt the attention received (H2O's); during decode
    minus each slot's rank by (count of below-average steps, then newer first)."""

    def layer_scores(self, view: LayerView) -> jax.Array:
        return view.token_scores

    def decode_scores(self, kv: KVState, positions: jax.Array) -> jax.Array:
        """f32 [L, B, K, S]: the fewest unimportant counts rank best, and exactly (no
        count-position mix in f32)."""
        order = jnp.lexsort((-positions, kv.token_scores()), axis=-1)
        return -jnp.argsort(order, axis=-1).astype(jnp.float32)


@base.register
@dataclasses.dataclass(frozen=True)
class Scissorhands(DecodeEvictionPolicy):
    """Persistence of importance: evict the tokens most often attended below average.

    The record of an `UnimportanceCount` scoring and H2O's prompt compression (then every kept
    token's count set to 0) and decode eviction of `UnimportanceScores`.

    Attributes (besides `EvictionPolicy`'s budget, sinks and recent):
      evict_every: m, the decode steps between evictions, each down to the budget (1 evicts at
        every step); a head holds up to m tokens over its budget in between.
    """

    name: ClassVar[str] = "scissorhands"

    def check_prefill(self, prompt_lengths: np.ndarray, chunk: int) -> None:
        del prompt_lengths
        if chunk < 2:
            raise ValueError(
                f"policy {self.name!r}: prefill_chunk={chunk} must be >= 2 (a chunk of one "
                "query is counted as a decode step)"
            )

    def _scorer(self) -> UnimportanceScores:
        return UnimportanceScores()

    def _parts(self) -> dict:
        record = super()._parts()
        compression = dataclasses.replace(record["prompt_compression"], reset_scores=True)
        return record | {
            "attention_scoring": UnimportanceCount(),
            "prompt_compression": compression,
        }
