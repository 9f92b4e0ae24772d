"""Conf-KV: the model's next-token confidence picks a tight or a loose budget at every step.

Each decode step: confidence c from the step's logits (normalised entropy, top-2 log-prob
margin, top probability, through a sigmoid of a weighted sum); budget B_t = tight if c >= tau
else loose; a layer holding more than B_t per head (B_t scaled by a linear pyramid when
`pyramid`) evicts its lowest-ranked tokens. Rank = alpha * mass + (1 - alpha) * recency, both
min-max normalised over the candidates (everything but the newest `protected` positions); mass
is an exponential moving average of the attention each token receives, updated by every query
(prompt queries included, in order).
Paper: "CONF-KV: Confidence-Aware KV Cache Eviction with Mixed-Precision Storage for Long-Horizon
LLM" (no arXiv id known). Formulas and defaults: docs/confkv.md, "Method" (the paper's text does
not give them).

Readings where the paper is ambiguous (docs/confkv.md):
- One ranking per layer (the paper: "for token i in layer l, attention mass is averaged over
  heads"): the mass is averaged over all the layer's query heads, and every KV head of the
  layer evicts the same positions. `per_head=True` ranks each KV head on its own (mass
  averaged over its G query heads), as this library did before.
- The threshold: c >= tau is decided on the logit, z >= logit(tau), because the f32 sigmoid
  saturates to exactly 1.0 (for z above ~17) and would make tau = 1 - tiny (or tau = 1) pass.
  So tau = 0 is always tight and tau = 1 never.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, evict_in_place, keep_top_per_head, run_if
from jaxkv.policies import base
from jaxkv.policies.eviction import check_evict_every
from jaxkv.step.parts import DecodeContext, PrefillObservations, budget_column
from jaxkv.step.rows import row_keys


class Ranking(enum.Enum):
    """How candidates are ranked. COMPOSITE is Conf-KV's (alpha = 1: attention only, alpha = 0:
    recency only); RANDOM is the paper's matched-rate ablation (same schedule, random victims)."""

    COMPOSITE = "composite"
    RANDOM = "random"


@dataclasses.dataclass(frozen=True)
class ConfidenceWeights:
    """c = sigmoid(entropy * ent + margin * log-margin + top * p1 + bias)."""

    entropy: float = 4.0
    margin: float = 1.0
    top: float = 4.0
    bias: float = -5.0


def confidence_features(logits: jax.Array):
    """(normalised entropy 1 - H/log V, log p1 - log p2, p1), each f32 [B], from logits [B, V]."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    probs = jnp.exp(log_probs)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * log_probs, 0.0), axis=-1)
    top2 = jax.lax.top_k(log_probs, 2)[0]
    normalised = 1.0 - entropy / jnp.log(logits.shape[-1])
    return normalised, top2[:, 0] - top2[:, 1], jnp.exp(top2[:, 0])


def confidence_logit(features, weights: ConfidenceWeights = ConfidenceWeights()) -> jax.Array:
    """f32 [B]: z = entropy * ent + margin * log-margin + top * p1 + bias, from the features
    (ent, margin, p1) of `confidence_features`; the confidence is sigmoid(z)."""
    ent, margin, top = (jnp.asarray(x, jnp.float32) for x in features)
    return weights.entropy * ent + weights.margin * margin + weights.top * top + weights.bias


def confidence_from_features(
    features, weights: ConfidenceWeights = ConfidenceWeights()
) -> jax.Array:
    """f32 [B] in [0, 1]: sigmoid(`confidence_logit`); increasing in each feature whose weight
    is positive (strictly in z; f32 sigmoid rounds to 1.0 for z above ~17)."""
    return jax.nn.sigmoid(confidence_logit(features, weights))


def confidence(logits: jax.Array, weights: ConfidenceWeights = ConfidenceWeights()) -> jax.Array:
    """f32 [B] in [0, 1]: the step's confidence from its next-token logits [B, V]."""
    return confidence_from_features(confidence_features(logits), weights)


def tau_logit(tau: float) -> float:
    """logit(tau) in float64 (-inf for 0, +inf for 1): c >= tau exactly when z >= logit(tau)."""
    if tau <= 0.0:
        return -math.inf
    if tau >= 1.0:
        return math.inf
    return math.log(tau) - math.log1p(-tau)


def is_confident(
    logits: jax.Array, tau: float, weights: ConfidenceWeights = ConfidenceWeights()
) -> jax.Array:
    """bool [B]: c >= tau, decided on the logit (z >= logit(tau)) rather than on the f32
    sigmoid, which rounds every z above ~17 to exactly 1.0 (c = 1 - 1e-8 would otherwise pass
    tau = 1 - 5e-9). tau = 0 is always confident, tau = 1 never (for finite logits)."""
    return confidence_logit(confidence_features(logits), weights) >= tau_logit(tau)


