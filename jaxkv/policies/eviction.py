"""Score-and-evict policies: the shared machinery every eviction policy builds on.

A policy scores each cached token of each (layer, sequence, KV head), the shared mechanism keeps
the protected tokens (sinks, recent window, observation window) plus the best-scored others up to
the budget, and `compact` frees the pages left empty.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import attention as attention_ops
from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import (
    compact,
    evict_in_place,
    keep_top_across_heads,
    keep_top_per_head,
    run_if,
)
from jaxkv.policies.base import Budget, Policy, PromptBudget, PromptCompressionPart
from jaxkv.step.parts import DecodeContext, PrefillObservations


@flax.struct.dataclass
class LayerView:
    """One layer's cache and prefill observations, as a scorer sees them (S = slots per head).

    Attributes:
      keys: [B, K, S, H] post-RoPE keys in cache order (arbitrary past each head's length).
      positions: int32 [B, K, S] original positions, -1 past each head's length.
      token_scores: f32 [B, K, S] accumulated scores (H2O), 0 past each length.
      queries: [B, N, w, H] observed queries (None when the policy observes none).
      query_positions: int32 [B, w] their positions, -1 for empty slots.
      prompt_lengths: int32 [B].
      budget_tokens: int32 [B] (or [B, n]: `PrefillObservations`) tokens kept per head (None
        in a view of the cache alone).
      input_mean, input_var: f32 [B, D] attention-input statistics (None unless requested).
      query_mean, query_covariance: f32 [B, N, H], [B, N, H, H] pre-RoPE query statistics
        (None unless requested: `PrefillObservations`).
      values: [B, K, S, H] values in cache order (None unless `map_layers` is asked for them).
      params: the layer's parameters; layer: int32 [] its index; key: PRNG key for the layer
        (params and key None in a view of the cache alone: `map_cache_layers`).
      policy_params: the layer's slice of the policy's learned parameters (None without, and
        in a view of the cache alone).
      config: the model's ModelConfig (RoPE for ExpectedAttention's future positions).
    """

    keys: jax.Array
    positions: jax.Array
    token_scores: jax.Array
    queries: jax.Array | None
    query_positions: jax.Array | None
    prompt_lengths: jax.Array
    budget_tokens: jax.Array | None
    input_mean: jax.Array | None
    input_var: jax.Array | None
    query_mean: jax.Array | None
    query_covariance: jax.Array | None
    values: jax.Array | None
    params: Any
    layer: jax.Array
    key: jax.Array
    policy_params: Any = None
    config: Any = flax.struct.field(pytree_node=False, default=None)

    @property
    def held(self) -> jax.Array:
        return self.positions >= 0

    def window_probabilities(self) -> jax.Array:
        """f32 [B, N, w, S]: each observed query's causal attention over the cached keys."""
        visible = (
            self.held[:, :, None, None, :]
            & (self.positions[:, :, None, None, :] <= self.query_positions[:, None, None, :, None])
            & (self.query_positions >= 0)[:, None, None, :, None]
        )
        sm_scale = self.keys.shape[-1] ** -0.5
        return attention_ops.attention_probabilities(self.queries, self.keys, visible, sm_scale)


def map_layers(kv: KVState, obs: PrefillObservations, model, layer_fn, *, values: bool = False):
    """Stacks `layer_fn(LayerView)` over the layers, one layer's view in memory at a time
    (with `values`, the view holds the layer's values too)."""
    observed = (obs.queries, obs.input_mean, obs.input_var, obs.query_mean, obs.query_covariance)
    query_positions = obs.query_positions() if obs.queries is not None else None
    layers = (model.params["layers"], obs.policy_params, jnp.arange(kv.num_layers))
    return _map_views(
        kv,
        layers,
        model.config,
        (obs.prompt_lengths, obs.budget_tokens),
        observed,
        query_positions,
        obs.key,
        layer_fn,
        values,
    )


