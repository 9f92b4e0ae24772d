"""SAGE-KV: one-shot top-k after prefill from the last token's attention, with sinks and recents.

With a budget of B tokens per head and G query heads per KV head (the paper's appendix A.2,
whose formula is garbled in the text; this split reproduces its worked numbers): B/4 sinks;
each query head picks its top k candidates by the last query's attention, k = B/(2G) rounded
down to a power of two (B = 8192: Llama, G = 4, k = 1024; Qwen2.5, G = 7, k = 512); the KV head
keeps the union over its G heads; the newest B - B/4 - G*k tokens (the last one included) form
the recent window (2048 for Llama, 2560 for Qwen2.5). During decode each new token joins the
recent window and its oldest token is evicted.

The sinks and the recent window come from the budget, so `SageKV` rejects the `sinks=` and
`recent=` fields it inherits from `EvictionPolicy` (a named ValueError) rather than ignore them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, evict_in_place, rank_descending, run_if
from jaxkv.policies import base
from jaxkv.policies.base import keep_short_prompts_whole
from jaxkv.policies.eviction import (
    DecodeEvictionPolicy,
    IntervalDecodeEviction,
    LayerView,
    map_layers,
)
from jaxkv.step.parts import DecodeContext, PrefillObservations

# The smallest budget SAGE-KV splits (a quarter of it sinks, the rest candidates and recents).
MIN_BUDGET = 4


def sage_split(budget_tokens: jax.Array, group_size: int):
    """(sinks, top-k per query head, recent window) int32 [B] for budgets [B]: B // 4 sinks,
    k = the power of two at or below B // (2G) (0 when B < 2G), recent = B - B // 4 - G * k."""
    budget_tokens = jnp.asarray(budget_tokens, jnp.int32)
    sinks = budget_tokens // 4
    half_per_head = budget_tokens // (2 * group_size)
    highest_bit = 31 - jax.lax.clz(jnp.maximum(half_per_head, 1))
    per_head = jnp.where(half_per_head > 0, jnp.left_shift(1, highest_bit), 0)
    return sinks, per_head, budget_tokens - sinks - group_size * per_head


def last_query_attention(view: LayerView) -> jax.Array:
    """f32 [B, N, S]: the last prompt query's attention per query head (not per KV head)."""
    return view.window_probabilities()[:, :, 0]


@dataclasses.dataclass(frozen=True)
class SageCompression(base.PromptCompressionPart):
    """SAGE-KV's prompt compression part (module docstring): the budget's sinks and recent
    window, and the union over each KV head's query heads of their top-k by the last query's
    attention (`last_query_attention`)."""

    observation_window: ClassVar[int] = 1

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        scores = map_layers(kv, obs, model, last_query_attention)  # [L, B, N, S]
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
        # A budget of the whole prompt keeps it whole (the union may hold fewer than G * k).
        whole = (obs.budget_tokens >= obs.prompt_lengths)[None, :, None, None]
        return compact(kv, is_sink | is_recent | union | (whole & (positions >= 0)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowEviction(IntervalDecodeEviction):
    """SAGE-KV's decode eviction part: every `evict_every` steps the recent window slides, so
    that it holds the newest `recent` positions of the budget's split again."""

    def on_decode(self, kv: KVState, ctx: DecodeContext) -> KVState:
        _, _, recent = sage_split(ctx.budget_tokens, ctx.group_size)
        positions = kv.positions()
        before_window = positions < (ctx.prompt_lengths - recent)[None, :, None, None]
        in_window = positions > (ctx.positions - recent)[None, :, None, None]
        keep = before_window | in_window
        leaving = jnp.any((positions >= 0) & ~keep)
        evict = functools.partial(evict_in_place, keep=keep, max_moves=self.evict_every)
        return run_if(leaving, evict, kv)


@dataclasses.dataclass(frozen=True)
class SageBudget(base.PromptBudget):
    """SAGE-KV's budget part: `PromptBudget`'s, with the whole prompt where a ratio gives fewer
    than `MIN_BUDGET` tokens (too few to split); a token budget below it is refused."""

    def tokens(self, prompt_lengths):
        if self.budget is not None and self.budget.tokens is not None:
            if self.budget.tokens < MIN_BUDGET:
                raise ValueError(
                    f"policy {self.owner!r}: budget of {self.budget.tokens} tokens is below "
                    f"{MIN_BUDGET}: give budget >= {MIN_BUDGET} tokens (or a ratio)"
                )
        tokens = super().tokens(prompt_lengths)
        return keep_short_prompts_whole(tokens, prompt_lengths, MIN_BUDGET)


@base.register
@dataclasses.dataclass(frozen=True)
class SageKV(DecodeEvictionPolicy):
    """SAGE-KV (module docstring): the record of a `SageCompression` and a
    `SlidingWindowEviction` with a `SageBudget`. During decode the recent window slides every
    `evict_every` steps (in between it holds up to that many tokens more)."""

    name: ClassVar[str] = "sage_kv"

    def _check(self) -> None:
        super()._check()
        if self.sinks or self.recent:
            raise ValueError(
                f"policy 'sage_kv' takes no sinks= or recent= (got sinks={self.sinks}, "
                f"recent={self.recent}): its split comes from the budget B (B/4 sinks, top-k "
                "= B/(2G) rounded down to a power of two per query head, the rest recent)"
            )

    def _parts(self) -> dict:
        budget = SageBudget(self.name, self.budget, SageCompression.observation_window, True)
        return {
            "prompt_compression": SageCompression(),
            "decode_eviction": SlidingWindowEviction(
                evict_every=self.evict_every, ratio=float(budget.ratio(1)[0])
            ),
            "budget_rule": budget,
        }
