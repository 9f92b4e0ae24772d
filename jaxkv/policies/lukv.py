"""LU-KV as NVIDIA kvpress 0.5.5's LUKVPress implements it: an inner scorer ranks each head's
tokens, and a budget curve profiled offline gives every (layer, KV head) its own share.

The curve holds, for each compression ratio 1%..99% and each layer and KV head, the share of
the prompt that head prunes. At a kept ratio r < 1 (1 keeps everything), row
round(100 (1 - r)) - 1 (clipped to 0..98) is read: each head's ideal count is
(1 - prune share) x T, the layer keeps round(sum of them) tokens (at least one a head), each
head floor(ideal) plus one for the heads of the largest fractional parts until the layer's
total is met (ties: the lower head), and at least 1. Each
head then keeps its best-ranked tokens: the first `sinks` positions and the newest `window`
first, then the inner compression's protected tokens (one above the layer's best score, as
kvpress pads them), then the inner scores (ties: the lower position).

The curve is `policy_params` (`BudgetCurve`, kvpress's [99, L, K] .npy transposed to
[L, 99, K]); its untrained value is the uniform one (every head prunes the ratio's share).
LU-KV's offline profiling (its paper's oracle importance and greedy solver over a calibration
set) is not implemented here, and kvpress downloads a curve for Llama-3.1-8B only, so jaxkv
ships none: give a curve file. Paper (docs/references.md): "Predicting Future Utility: Global
Combinatorial Optimization for Task-Agnostic KV Cache Eviction" (arXiv:2602.08585).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, rank_descending
from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, InnerScoredCompression, protected_on_top
from jaxkv.policies.expected_attention import ExpectedAttention
from jaxkv.policies.structure import SpreadShareBudget, scoring_compression
from jaxkv.step.parts import PrefillObservations

CURVE_FILE = "curve.npy"
CURVE_ROWS = 99  # compression ratios 1%..99%


def curve_row(share: float) -> int:
    """The curve's row for a kept share: kvpress's round(100 x compression ratio) - 1, clipped."""
    return max(0, min(CURVE_ROWS - 1, int(round((1.0 - share) * 100)) - 1))


def head_counts(prune_shares: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
    """int32 [L, B, K] tokens each head keeps (module docstring): prune_shares f32 [L, K] (one
    curve row), prompt_lengths int32 [B]."""
    keep = jnp.clip(1.0 - prune_shares, 0.0, 1.0)[:, None, :]  # [L, 1, K]
    lengths = prompt_lengths.astype(jnp.float32)[None, :, None]  # [1, B, 1]
    ideal = keep * lengths  # [L, B, K]
    k = ideal.shape[-1]
    total = jnp.round(jnp.sum(ideal, axis=-1, keepdims=True))
    total = jnp.clip(total, k, k * lengths)
    base_counts = jnp.floor(ideal)
    remainder = total - jnp.sum(base_counts, axis=-1, keepdims=True)
    extra = rank_descending(ideal - base_counts) < remainder
    counts = base_counts + extra
    return jnp.clip(counts, 1, lengths).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class CurveCompression(InnerScoredCompression):
    """LU-KV's prompt compression of an inner `ScoredCompression` (module docstring).

    Attributes: `share` the kept ratio (static: it picks the curve's row); `sinks`, `window`
    the positions every head keeps first.
    """

    share: float | None  # None only where `SpreadShareBudget.tokens` refuses the policy first
    sinks: int
    window: int

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        if self.share == 1.0:  # compression ratio 0: kvpress keeps everything
            return kv
        scores, held, inner_protected = self._inner_scores(kv, obs, model)
        positions = kv.positions()
        lengths = obs.prompt_lengths[:, None, None]
        own = held & ((positions < self.sinks) | (positions >= lengths - self.window))
        prune_shares = obs.policy_params["prune_shares"][:, curve_row(self.share)]  # [L, K]
        counts = head_counts(prune_shares.astype(jnp.float32), obs.prompt_lengths)

        def keep(scores, held, inner_protected, own):
            ranked = protected_on_top(scores, held, inner_protected)
            ranked = jnp.where(own, jnp.inf, jnp.where(held, ranked, -jnp.inf))
            return (rank_descending(ranked) < counts[..., None]) & held

        mask = collectives.over_all_heads(keep, scores, held, inner_protected, own, axis=2)
        return compact(kv, mask)


@dataclasses.dataclass(frozen=True)
class BudgetCurve(base.LearnedParams):
    """LU-KV's budget curve: {"prune_shares": f32 [L, 99, K]}, the share of the prompt each
    (layer, KV head) prunes at compression ratios 1%..99%; read from kvpress's layout, an
    f32 [99, L, K] .npy (`curve.npy` in a directory)."""

    kind: ClassVar[str] = "lukv"
    description: ClassVar[str] = "an LU-KV budget curve, f32 [99, L, K] .npy as LU-KV writes"

    def init(self, model_config, key):
        """The uniform curve: every head prunes the ratio's share."""
        del key
        cfg = model_config
        ratios = jnp.arange(1, CURVE_ROWS + 1, dtype=jnp.float32) / 100
        shape = (cfg.num_layers, CURVE_ROWS, cfg.num_kv_heads)
        return {"prune_shares": jnp.broadcast_to(ratios[None, :, None], shape)}

    def load(self, path, model_config):
        what = "LU-KV budget curve (an f32 [99, L, K] .npy, as LU-KV's generate_curve writes)"
        curve = np.load(self.saved_file(path, CURVE_FILE, what))
        params = {"prune_shares": jnp.asarray(np.moveaxis(curve, 0, 1), jnp.float32)}
        self.check(params, model_config)
        return params

    def check(self, params, model_config) -> None:
        cfg = model_config
        expected = (cfg.num_layers, CURVE_ROWS, cfg.num_kv_heads)
        curve = params.get("prune_shares") if isinstance(params, dict) else None
        if curve is None or tuple(np.shape(curve)) != expected:
            got = None if curve is None else tuple(np.shape(curve))
            raise ValueError(
                f"policy 'lukv' needs policy_params {{'prune_shares': f32 [L, 99, K] = "
                f"{expected}}} (kvpress's [99, L, K] curve transposed), got "
                f"{got if got is not None else params!r}"
            )

    def axes(self, params):
        del params
        return {"prune_shares": ("layers", None, None)}  # every device ranks all heads


@base.register
@dataclasses.dataclass(frozen=True)
class LUKV(base.Policy):
    """LUKVPress: an inner scorer with per-(layer, KV head) budgets from a profiled curve
    (module docstring); policy_params: the curve (`BudgetCurve`).

    Attributes:
      ratio: the share of the prompt kept over all heads, in (0, 1] (kvpress's 1 -
        compression_ratio); it picks the curve's row.
      inner: the scoring eviction policy (or its name); kvpress's default, ExpectedAttention
        with epsilon 0.02.
      sinks: the first positions every head keeps (kvpress's sink, 4).
      window: the newest positions every head keeps (kvpress's window, 1).
    """

    name: ClassVar[str] = "lukv"
    decides_across_heads: ClassVar[bool] = True

    ratio: float | None = None
    inner: EvictionPolicy | str = ExpectedAttention(epsilon=0.02)
    sinks: int = 4
    window: int = 1

    def _check(self) -> None:
        super()._check()
        if self.ratio is not None:
            base.Budget(ratio=self.ratio)  # validates (0, 1]
        for field in ("sinks", "window"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field}={value!r} must be an integer >= 0")

    def _parts(self) -> dict:
        share = None if self.ratio is None else float(self.ratio)
        inner = scoring_compression(self.name, self.inner)
        if (base.get(self.inner) if isinstance(self.inner, str) else self.inner).params:
            raise ValueError(
                f"policy 'lukv': inner={self.inner!r} has learned parameters; the curve is "
                "lukv's policy_params, so inner must score without any"
            )
        return {
            "prompt_compression": CurveCompression(inner, share, self.sinks, self.window),
            "budget_rule": SpreadShareBudget(self.name, share),
            "params": BudgetCurve(),
        }