def map_cache_layers(kv: KVState, prompt_lengths, layer_fn, *, values: bool = False):
    """`map_layers` over the cache alone (no observations, parameters nor key: a decode step's
    eviction by a cache-only scorer that draws nothing). prompt_lengths: int32 [B]."""
    layers = (None, None, jnp.arange(kv.num_layers))
    lengths = (prompt_lengths, None)
    return _map_views(kv, layers, None, lengths, (None,) * 5, None, None, layer_fn, values)


def _map_views(kv, layers, config, lengths, observed, query_positions, key, layer_fn, values):
    prompt_lengths, budget_tokens = lengths

    def one_layer(xs):
        page_table, lengths, observed, (params, policy_params, layer) = xs
        queries, mean, var, query_mean, query_covariance = observed
        layer_kv = dataclasses.replace(kv, page_table=page_table[None], lengths=lengths[None])
        view = LayerView(
            keys=attention_ops.gather_pages(kv.pool.k_pages, page_table),
            positions=layer_kv.positions(0),
            token_scores=layer_kv.token_scores(0),
            queries=queries,
            query_positions=query_positions,
            prompt_lengths=prompt_lengths,
            budget_tokens=budget_tokens,
            input_mean=mean,
            input_var=var,
            query_mean=query_mean,
            query_covariance=query_covariance,
            values=attention_ops.gather_pages(kv.pool.v_pages, page_table) if values else None,
            params=params,
            layer=layer,
            key=None if key is None else jax.random.fold_in(key, layer),
            policy_params=policy_params,
            config=config,
        )
        return layer_fn(view)

    return jax.lax.map(one_layer, (kv.page_table, kv.lengths, observed, layers))


def protected_on_top(scores, held, protected) -> jax.Array:
    """scores [..., B, K, S] with each protected slot scoring one above its row's best other
    score (over its layer's heads): how kvpress's presses pad the tokens they always keep
    (SnapKV's window, ExpectedAttention's sinks) for the presses that wrap them (ChunkKV,
    CriticalKV) to rank; 1 where a row protects every slot it holds (a prompt too short to
    compress). Call it over every KV head (`collectives.over_all_heads`)."""
    free = jnp.where(held & ~protected, scores, -jnp.inf)
    best = jnp.max(free, axis=(-2, -1), keepdims=True)
    return jnp.where(protected, jnp.where(jnp.isfinite(best), best + 1, 1.0), scores)


