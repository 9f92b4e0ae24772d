"""Compression during generation, with the semantics of NVIDIA kvpress 0.5.5's DecodingPress
and CompressionRatioDecodingPress: every `compression_interval` decode steps, each head holding
more than the target keeps its best-scored target tokens by a cache-only scorer (over the whole
cache, prompt included, nothing protected).

  decoding        the target is `target_size` tokens per head;
  ratio_decoding  the target is max(1, floor(budget x the tokens seen so far)).

kvpress's PrefillDecodingPress (one press for the prompt, another for decode) is a composition:
`policies.from_spec("knorm:0.5+decoding:inner=keydiff:target_size=256")`. kvpress lets a
decoding press wrap scorers that read queries (buffering the decode steps' hidden states);
jaxkv's read the cache alone (`Scorer.cache_only`). One difference in kind: kvpress's cache
holds the kept tokens in the order its scorer ranked them, jaxkv's in position order, so a
scorer that reads the cache's order (LagKV's partitions, CUR's windows) sees another cache from
the second compression on; Knorm, KeyDiff and Random do not read it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, keep_top_per_head, run_if
from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, Scorer, map_cache_layers
from jaxkv.policies.structure import cache_only_scorer, ratio_budget
from jaxkv.step.parts import DecodeContext

THRESHOLD_NAMES = ("share",)  # ratio_decoding's share of the tokens seen, an array in jit


@dataclasses.dataclass(frozen=True)
class TargetDecodeEviction:
    """The decode eviction part of `decoding` and `ratio_decoding`: every `interval` decode
    steps a head holding more than its target keeps its `scorer`'s best target-many tokens.

    Attributes:
      scorer: a cache-only `Scorer`.
      interval: decode steps between compressions.
      target_size: tokens per head after a compression (None: a share of the tokens seen,
        the threshold `share`, which travels to jit as an array).
      share: that share on the host (its bound), None in the copy jit sees.
    """

    scorer: Scorer
    interval: int
    target_size: int | None
    share: float | None = None

    @property
    def decode_interval(self) -> int:
        return self.interval

    def step_record(self, logits: jax.Array) -> None:
        del logits

    def _targets(self, seen, share):
        """int [B]: tokens per head a compression keeps, for `seen` tokens read so far (int
        [B]) and the share kept (f32 [B] or a float; unread with a `target_size`)."""
        xp = np if isinstance(seen, np.ndarray) else jnp
        if self.target_size is not None:
            return xp.full(seen.shape, self.target_size, xp.int32)
        return xp.maximum(1, xp.floor(seen * xp.float32(share))).astype(xp.int32)

    def decode_tokens_bound(self, budget_tokens, prompt_lengths, max_new_tokens):
        lengths = np.asarray(prompt_lengths, np.int64)
        grown = lengths + max_new_tokens
        after_prompt = np.asarray(budget_tokens).reshape(len(lengths), -1)[:, 0]
        targets = self._targets(grown, self.share)
        return np.minimum(np.maximum(after_prompt, targets) + self.interval, grown)

    def on_decode(self, kv: KVState, ctx: DecodeContext) -> KVState:
        share = None
        if self.target_size is None:
            share = ctx.thresholds[:, THRESHOLD_NAMES.index("share")]
        due = ctx.positions >= 0
        targets = self._targets(ctx.positions + 1, share)
        targets = jnp.where(due, targets, jnp.iinfo(jnp.int32).max)

        def evict(kv: KVState) -> KVState:
            scores = map_cache_layers(
                kv, ctx.prompt_lengths, self.scorer.layer_scores, values=self.scorer.reads_values
            )
            held = kv.positions() >= 0
            budgets = jnp.broadcast_to(targets[None, :, None], held.shape[:3])
            return compact(kv, keep_top_per_head(scores, budgets, held, jnp.zeros_like(held)))

        return run_if(jnp.any(kv.lengths > targets[None, :, None]), evict, kv)


@dataclasses.dataclass(frozen=True)
class _Decoding(base.Policy):
    """The settings `decoding` and `ratio_decoding` share."""

    inner: EvictionPolicy | str = "knorm"
    compression_interval: int = 512

    def _check(self) -> None:
        super()._check()
        if self.compression_interval < 1:
            raise ValueError(f"compression_interval={self.compression_interval} must be >= 1")
        name = self.inner if isinstance(self.inner, str) else self.inner.name
        if name == "random":
            raise ValueError(
                f"policy {self.name!r}: inner='random' draws per prefill, not per decode step; "
                "give a cache-only scorer that draws nothing (knorm, keydiff, lagkv, cur)"
            )


@base.register
@dataclasses.dataclass(frozen=True)
class Decoding(_Decoding):
    """DecodingPress: every `compression_interval` decode steps, each head over `target_size`
    tokens keeps the best `target_size` by its cache-only inner scorer (module docstring).

    Attributes:
      inner: the cache-only scoring policy (or its name; Knorm by default).
      compression_interval: decode steps between compressions (kvpress's default 512).
      target_size: tokens per head after a compression (kvpress's default 2048).
    """

    name: ClassVar[str] = "decoding"
    primary_knob: ClassVar[str] = "target_size"
    target_size: int = 2048

    def _check(self) -> None:
        super()._check()
        if self.target_size < 1:
            raise ValueError(f"target_size={self.target_size} must be >= 1")

    def _parts(self) -> dict:
        scorer = cache_only_scorer(self.name, self.inner)
        eviction = TargetDecodeEviction(scorer, self.compression_interval, self.target_size)
        return {"decode_eviction": eviction}


@base.register
@dataclasses.dataclass(frozen=True)
class RatioDecoding(_Decoding):
    """CompressionRatioDecodingPress: `decoding` whose target is `budget` of the tokens seen so
    far (at least one).

    Attributes:
      budget: the share of the tokens seen kept, in (0, 1] (kvpress's 1 - its ratio).
    """

    name: ClassVar[str] = "ratio_decoding"
    request_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    budget: base.Budget | float | None = None

    def _check(self) -> None:
        super()._check()
        if self.budget is not None:
            object.__setattr__(self, "budget", ratio_budget(self.name, self.budget))

    def _parts(self) -> dict:
        scorer = cache_only_scorer(self.name, self.inner)
        share = None if self.budget is None else self.budget.ratio
        return {
            "decode_eviction": TargetDecodeEviction(scorer, self.compression_interval, None, share),
            "threshold_set": base.ThresholdSet(
                self.name, THRESHOLD_NAMES, None if share is None else (share,)
            ),
        }
