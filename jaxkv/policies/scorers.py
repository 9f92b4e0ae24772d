"""The standard eviction baselines, with the semantics of NVIDIA kvpress 0.5.5's presses.

StreamingLLM, SnapKV, PyramidKV, TOVA, Knorm, H2O, ObservedAttention and the AdaKV wrapper. All
share the budget, protection and compaction of `EvictionPolicy`; each only says how it scores.
Papers (docs/references.md): StreamingLLM "Efficient Streaming Language Models with Attention
Sinks" (arXiv:2309.17453); SnapKV "SnapKV: LLM Knows What You are Looking for Before
Generation" (arXiv:2404.14469); PyramidKV "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling" (arXiv:2406.02069); TOVA "Transformers are Multi-State RNNs"
(arXiv:2401.06104); H2O "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models" (arXiv:2306.14048); AdaKV "Ada-KV: Optimizing KV Cache Eviction by Adaptive
Budget Allocation for Efficient LLM Inference" (arXiv:2407.11550); Knorm "A Simple and Effective
L2 Norm-Based Strategy for KV Cache Compression" (arXiv:2406.11430). ObservedAttention (H2O's
attention averaged over the queries that saw each key) is kvpress's ObservedAttentionPress.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.policies import base
from jaxkv.policies.eviction import (
    DecodeEvictionPolicy,
    DecodeScorer,
    EvictionPolicy,
    LayerView,
    ScoredCompression,
    Scorer,
    across_heads,
    group_mean,
)


@dataclasses.dataclass(frozen=True)
class PositionScores(DecodeScorer):
    """The newest positions rank first, in prefill and decode (StreamingLLM's window)."""

    def layer_scores(self, view: LayerView) -> jax.Array:
        return view.positions.astype(jnp.float32)

    def decode_scores(self, kv: KVState, positions: jax.Array) -> jax.Array:
        return positions.astype(jnp.float32)


@base.register
@dataclasses.dataclass(frozen=True)
class StreamingLLM(DecodeEvictionPolicy):
    """Attention sinks plus the most recent tokens; the window slides during decode."""

    name: ClassVar[str] = "streaming_llm"
    sinks: int = 4

    def _scorer(self) -> PositionScores:
        return PositionScores()


@base.register
@dataclasses.dataclass(frozen=True)
class SlidingWindow(StreamingLLM):
    """The most recent tokens only (StreamingLLM without sinks)."""

    name: ClassVar[str] = "sliding_window"
    sinks: int = 0


@dataclasses.dataclass(frozen=True)
class WindowAttentionScores(Scorer):
    """SnapKV's scores: the mean attention of the prompt's last `window` queries to each key
    before them, average-pooled over `kernel` positions, averaged over the KV head's group."""

    window: int
    kernel: int

    @property
    def observation_window(self) -> int:
        return self.window

    def layer_scores(self, view: LayerView) -> jax.Array:
        probs = view.window_probabilities().sum(axis=2) / self.window  # [B, N, S]
        group = probs.shape[1] // view.positions.shape[1]
        # Pooling sees only the keys before the window (kvpress scores the window apart).
        before_window = view.held & (
            view.positions < view.prompt_lengths[:, None, None] - self.window
        )
        probs = jnp.where(jnp.repeat(before_window, group, axis=1), probs, 0.0)
        pooled = (
            jax.lax.reduce_window(
                probs,
                0.0,
                jax.lax.add,
                (1, 1, self.kernel),
                (1, 1, 1),
                ((0, 0), (0, 0), (self.kernel // 2, self.kernel // 2)),
            )
            / self.kernel
        )
        return group_mean(pooled, view.keys.shape[1])


@base.register
@dataclasses.dataclass(frozen=True)
class SnapKV(EvictionPolicy):
    """Mean attention of the last `window` queries, average-pooled, averaged over the group.

    The observation window itself is always kept.
    """

    name: ClassVar[str] = "snapkv"
    window: int = 64
    kernel: int = 5

    def _check(self) -> None:
        super()._check()
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel={self.kernel} must be a positive odd number")

    def _scorer(self) -> WindowAttentionScores:
        return WindowAttentionScores(self.window, self.kernel)


@dataclasses.dataclass(frozen=True)
class PyramidScores(WindowAttentionScores):
    """SnapKV's scores with PyramidKV's per-layer budgets (`pyramid_budgets`)."""

    beta: float

    def layer_budgets(self, obs, num_layers: int) -> jax.Array:
        # b: a share's unrounded r T (its budget_tokens are its floor, or the whole of a prompt
        # too short to compress), else the token budget. Where no pyramid fits, kvpress keeps
        # round(b), not the floor.
        tokens = obs.budget_tokens
        b = jnp.maximum(obs.prompt_share * obs.prompt_lengths, tokens.astype(jnp.float32))
        uniform = jnp.maximum(tokens, jnp.round(b).astype(jnp.int32))
        return pyramid_budgets(b, uniform, obs.prompt_lengths, num_layers, self.window, self.beta)

    def scores_only(self) -> WindowAttentionScores:
        return WindowAttentionScores(self.window, self.kernel)


@base.register
@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV scores with per-layer budgets falling linearly with depth (kvpress's formula).

    With per-head budget b, prompt length T and window w: min = b / beta, max = 2b - min (capped
    at T - w), layer l keeps round(max - l (max - min) / (L - 1)); when T >= max >= min >= w does
    not hold, every layer keeps b (SnapKV). A budget given as a share r of the prompt is
    b = r T unrounded, as kvpress takes T (1 - compression_ratio), and rounded where every
    layer keeps it.
    """

    name: ClassVar[str] = "pyramidkv"
    beta: float = 20.0

    def _check(self) -> None:
        super()._check()
        if self.beta < 1:
            raise ValueError(f"beta={self.beta} must be >= 1")

    def _scorer(self) -> PyramidScores:
        return PyramidScores(self.window, self.kernel, self.beta)


def pyramid_budgets(b, uniform, prompt_lengths, num_layers: int, window: int, beta: float):
    """int32 [L, B] per-layer budgets (see PyramidKV) from f32 [B] `b` (the budget, unrounded);
    every layer keeps `uniform` (int32 [B]) where no pyramid fits."""
    t = prompt_lengths.astype(jnp.float32)
    min_num = b / beta
    max_num = 2 * b - min_num
    capped = max_num >= t - window
    max_num = jnp.where(capped, t - window, max_num)
    min_num = jnp.where(capped, 2 * b - max_num, min_num)
    valid = (t >= max_num) & (max_num >= min_num) & (min_num >= window)
    steps = (max_num - min_num) / max(num_layers - 1, 1)
    layer = jnp.arange(num_layers, dtype=jnp.float32)[:, None]
    pyramid = jnp.round(max_num - layer * steps).astype(jnp.int32)
    return jnp.where(valid, pyramid, uniform[None]).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class LastQueryScores(Scorer):
    """TOVA's scores: the last query's attention averaged over all query heads, one ranking
    for every KV head."""

    observation_window: ClassVar[int] = 1

    def layer_scores(self, view: LayerView) -> jax.Array:
        last = collectives.gather_heads(view.window_probabilities()[:, :, 0], axis=1)  # [B, N, S]
        return jnp.broadcast_to(last.mean(axis=1, keepdims=True), view.positions.shape)


@base.register
@dataclasses.dataclass(frozen=True)
class TOVA(EvictionPolicy):
    """The last query's attention averaged over all query heads: one ranking for every head."""

    name: ClassVar[str] = "tova"

    def _scorer(self) -> LastQueryScores:
        return LastQueryScores()


@dataclasses.dataclass(frozen=True)
class KeyNormScores(Scorer):
    """Knorm's scores: the smaller a key's L2 norm, the higher it ranks."""

    cache_only: ClassVar[bool] = True

    def layer_scores(self, view: LayerView) -> jax.Array:
        return -jnp.linalg.norm(view.keys.astype(jnp.float32), axis=-1)


@base.register
@dataclasses.dataclass(frozen=True)
class Knorm(EvictionPolicy):
    """Keep the keys with the smallest L2 norm."""

    name: ClassVar[str] = "knorm"

    def _scorer(self) -> KeyNormScores:
        return KeyNormScores()


@dataclasses.dataclass(frozen=True)
class HeldMassScores(DecodeScorer):
    """H2O's scores: the attention each token has received (its `token_scores`, accumulated
    by the policy's attention scoring), in prefill and decode."""

    def layer_scores(self, view: LayerView) -> jax.Array:
        return view.token_scores

    def decode_scores(self, kv: KVState, positions: jax.Array) -> jax.Array:
        return kv.token_scores()


@base.register
@dataclasses.dataclass(frozen=True)
class H2O(DecodeEvictionPolicy):
    """Heavy hitters: attention received, summed over every query, averaged over the group.

    Prefill scores come from accumulating the attention of every prompt query; during decode the
    new queries keep adding to them and a head over its budget evicts its lowest-scored tokens
    (outside the sinks and the `recent` window).
    """

    name: ClassVar[str] = "h2o"

    def _scorer(self) -> HeldMassScores:
        return HeldMassScores()

    def _parts(self) -> dict:
        return super()._parts() | {"attention_scoring": base.SummedMass()}


@dataclasses.dataclass(frozen=True)
class ObservedMassScores(Scorer):
    """ObservedAttention's scores: the attention received, averaged over the prompt's queries
    that can see the key."""

    def layer_scores(self, view: LayerView) -> jax.Array:
        seen_by = view.prompt_lengths[:, None, None] - view.positions
        return view.token_scores / jnp.maximum(seen_by, 1)


@base.register
@dataclasses.dataclass(frozen=True)
class ObservedAttention(EvictionPolicy):
    """Attention received, averaged over the queries that can see the key (prefill only)."""

    name: ClassVar[str] = "observed_attention"

    def _scorer(self) -> ObservedMassScores:
        return ObservedMassScores()

    def _parts(self) -> dict:
        return super()._parts() | {"attention_scoring": base.SummedMass()}


@base.register
@dataclasses.dataclass(frozen=True)
class AdaKV(base.Policy):
    """Any scorer with AdaKV's non-uniform head budgets.

    The layer keeps K x budget tokens chosen across its heads by score, each head keeping at least
    `safeguard` of its uniform share; heads that keep fewer tokens hold fewer pages.
    `inner` is a scorer policy or its registered name (its budget is this policy's). AdaKV's
    record is the inner policy's with its prompt compression choosing across heads
    (`across_heads`: the inner's scores, sinks, windows and score reset, not its per-layer
    budgets, which kvpress's AdaKVPress does not read either,
    with AdaKV's own sinks and recent window added); every other part is the inner policy's as
    it is: its attention scoring and its decode eviction (H2O's, StreamingLLM's window).

    Attributes:
      budget, sinks, recent: as `EvictionPolicy`'s.
      inner: the scoring eviction policy (or its name).
      safeguard: the share of its uniform budget every head keeps at least, in [0, 1].
    """

    name: ClassVar[str] = "adakv"
    decides_across_heads: ClassVar[bool] = True
    request_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    budget: base.Budget | float | int | None = None
    sinks: int = 0
    recent: int = 0
    inner: EvictionPolicy | str = "snapkv"
    safeguard: float = 0.2

    def _check(self) -> None:
        super()._check()
        if self.budget is not None:
            object.__setattr__(self, "budget", base.Budget.parse(self.budget))
        for name in ("sinks", "recent"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        inner = base.get(self.inner) if isinstance(self.inner, str) else self.inner
        if (
            not isinstance(inner, EvictionPolicy)
            or type(inner.prompt_compression) is not ScoredCompression
        ):
            raise ValueError(
                f"inner={self.inner!r} must be a scoring eviction policy (its prompt compression "
                "a ScoredCompression: not adakv itself, nor sage_kv's own split)"
            )
        object.__setattr__(self, "inner", dataclasses.replace(inner, budget=self.budget))
        if not 0.0 <= self.safeguard <= 1.0:
            raise ValueError(f"safeguard={self.safeguard} must be in [0, 1]")

    def _parts(self) -> dict:
        record = {field: getattr(self.inner, field) for field in base.RECORD}
        compression = across_heads(
            self.inner.prompt_compression,
            sinks=self.sinks,
            recent=self.recent,
            safeguard=self.safeguard,
        )
        protected = compression.sinks + compression.protected_recent
        budget = dataclasses.replace(record["budget_rule"], owner=self.name, protected=protected)
        return record | {"prompt_compression": compression, "budget_rule": budget}