def group_mean(per_query_head: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, N, S] -> [B, K, S]: the mean over each KV head's query heads."""
    b, n, s = per_query_head.shape
    return per_query_head.reshape(b, num_kv_heads, n // num_kv_heads, s).mean(axis=2)


class Scorer(abc.ABC):
    """The scoring part a score-and-evict part holds: how each cached token of a layer ranks
    (higher is kept), what prefill observes for it and how the budget splits over layers.
    Subclasses are frozen dataclasses of the settings they read.

    Attributes:
      observation_window: how many of each prompt's last queries prefill records per layer.
      query_moments_from: the first position whose pre-RoPE query prefill adds to each head's
        query moments (ExpectedAttention); None records none.
      reads_values: whether `layer_scores` reads the layer's values (`LayerView.values`).
      cache_only: whether the scores are a function of the view's cache alone (keys, values,
        which slots are held, the layer's key), so that a run of slots scores on its own (the
        chunked and block-wise presses of `jaxkv.policies.structure`).
    """

    observation_window: ClassVar[int] = 0
    query_moments_from: ClassVar[int | None] = None
    reads_values: ClassVar[bool] = False
    cache_only: ClassVar[bool] = False

    @abc.abstractmethod
    def layer_scores(self, view: LayerView) -> jax.Array:
        """f32 [B, K, S] importance of each cached token of the view's layer."""

    def layer_budgets(self, obs: PrefillObservations, num_layers: int) -> jax.Array:
        """int32 [L, B] tokens per head in each layer; uniform by default."""
        budget_tokens = obs.budget_tokens
        return jnp.broadcast_to(budget_tokens, (num_layers, *budget_tokens.shape))

    def scores_only(self) -> Scorer:
        """This scorer as a wrapping policy reads it: its scores, with uniform layer budgets
        (kvpress's wrapping presses call their inner press's `score` alone)."""
        return self


class ObservesInner:
    """Mixin of the parts built over another (`self.inner`): prefill observes what the inner
    reads (its observation window and query moments)."""

    @property
    def observation_window(self) -> int:
        return self.inner.observation_window

    @property
    def query_moments_from(self) -> int | None:
        return self.inner.query_moments_from


@dataclasses.dataclass(frozen=True)
class InnerScorer(ObservesInner, Scorer):
    """Base of the scorers built over another (`inner`): prefill observes what the inner
    reads, and its scores and layer budgets are the inner's unless a subclass changes them."""

    inner: Scorer

    @property
    def reads_values(self) -> bool:
        return self.inner.reads_values

    @property
    def cache_only(self) -> bool:
        return self.inner.cache_only

    def layer_scores(self, view: LayerView) -> jax.Array:
        return self.inner.layer_scores(view)

    def layer_budgets(self, obs: PrefillObservations, num_layers: int) -> jax.Array:
        return self.inner.layer_budgets(obs, num_layers)


class DecodeScorer(Scorer):
    """A scorer that also ranks the cache during decode (`ScoredDecodeEviction`)."""

    @abc.abstractmethod
    def decode_scores(self, kv: KVState, positions: jax.Array) -> jax.Array:
        """f32 [L, B, K, S] importance of each cached token at a decode step."""


@dataclasses.dataclass(frozen=True)
class ScoredCompression(PromptCompressionPart):
    """The prompt compression part of a score-and-evict policy: each head keeps its protected
    tokens (the first `sinks` positions and the prompt's newest `protected_recent`) and its
    best-scored others (`scorer.layer_scores`) up to its layer's budget
    (`scorer.layer_budgets`); `compact` frees the pages left empty.

    Attributes:
      scorer: the `Scorer` that ranks the tokens; what prefill observes is its.
      sinks, protected_recent: as above.
      safeguard: None keeps the top tokens per head; a share in [0, 1] keeps them across each
        layer's heads, each head keeping at least that share of its uniform budget (AdaKV).
      reset_scores: whether the kept tokens' accumulated scores restart at 0 (Scissorhands,
        whose decode counts start after the prompt).
    """

    scorer: Scorer
    sinks: int
    protected_recent: int
    safeguard: float | None = None
    reset_scores: bool = False

    @property
    def observation_window(self) -> int:
        return self.scorer.observation_window

    @property
    def query_moments_from(self) -> int | None:
        return self.scorer.query_moments_from

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        kept = compact(kv, scored_keep_mask(self, kv, obs, model))
        return kept.with_token_scores_zeroed() if self.reset_scores else kept

    def _keep(self, scores, budgets, held, protected) -> jax.Array:
        """bool [L, B, K, S] keep-mask for budgets int32 [L, B]."""
        if self.safeguard is None:
            return keep_top_per_head(scores, budgets[..., None], held, protected)

        def keep(scores, held, protected):
            return keep_top_across_heads(scores, budgets, held, protected, self.safeguard)

        return collectives.over_all_heads(keep, scores, held, protected, axis=2)


@dataclasses.dataclass(frozen=True)
class InnerScoredCompression(ObservesInner, PromptCompressionPart):
    """Base of the prompt compressions that run over an inner score-and-evict compression
    (ChunkKV, EntropyGatedChunkKV, CriticalKV, KeyRerotation, Merging): prefill observes what
    the inner's scorer reads."""

    inner: ScoredCompression

    def _inner_scores(self, kv: KVState, obs: PrefillObservations, model):
        """(scores f32, held bool, protected bool), each [L, B, K, S]: the inner scorer's
        scores of every held slot and the slots the inner compression always keeps."""
        scorer = self.inner.scorer
        scores = map_layers(kv, obs, model, scorer.layer_scores, values=scorer.reads_values)
        positions = kv.positions()
        protected = protected_slots(self.inner, positions, obs.prompt_lengths)
        return scores, positions >= 0, protected


def scored_keep_mask(
    compression: ScoredCompression, kv: KVState, obs: PrefillObservations, model
) -> jax.Array:
    """bool [L, B, K, S]: the slots `compression` keeps (before `compact` moves them): its
    protected tokens and its scorer's best, to each layer's budget."""
    positions = kv.positions()
    protected = protected_slots(compression, positions, obs.prompt_lengths)
    scorer = compression.scorer
    scores = map_layers(kv, obs, model, scorer.layer_scores, values=scorer.reads_values)
    budgets = scorer.layer_budgets(obs, kv.num_layers)
    return compression._keep(scores, budgets, positions >= 0, protected)


def protected_slots(compression: ScoredCompression, positions, prompt_lengths) -> jax.Array:
    """bool [L, B, K, S]: the held slots a compression keeps whatever their scores (its sinks
    and each prompt's newest `protected_recent`), of positions int32 [L, B, K, S]."""
    newest = positions >= prompt_lengths[:, None, None] - compression.protected_recent
    return (positions >= 0) & ((positions < compression.sinks) | newest)


def across_heads(
    compression: ScoredCompression, *, sinks: int, recent: int, safeguard: float
) -> ScoredCompression:
    """AdaKV's prompt compression of a scorer's: the same scores (`Scorer.scores_only`) choosing
    across each layer's heads (each keeping at least `safeguard` of its share), protecting at
    least `sinks` and `recent` too."""
    return dataclasses.replace(
        compression,
        scorer=compression.scorer.scores_only(),
        sinks=max(compression.sinks, sinks),
        protected_recent=max(compression.protected_recent, recent),
        safeguard=safeguard,
    )


@dataclasses.dataclass(frozen=True)
class EvictionPolicy(Policy):
    """A scorer with the shared keep-top-k eviction: the record of a `ScoredCompression` of
    its scorer (`_scorer`, a `Scorer` of the subclass's settings) with its budget.

    Attributes:
      budget: tokens kept per (layer, sequence, KV head): a ratio of the prompt (float) or a
        count (int). Stripped (None) in the copy jit sees; the budget travels as an array.
      sinks: the first `sinks` positions are always kept.
      recent: the newest `recent` positions are always kept (with the scorer's observation
        window).
    """

    request_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    budget: Budget | float | int | None = None
    sinks: int = 0
    recent: int = 0

    def _check(self) -> None:
        super()._check()
        if self.budget is not None:
            object.__setattr__(self, "budget", Budget.parse(self.budget))
        for name in ("sinks", "recent"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    def _scorer(self) -> Scorer:
        """The scorer of this policy's settings."""
        raise NotImplementedError(f"{type(self).__name__} names no scorer")

    def _parts(self) -> dict:
        scorer = self._scorer()
        compression = ScoredCompression(
            scorer, self.sinks, max(self.recent, scorer.observation_window)
        )
        protected = compression.sinks + compression.protected_recent
        return {
            "prompt_compression": compression,
            "budget_rule": PromptBudget(self.name, self.budget, protected),
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntervalDecodeEviction:
    """Base of the decode eviction parts that run every `evict_every` decode steps down to the
    budget (a subclass says how: `on_decode`): in between a head holds up to that many tokens
    more, which the host's bound counts.

    Attributes:
      evict_every: decode steps between evictions.
      ratio: the budget's ratio of the sequence (0: a token budget), for the host's bound.
    """

    evict_every: int
    ratio: float = 0.0

    @property
    def decode_interval(self) -> int:
        return self.evict_every

    def step_record(self, logits: jax.Array) -> None:
        del logits

    def decode_tokens_bound(self, budget_tokens, prompt_lengths, max_new_tokens):
        grown = np.asarray(prompt_lengths) + max_new_tokens
        budget = np.maximum(budget_tokens, np.floor(self.ratio * grown)).astype(np.int64)
        budget = np.maximum(budget, self._protected())
        return np.minimum(budget + self.evict_every, grown)

    def _protected(self) -> int:
        """Tokens a head keeps whatever its budget."""
        return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoredDecodeEviction(IntervalDecodeEviction):
    """The decode eviction part of a score-and-evict policy: every `evict_every` decode steps
    a head holding more than its budget (`decode_budget`) evicts its lowest-scored tokens
    (`scorer.decode_scores`) down to it, never the first `sinks` positions nor the newest
    `recent`.

    Attributes:
      scorer: the `DecodeScorer` that ranks the tokens.
      sinks, recent: as above.
    """

    scorer: DecodeScorer
    sinks: int
    recent: int

    def _protected(self) -> int:
        return self.sinks + self.recent

    def on_decode(self, kv: KVState, ctx: DecodeContext) -> KVState:
        # Never below what it protects (a prompt kept whole may be shorter than that).
        budget = jnp.maximum(decode_budget(ctx), self.sinks + self.recent)[None, :, None]

        def evict(kv: KVState) -> KVState:
            positions = kv.positions()
            newest = positions > ctx.positions[None, :, None, None] - self.recent
            protected = (positions >= 0) & ((positions < self.sinks) | newest)
            budgets = jnp.broadcast_to(budget, kv.lengths.shape)
            keep = keep_top_per_head(
                self.scorer.decode_scores(kv, positions),
                budgets,
                positions >= 0,
                protected,
                max_evicted=self.evict_every,
            )
            return evict_in_place(kv, keep, max_moves=self.evict_every)

        return run_if(jnp.any(kv.lengths > budget), evict, kv)


@dataclasses.dataclass(frozen=True)
class DecodeEvictionPolicy(EvictionPolicy):
    """An eviction policy that also evicts during decode: the record of a `ScoredCompression`
    and a `ScoredDecodeEviction` of its scorer (a `DecodeScorer`).

    Every `evict_every` decode steps, a head holding more than its budget evicts down to it;
    in between it holds up to `evict_every` tokens more (the one approximation of per-step
    eviction, which `evict_every=1` restores: a compaction rewrites the cache, as costly as
    reading it, so evicting at every step would cost more than the attention it saves). The
    decode budget is the token budget, or for a ratio budget that ratio of the current length
    (a ratio keeps its share of a growing sequence: 1.0 never evicts). The protected window is
    the newest `recent` positions (plus the sinks), and the scorer's `decode_scores` ranks the
    rest.

    Attributes:
      evict_every: decode steps between evictions (>= 1).
    """

    evict_every: int = 32

    def _check(self) -> None:
        super()._check()
        check_evict_every(self.evict_every)

    def _parts(self) -> dict:
        record = super()._parts()
        budget = dataclasses.replace(record["budget_rule"], grows=True)
        ratio = float(budget.ratio(1)[0])
        return record | {
            "budget_rule": budget,
            "decode_eviction": ScoredDecodeEviction(
                scorer=record["prompt_compression"].scorer,
                sinks=self.sinks,
                recent=self.recent,
                evict_every=self.evict_every,
                ratio=ratio,
            ),
        }


def decode_budget(ctx: DecodeContext) -> jax.Array:
    """int32 [B] tokens per head allowed at this decode step: the token budget, or the ratio of
    the current length when larger; finished sequences (position -1) keep what they hold."""
    current = (ctx.positions + 1).astype(jnp.float32)
    grown = jnp.floor(ctx.budget_ratio * current).astype(jnp.int32)
    budget = jnp.maximum(ctx.budget_tokens, grown)
    return jnp.where(ctx.positions >= 0, budget, jnp.iinfo(jnp.int32).max)


def check_evict_every(evict_every) -> None:
    if isinstance(evict_every, bool) or not isinstance(evict_every, int | np.integer):
        raise ValueError(f"evict_every={evict_every!r} must be an integer >= 1")
    if evict_every < 1:
        raise ValueError(f"evict_every={evict_every} must be >= 1 (1 evicts at every step)")
