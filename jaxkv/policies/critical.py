"""CriticalKV and CriticalAdaKV with the semantics of NVIDIA kvpress 0.5.5's presses: an inner
scorer's ranking refined by what each token's value contributes to the layer's output.

Both select in two stages: the best `first_stage` share of the budget by the inner scores
alone, then the rest by the inner scores (+ `epsilon`) times the L1 norm of the token's value
projected by the output projection, ||v W_o^h||_1, averaged over the KV head's query heads.
CriticalAdaKV first splits the layer's budget across its heads as AdaKV does (each head keeping
at least `safeguard` of its share), then runs both stages within each head's budget; its heads
really hold different page counts (kvpress masks the evicted keys instead). The inner
compression's protected tokens (SnapKV's window) score one above the row's best, as kvpress
pads them, and are not otherwise protected: the value norm may still evict them, as in kvpress.
Paper (docs/references.md): "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective" (arXiv:2502.03805).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, keep_top_across_heads, keep_top_per_head
from jaxkv.policies import base
from jaxkv.policies.eviction import (
    EvictionPolicy,
    InnerScoredCompression,
    LayerView,
    group_mean,
    map_layers,
    protected_on_top,
    protected_slots,
)
from jaxkv.policies.structure import scoring_compression
from jaxkv.step.parts import PrefillObservations

# What kvpress writes over the tokens a stage selects: float32's largest value.
_SELECTED = float(jnp.finfo(jnp.float32).max)


def projected_value_norms(view: LayerView) -> jax.Array:
    """f32 [B, K, S]: ||v W_o^h||_1 of each cached value, per query head h of the KV head,
    averaged over those query heads."""
    values = view.values.astype(jnp.float32)
    k = values.shape[1]
    wo = view.params["wo"].astype(jnp.float32)  # [N, D, E]
    per_query_head = jnp.repeat(values, wo.shape[0] // k, axis=1)  # [B, N, S, D]
    projected = jnp.einsum("bnsd,nde->bnse", per_query_head, wo, precision="highest")
    return group_mean(jnp.sum(jnp.abs(projected), axis=-1), k)


@dataclasses.dataclass(frozen=True)
class CriticalCompression(InnerScoredCompression):
    """CriticalKV's prompt compression of an inner `ScoredCompression` (module docstring);
    `safeguard` set: CriticalAdaKV's."""

    epsilon: float
    first_stage: float
    safeguard: float | None = None

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        scorer = self.inner.scorer

        def layer(view: LayerView):
            return scorer.layer_scores(view), projected_value_norms(view)

        scores, norms = map_layers(kv, obs, model, layer, values=True)
        positions = kv.positions()
        held = positions >= 0
        protected = protected_slots(self.inner, positions, obs.prompt_lengths)
        budgets = jnp.broadcast_to(obs.budget_tokens, held.shape[:2])  # [L, B]

        def keep(scores, norms, held, protected):  # over every KV head of a layer
            return self._keep(protected_on_top(scores, held, protected), norms, held, budgets)

        return compact(kv, collectives.over_all_heads(keep, scores, norms, held, protected, axis=2))

    def _keep(self, scores, norms, held, budgets) -> jax.Array:
        """bool [L, B, K, S] for per-head budgets int32 [L, B]."""
        none = jnp.zeros_like(held)
        if self.safeguard is None:
            head_budgets = jnp.broadcast_to(budgets[..., None], held.shape[:3])
        else:
            guaranteed = jnp.floor(budgets * self.safeguard).astype(jnp.int32)
            if self.safeguard > 0:  # kvpress: at least one
                guaranteed = jnp.maximum(guaranteed, 1)
            safe = keep_top_per_head(scores, guaranteed[..., None], held, none)
            scores = jnp.where(safe, _SELECTED, scores)
            chosen = keep_top_across_heads(scores, budgets, held, none, 0.0)
            head_budgets = jnp.sum(chosen, axis=-1, dtype=jnp.int32)  # [L, B, K]
        first = jnp.floor(head_budgets * self.first_stage).astype(jnp.int32)
        if self.safeguard is None and self.first_stage > 0:
            first = jnp.maximum(first, 1)  # kvpress: at least one (CriticalAdaKV: no minimum)
        selected = keep_top_per_head(scores, first, held, none)
        scores = jnp.where(selected, _SELECTED, scores)
        return keep_top_per_head((scores + self.epsilon) * norms, head_budgets, held, none)


@dataclasses.dataclass(frozen=True)
class _Critical(base.Policy):
    """The settings CriticalKV and CriticalAdaKV share."""

    request_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    budget: base.Budget | float | int | None = None
    inner: EvictionPolicy | str = "snapkv"
    epsilon: float = 1e-4
    first_stage: float = 0.5

    def _check(self) -> None:
        super()._check()
        if self.budget is not None:
            object.__setattr__(self, "budget", base.Budget.parse(self.budget))
        if not 0.0 <= self.first_stage <= 1.0:
            raise ValueError(f"first_stage={self.first_stage} must be in [0, 1]")
        if self.epsilon < 0:
            raise ValueError(f"epsilon={self.epsilon} must be >= 0")

    def _record(self, safeguard: float | None) -> dict:
        compression = scoring_compression(self.name, self.inner)
        return {
            "prompt_compression": CriticalCompression(
                compression, self.epsilon, self.first_stage, safeguard
            ),
            "budget_rule": base.PromptBudget(
                self.name, self.budget, compression.sinks + compression.protected_recent
            ),
        }


@base.register
@dataclasses.dataclass(frozen=True)
class CriticalKV(_Critical):
    """CriticalKV: per head, the inner scores' best `first_stage` share of the budget, then the
    best by inner score times the projected value norm (module docstring).

    Attributes:
      budget: tokens kept per head: a ratio of the prompt or a token count.
      inner: the scoring eviction policy (or its name; SnapKV by default).
      epsilon: added to the inner scores before the value norm scales them.
      first_stage: the share of the budget chosen by the inner scores alone, in [0, 1].
    """

    name: ClassVar[str] = "criticalkv"

    def _parts(self) -> dict:
        return self._record(None)


@base.register
@dataclasses.dataclass(frozen=True)
class CriticalAdaKV(_Critical):
    """CriticalAdaKV: AdaKV's split of the layer's budget across its heads, then CriticalKV's
    two stages within each head's share (module docstring).

    Attributes:
      safeguard: the share of its uniform budget every head keeps at least, in [0, 1].
    """

    name: ClassVar[str] = "critical_adakv"
    decides_across_heads: ClassVar[bool] = True
    safeguard: float = 0.2

    def _check(self) -> None:
        super()._check()
        if not 0.0 <= self.safeguard <= 1.0:
            raise ValueError(f"safeguard={self.safeguard} must be in [0, 1]")

    def _parts(self) -> dict:
        return self._record(self.safeguard)