def pyramid_scale(num_layers: int, gamma_max: float, gamma_min: float) -> jax.Array:
    """f32 [L]: per-layer multipliers falling linearly from gamma_max to gamma_min (mean 1)."""
    if num_layers == 1:
        return jnp.ones((1,), jnp.float32)
    depth = jnp.arange(num_layers, dtype=jnp.float32) / (num_layers - 1)
    return gamma_max - (gamma_max - gamma_min) * depth


def _min_max(values, candidates):
    """Min-max normalisation over the candidate slots of each head (0 where all are equal)."""
    low = jnp.min(jnp.where(candidates, values, jnp.inf), axis=-1, keepdims=True)
    high = jnp.max(jnp.where(candidates, values, -jnp.inf), axis=-1, keepdims=True)
    spread = high - low
    return jnp.where(
        candidates & (spread > 0), (values - low) / jnp.where(spread > 0, spread, 1), 0
    )


def rank_scores(mass, positions, held, protected, alpha) -> jax.Array:
    """f32 [..., S]: alpha * norm(mass) + (1 - alpha) * norm(recency) over the candidates;
    alpha a float or an array broadcasting against [..., S]."""
    candidates = held & ~protected
    recency = positions.astype(jnp.float32)
    return alpha * _min_max(mass, candidates) + (1 - alpha) * _min_max(recency, candidates)


# Conf-KV's thresholds (its `threshold_set`): logit(tau), the ranking's alpha and the EMA's
# beta. They travel as arrays, so a sweep over any of them compiles once.
THRESHOLD_NAMES = ("tau", "alpha", "beta")


def threshold_column(thresholds: jax.Array, name: str) -> jax.Array:
    """f32 [B]: Conf-KV's threshold `name` from its `thresholds` [B, 3]."""
    return thresholds[:, THRESHOLD_NAMES.index(name)]


# The columns of its budget (its `TightLooseBudget`): the tight and the loose budget.
BUDGET_COLUMNS = ("tight", "loose")


@dataclasses.dataclass(frozen=True)
class CompositeRanking:
    """How Conf-KV evicts (both its parts): each head keeps its newest `protected` positions
    and its best others by alpha x EMA attention mass + (1 - alpha) x recency (`rank_scores`,
    alpha from the thresholds; at random for the RANDOM ablation), ranked per layer or per
    head; budgets per layer from the pyramid. Attributes: as `ConfKV`'s."""

    protected: int
    ranking: Ranking
    per_head: bool
    pyramid: bool
    gamma_max: float
    gamma_min: float

    def layer_budgets(self, budget: jax.Array, num_layers: int) -> jax.Array:
        """int32 [L, B]: budget [B] per layer (scaled by the pyramid when `pyramid`)."""
        if not self.pyramid:
            return jnp.broadcast_to(budget, (num_layers, budget.shape[0]))
        scale = pyramid_scale(num_layers, self.gamma_max, self.gamma_min)
        return jnp.round(scale[:, None] * budget[None].astype(jnp.float32)).astype(jnp.int32)

    def ranking_mass(self, kv: KVState) -> jax.Array:
        """f32 [L, B, K, S]: the attention mass the ranking reads. Per layer (the default), the
        mean over the layer's KV heads of their group means, i.e. over all its query heads:
        every eviction removes the same positions from all the layer's heads, so they hold the
        same positions in the same slots (prefill writes every token to every head)."""
        mass = kv.token_scores()
        if self.per_head:
            return mass
        layer_mean = jnp.mean(collectives.gather_heads(mass, axis=2), axis=2, keepdims=True)
        return jnp.broadcast_to(layer_mean, mass.shape)

    def evict(
        self, kv: KVState, budgets, newest_positions, keys, thresholds, max_moves=None
    ) -> KVState:
        """Each head keeps its newest `protected` positions (up to newest_positions [B]) and its
        best-ranked others (alpha: the `thresholds` column), budgets [L, B] tokens in all, when
        it holds more; in place (`evict_in_place`, up to `max_moves` moves per head) during
        decode."""
        budgets = budgets[..., None]

        def evict(kv: KVState) -> KVState:
            positions = kv.positions()
            held = positions >= 0
            newest = positions > newest_positions[None, :, None, None] - self.protected
            protected = held & newest
            if self.ranking is Ranking.RANDOM:
                heads = positions.shape[2] if self.per_head else 1
                shape = (positions.shape[0], heads, positions.shape[3])
                drawn = jax.vmap(lambda key: jax.random.uniform(key, shape), out_axes=1)(keys)
                scores = jnp.broadcast_to(drawn, positions.shape)
            else:
                mass = self.ranking_mass(kv)
                alpha = threshold_column(thresholds, "alpha")[None, :, None, None]
                scores = rank_scores(mass, positions, held, protected, alpha)
            budget = jnp.broadcast_to(budgets, kv.lengths.shape)
            keep = keep_top_per_head(scores, budget, held, protected, max_evicted=max_moves)
            return compact(kv, keep) if max_moves is None else evict_in_place(kv, keep, max_moves)

        # Every device takes the same branch: the per-layer ranking gathers across devices.
        over_budget = collectives.any_shard(jnp.any(kv.lengths > budgets))
        return run_if(over_budget, evict, kv)


