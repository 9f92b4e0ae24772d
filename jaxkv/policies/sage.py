"""SAGE-KV: one-shot top-k after prefill from the last token's attention, with sinks and recents.

With a budget of B tokens per head and G query heads per KV head: B/4 sinks, each query head
picks its top B/(4G) candidates by the last query's attention, the KV head keeps the union over
its G heads, and the newest B - B/4 - G * B/(4G) tokens (the last one included) form the recent
window. During decode each new token joins the recent window and its oldest token is evicted.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, rank_descending
from jaxkv.policies import base
from jaxkv.policies.eviction import DecodeEviction, LayerView


def sage_split(budget_tokens: jax.Array, group_size: int):
    """(sinks, top-k per query head, recent window) int32 [B] for budgets [B]."""
    sinks = budget_tokens // 4
    per_head = budget_tokens // (4 * group_size)
    return sinks, per_head, budget_tokens - sinks - group_size * per_head


@base.register
@dataclasses.dataclass(frozen=True)
class SageKV(DecodeEviction):
    """SAGE-KV (module docstring). During decode the recent window slides every `evict_every`
    steps (in between it holds up to that many tokens more)."""

    name: ClassVar[str] = "sage_kv"

    @property
    def observation_window(self) -> int:
        return 1

    def budget_tokens(self, prompt_lengths):
        tokens = super().budget_tokens(prompt_lengths)
        if (tokens < 4).any():
            raise ValueError(f"policy 'sage_kv': budget of {int(tokens.min())} tokens is below 4")
        return tokens

    def layer_scores(self, view: LayerView) -> jax.Array:
        """The last query's attention per query head, f32 [B, N, S] (not per KV head)."""
        return view.window_probabilities()[:, :, 0]

    def compress(self, kv: KVState, obs: base.PrefillObservations, model) -> KVState:
        scores = self.scores(kv, obs, model)  # [L, B, N, S]
        positions = kv.positions()  # [L, B, K, S]
        num_kv_heads = positions.shape[2]
        group = scores.shape[2] // num_kv_heads
        sinks, per_head, recent = (
            x[None, :, None, None] for x in sage_split(obs.budget_tokens, group)
        )
        length = obs.prompt_lengths[None, :, None, None]
        is_sink = (positions >= 0) & (positions < sinks)
        is_recent = positions >= length - recent
        candidate = (positions >= 0) & ~is_sink & ~is_recent
        candidate_per_query_head = jnp.repeat(candidate, group, axis=2)
        ranked = jnp.where(candidate_per_query_head, scores, -jnp.inf)
        chosen = (rank_descending(ranked) < per_head) & candidate_per_query_head
        num_layers, batch, _, slots = chosen.shape
        union = jnp.any(chosen.reshape(num_layers, batch, num_kv_heads, group, slots), axis=3)
        return compact(kv, is_sink | is_recent | union)

    def on_decode(self, kv: KVState, ctx: base.DecodeContext) -> KVState:
        """Slides the recent window: it holds the newest `recent` positions again."""
        _, _, recent = sage_split(ctx.budget_tokens, ctx.group_size)
        positions = kv.positions()
        before_window = positions < (ctx.prompt_lengths - recent)[None, :, None, None]
        in_window = positions > (ctx.positions - recent)[None, :, None, None]
        keep = before_window | in_window
        leaving = jnp.any((positions >= 0) & ~keep)
        return jax.lax.cond(leaving, lambda kv: compact(kv, keep), lambda kv: kv, kv)
