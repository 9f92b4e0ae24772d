"""SimLayerKV as NVIDIA kvpress 0.5.5's SimLayerKVPress implements it: after prefill, a layer
whose last `n_last` queries put more than `lazy_threshold` of their attention on the first
`n_initial` and the newest `n_recent` keys before them is "lazy" and keeps only those tokens;
every other layer keeps the whole prompt.

The attention is the mean over the layer's query heads and the last `n_last` queries of their
softmax over the whole prompt (as SnapKV's window attention); the share is read on the keys
before those queries. A lazy layer keeps positions [0, n_initial) and the newest
`n_recent - n_last` positions, as kvpress slices them. A prompt of at most n_initial + n_recent +
n_last tokens is kept whole. The share kept depends on the input: there is no budget, and a lazy
layer really frees its pages (kvpress's cache holds the full layers beside the cut ones in one
tensor per layer too). kvpress averages the share over the batch; jaxkv decides per sequence
(they agree on one sequence, as kvpress's pipeline runs). Paper (docs/references.md):
"SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction" (arXiv:2410.13846).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact
from jaxkv.policies import base
from jaxkv.policies.eviction import LayerView, map_layers
from jaxkv.step.parts import PrefillObservations

THRESHOLD_NAMES = ("lazy_threshold",)  # an array in jit: a sweep compiles once


def sink_and_recent_share(view: LayerView, n_last: int, n_recent: int, n_initial: int):
    """f32 [B]: the share of the last `n_last` queries' attention (mean over the layer's query
    heads and those queries) on the first `n_initial` and the newest `n_recent` keys before
    them."""
    probs = view.window_probabilities()  # [B, N, w, S]
    group = probs.shape[1] // view.positions.shape[1]
    before = view.prompt_lengths[:, None, None] - n_last
    sinks = view.positions < n_initial
    recent = (view.positions >= before - n_recent) & (view.positions < before)
    counted = jnp.repeat(view.held & (sinks | recent), group, axis=1)  # [B, N, S]
    share = jnp.sum(jnp.where(counted[:, :, None], probs, 0.0), axis=(1, 2, 3))
    heads = probs.shape[1] * collectives.head_shards()
    return collectives.reduce_partial_sums(share) / (heads * n_last)


@dataclasses.dataclass(frozen=True)
class LazyLayerCompression(base.PromptCompressionPart):
    """SimLayerKV's prompt compression (module docstring): per layer and sequence, the share of
    the last `n_last` queries' attention on the sinks and the recent keys decides whether the
    layer keeps only them."""

    n_last: int
    n_recent: int
    n_initial: int

    @property
    def observation_window(self) -> int:
        return self.n_last

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        def layer_share(view: LayerView) -> jax.Array:
            return sink_and_recent_share(view, self.n_last, self.n_recent, self.n_initial)

        shares = map_layers(kv, obs, model, layer_share)  # [L, B]
        threshold = obs.thresholds[:, THRESHOLD_NAMES.index("lazy_threshold")]
        long_enough = obs.prompt_lengths > self.n_initial + self.n_recent + self.n_last
        lazy = (shares > threshold) & (threshold < 1.0) & long_enough
        positions = kv.positions()  # [L, B, K, S]
        newest = obs.prompt_lengths[:, None, None] - (self.n_recent - self.n_last)
        kept_when_lazy = (positions < self.n_initial) | (positions >= newest)
        return compact(kv, (positions >= 0) & (~lazy[..., None, None] | kept_when_lazy))


@base.register
@dataclasses.dataclass(frozen=True)
class SimLayerKV(base.Policy):
    """SimLayerKVPress: lazy layers keep their sinks and recent tokens only (module
    docstring).

    Attributes:
      lazy_threshold: a layer is lazy when that share of its attention exceeds it, in [0, 1]
        (1: none is; the paper's values: Llama-3 0.9, Llama-2 0.65, Mistral 0.8, Qwen 0.85). A
        threshold: jit sees it as an array.
      n_last: the last prompt queries whose attention decides (kvpress's default 1).
      n_recent: the recent keys counted (kvpress's default 1024); a lazy layer keeps the
        newest n_recent - n_last tokens.
      n_initial: the sink tokens counted and kept (kvpress's default 4).
    """

    name: ClassVar[str] = "simlayerkv"
    primary_knob: ClassVar[str] = "lazy_threshold"
    request_knobs: ClassVar[tuple[str, ...]] = THRESHOLD_NAMES
    lazy_threshold: float | None = None
    n_last: int = 1
    n_recent: int = 1024
    n_initial: int = 4

    def _check(self) -> None:
        super()._check()
        if self.lazy_threshold is not None and not 0.0 <= self.lazy_threshold <= 1.0:
            raise ValueError(f"lazy_threshold={self.lazy_threshold} must be in [0, 1]")
        if self.n_last < 1:
            raise ValueError(f"n_last={self.n_last} must be >= 1")
        if self.n_recent <= self.n_last:
            raise ValueError(
                f"n_recent={self.n_recent} must be > n_last={self.n_last} (a lazy layer keeps "
                "the newest n_recent - n_last tokens)"
            )
        if self.n_initial < 0:
            raise ValueError(f"n_initial={self.n_initial} must be >= 0")

    def _parts(self) -> dict:
        values = None if self.lazy_threshold is None else (float(self.lazy_threshold),)
        return {
            "prompt_compression": LazyLayerCompression(self.n_last, self.n_recent, self.n_initial),
            "threshold_set": base.ThresholdSet(self.name, THRESHOLD_NAMES, values),
        }