@dataclasses.dataclass(frozen=True)
class LooseBudgetCompression(base.PromptCompressionPart):
    """Conf-KV's prompt compression part: after prefill, down to the loose budget (no step can
    keep more), so that the decode pool is sized by the budget and not by the prompt."""

    rank: CompositeRanking

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        del model
        loose = budget_column(obs.budget_tokens, BUDGET_COLUMNS, "loose")
        budgets = self.rank.layer_budgets(loose, kv.num_layers)
        keys = row_keys(obs.key, collectives.global_rows(obs.prompt_lengths.shape[0]))
        return self.rank.evict(kv, budgets, obs.prompt_lengths - 1, keys, obs.thresholds)


def confident_steps(logits: jax.Array, thresholds: jax.Array, weights) -> jax.Array:
    """bool [B]: c >= tau for a step's logits [B, V], as z >= the `thresholds` column (logit(tau),
    `is_confident`'s rule with tau traced)."""
    z = confidence_logit(confidence_features(logits), weights)
    return z >= threshold_column(thresholds, "tau")


@dataclasses.dataclass(frozen=True)
class ConfidenceEviction:
    """Conf-KV's decode eviction part: every `evict_every` steps each sequence evicts to its
    tight budget when the step's confidence c >= tau, else to its loose one."""

    rank: CompositeRanking
    weights: ConfidenceWeights
    evict_every: int

    @property
    def decode_interval(self) -> int:
        return self.evict_every

    def decode_tokens_bound(self, budget_tokens, prompt_lengths, max_new_tokens):
        loose = budget_column(budget_tokens, BUDGET_COLUMNS, "loose").astype(np.float64)
        scale = self.rank.gamma_max if self.rank.pyramid else 1.0
        widest = np.round(loose * scale).astype(np.int64)
        return np.minimum(widest + self.evict_every, np.asarray(prompt_lengths) + max_new_tokens)

    def step_record(self, logits: jax.Array) -> jax.Array:
        return confidence(logits, self.weights)

    def on_decode(self, kv: KVState, ctx: DecodeContext) -> KVState:
        confident = confident_steps(ctx.logits, ctx.thresholds, self.weights)
        tight, loose = (budget_column(ctx.budget_tokens, BUDGET_COLUMNS, n) for n in BUDGET_COLUMNS)
        budget = jnp.where(confident, tight, loose)
        budgets = self.rank.layer_budgets(budget, kv.num_layers)
        # Finished sequences (position -1) wrote nothing and are left as they are.
        budgets = jnp.where(ctx.positions >= 0, budgets, kv.max_tokens_per_head)
        return self.rank.evict(
            kv, budgets, ctx.positions, ctx.keys, ctx.thresholds, max_moves=self.evict_every
        )


@dataclasses.dataclass(frozen=True)
class DecayedMass(base.SummedMass):
    """Conf-KV's attention scoring part: an EMA of the attention mass with decay beta (the
    `thresholds` column)."""

    def mass_weights(self, positions: jax.Array, thresholds):
        """Sequential EMA over a chunk's queries in position order: the newest query's mass has
        weight (1 - beta), each older one a further factor beta; old scores decay by beta^n."""
        beta = threshold_column(thresholds, "beta")
        valid = positions >= 0
        newest = jnp.max(positions, axis=-1, keepdims=True)
        age = (newest - positions).astype(jnp.float32)
        weights = jnp.where(valid, (1 - beta[:, None]) * beta[:, None] ** age, 0.0)
        return beta ** jnp.sum(valid, axis=-1).astype(jnp.float32), weights


