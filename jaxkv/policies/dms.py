"""DMS as NVIDIA kvpress 0.5.5's DMSPress implements it: threshold eviction outside a sliding
window, after a dense prefill and (with `decoding`) at every decode step, with a scorer in place
of the paper's trained evictors.

A token leaves the window of the newest `window` tokens; it is then kept iff its inner score is
at least `threshold` (kvpress evicts the scores below it). The share kept depends on the input:
there is no budget. kvpress masks the evicted keys in attention; jaxkv frees their pages. kvpress
scores a token once, when it is written; jaxkv scores the cache when a token leaves the window,
which is the same for a score of the token alone (Knorm's, the default); `decoding` takes only
such a scorer. Paper (docs/references.md): "Inference-Time Hyper-Scaling with KV Cache
Compression" (DMS, arXiv:2506.05345).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, evict_in_place, run_if
from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, Scorer, map_cache_layers, map_layers
from jaxkv.policies.structure import cache_only_scorer
from jaxkv.step.parts import DecodeContext, PrefillObservations

THRESHOLD_NAMES = ("threshold",)  # an array in jit: a sweep compiles once


def threshold_of(thresholds: jax.Array) -> jax.Array:
    """f32 [B, 1, 1]: each row's threshold, shaped for [B, K, S] scores."""
    return thresholds[:, THRESHOLD_NAMES.index("threshold"), None, None]


def outside_window_below(scores, positions, newest, window: int, thresholds) -> jax.Array:
    """bool [..., B, K, S]: the held tokens older than the `window` newest (the newest at
    positions `newest` int32 [B]) whose score is below the threshold."""
    outside = (positions >= 0) & (positions <= newest[:, None, None] - window)
    return outside & (scores < threshold_of(thresholds))


@dataclasses.dataclass(frozen=True)
class WindowThresholdCompression(base.PromptCompressionPart):
    """DMS's prompt compression: the prompt's tokens older than its newest `window` whose
    score is below the threshold are evicted."""

    scorer: Scorer
    window: int

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        scorer = self.scorer
        scores = map_layers(kv, obs, model, scorer.layer_scores, values=scorer.reads_values)
        positions = kv.positions()
        newest = obs.prompt_lengths - 1
        evicted = outside_window_below(scores, positions, newest, self.window, obs.thresholds)
        return compact(kv, (positions >= 0) & ~evicted)


@dataclasses.dataclass(frozen=True)
class WindowThresholdEviction:
    """DMS's decode eviction: at every step, the token leaving the window is evicted if its
    score is below the threshold (at most one token per head and step)."""

    scorer: Scorer
    window: int

    @property
    def decode_interval(self) -> int:
        return 1

    def step_record(self, logits: jax.Array) -> None:
        del logits

    def decode_tokens_bound(self, budget_tokens, prompt_lengths, max_new_tokens):
        del budget_tokens
        return np.asarray(prompt_lengths, np.int64) + max_new_tokens  # the input decides

    def on_decode(self, kv: KVState, ctx: DecodeContext) -> KVState:
        positions = kv.positions()
        leaving = (positions >= 0) & (positions == ctx.positions[None, :, None, None] - self.window)
        leaving = leaving & (ctx.positions >= 0)[None, :, None, None]

        def evict(kv: KVState) -> KVState:
            scores = map_cache_layers(
                kv, ctx.prompt_lengths, self.scorer.layer_scores, values=self.scorer.reads_values
            )
            below = leaving & (scores < threshold_of(ctx.thresholds))
            return evict_in_place(kv, (positions >= 0) & ~below, max_moves=1)

        return run_if(jnp.any(leaving), evict, kv)


@base.register
@dataclasses.dataclass(frozen=True)
class DMS(base.Policy):
    """DMSPress: threshold eviction outside a sliding window (module docstring).

    Attributes:
      threshold: tokens scoring below it are evicted once outside the window (the scale is the
        scorer's: Knorm's scores are minus key norms). A threshold: jit sees it as an array.
      inner: the cache-only scoring policy (or its name; Knorm by default).
      window: the newest tokens never evicted (kvpress's `sliding_window_size`, 128).
      decoding: evict during decode too, at every step.
    """

    name: ClassVar[str] = "dms"
    primary_knob: ClassVar[str] = "threshold"
    request_knobs: ClassVar[tuple[str, ...]] = THRESHOLD_NAMES
    threshold: float | None = None
    inner: EvictionPolicy | str = "knorm"
    window: int = 128
    decoding: bool = False

    def _check(self) -> None:
        super()._check()
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")
        inner = self.inner if isinstance(self.inner, str) else self.inner.name
        if self.decoding and inner != "knorm":
            raise ValueError(
                f"policy 'dms': decoding=true takes a score of the token alone (inner='knorm'), "
                f"not inner={inner!r}: kvpress scores each token once, when it is written"
            )

    def _parts(self) -> dict:
        scorer = cache_only_scorer(self.name, self.inner)
        values = None if self.threshold is None else (float(self.threshold),)
        record = {
            "prompt_compression": WindowThresholdCompression(scorer, self.window),
            "threshold_set": base.ThresholdSet(self.name, THRESHOLD_NAMES, values),
        }
        if self.decoding:
            record["decode_eviction"] = WindowThresholdEviction(scorer, self.window)
        return record