@dataclasses.dataclass(frozen=True)
class TightLooseBudget:
    """Conf-KV's budget part: (tight, loose) tokens per head, columns `BUDGET_COLUMNS`; a head
    holds at most the loose one. None in the copy jit sees."""

    tight: int | None
    loose: int | None

    columns: ClassVar[tuple[str, ...]] = BUDGET_COLUMNS

    def tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        """int32 [B, 2]: (tight, loose) per request."""
        if self.tight is None or self.loose is None:
            raise ValueError("policy 'confkv' needs tight= and loose= budgets")
        return np.tile(np.array([[self.tight, self.loose]], np.int32), (len(prompt_lengths), 1))

    def ratio(self, batch: int) -> np.ndarray:
        return np.zeros((batch,), np.float32)

    def planned(self, budget_tokens, prompt_lengths):
        loose = budget_column(np.asarray(budget_tokens), BUDGET_COLUMNS, "loose")
        return np.minimum(loose, prompt_lengths), "the loose budget"


@base.register
@dataclasses.dataclass(frozen=True)
class ConfKV(base.Policy):
    """Confidence-aware eviction: the record of a `DecayedMass` scoring, a
    `LooseBudgetCompression` and a `ConfidenceEviction`, sharing one `CompositeRanking`.

    Attributes:
      tight, loose: budgets in tokens per (layer, sequence, head) on confident / uncertain steps
        (per-request values: stripped in the copy jit sees).
      tau: confidence threshold in [0, 1], compared as z >= logit(tau) (`is_confident`):
        tau = 0 always picks the tight budget, tau = 1 never does. A threshold: it travels
        as the array logit(tau) (`thresholds`), so a tau sweep compiles once.
      protected: the newest positions never evicted (R).
      beta: EMA decay of attention mass; alpha: weight of mass against recency. Thresholds as
        tau is: they travel as arrays (`thresholds`), so a sweep over them compiles once.
      pyramid: per-layer budgets B_t * (gamma_max - (gamma_max - gamma_min) * l / (L - 1)).
      ranking: COMPOSITE, or RANDOM for the matched-rate ablation.
      evict_every: decode steps between evictions, each down to that step's budget B_t; in
        between a head holds up to that many tokens more (1: the paper's every step).
      per_head: False (the paper): one ranking per layer, the attention mass averaged over all
        its query heads, the same positions evicted from every KV head; True: each KV head
        ranks and evicts on its own, its mass averaged over its G query heads.
    """

    name: ClassVar[str] = "confkv"
    primary_knob: ClassVar[str] = "tight"
    request_knobs: ClassVar[tuple[str, ...]] = ("tight", "loose", *THRESHOLD_NAMES)
    tight: int | None = 128
    loose: int | None = 512
    tau: float | None = 0.7
    protected: int = 64
    beta: float | None = 0.9
    alpha: float | None = 0.5
    weights: ConfidenceWeights = ConfidenceWeights()
    pyramid: bool = False
    gamma_max: float = 1.5
    gamma_min: float = 0.5
    ranking: Ranking = Ranking.COMPOSITE
    evict_every: int = 32
    per_head: bool = False

    def _check(self) -> None:
        super()._check()
        object.__setattr__(self, "ranking", Ranking(self.ranking))
        check_evict_every(self.evict_every)
        if self.tau is not None and not 0.0 <= self.tau <= 1.0:  # None: static()
            raise ValueError(f"tau={self.tau} must be in [0, 1]")
        if self.beta is not None and not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta={self.beta} must be in [0, 1)")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha} must be in [0, 1]")
        if self.protected < 0:
            raise ValueError(f"protected={self.protected} must be >= 0")
        if not 0.0 <= self.gamma_min <= self.gamma_max:
            raise ValueError(
                f"gamma_min={self.gamma_min}, gamma_max={self.gamma_max}: need "
                "0 <= gamma_min <= gamma_max"
            )
        if self.tight is None or self.loose is None:
            return  # the static copy
        if self.tight > self.loose:
            raise ValueError(f"tight={self.tight} must be <= loose={self.loose}")
        smallest = self.tight * (self.gamma_min if self.pyramid else 1.0)
        if self.protected >= smallest:
            raise ValueError(
                f"protected={self.protected} must be smaller than the smallest "
                f"budget ({smallest:g} tokens)"
            )

    def _parts(self) -> dict:
        rank = CompositeRanking(
            self.protected,
            self.ranking,
            self.per_head,
            self.pyramid,
            self.gamma_max,
            self.gamma_min,
        )
        # logit(tau) from float64 (`tau_logit`: c >= tau is decided as z >= logit(tau), which
        # tells apart taus that round to 1.0 in f32).
        values = None if self.tau is None else (tau_logit(self.tau), self.alpha, self.beta)
        return {
            "attention_scoring": DecayedMass(),
            "prompt_compression": LooseBudgetCompression(rank),
            "decode_eviction": ConfidenceEviction(rank, self.weights, self.evict_every),
            "budget_rule": TightLooseBudget(self.tight, self.loose),
            "threshold_set": base.ThresholdSet(self.name, THRESHOLD_NAMES, values),
        }
