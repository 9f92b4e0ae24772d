"""CAPKV as NVIDIA kvpress 0.5.5's CapPress implements it: each token past the sinks is scored
by how much of the attention output's capacity it carries, weighted by its alignment with the
prompt's queries.

Per query head: the anchor is the mean pre-RoPE query over the prompt past the first `sinks`
positions, carried by RoPE's rotation averaged over the next `future_positions` positions (as
ExpectedAttention's); w_t = exp(tau cos(anchor, k_t)) (shifted by the head's largest exponent);
with A = I + sum_t (w_t + epsilon) v_t v_t^T over the scored tokens, the score is
w_t v_t^T A^-1 v_t, averaged over the KV head's query group. The sinks are always kept. Paper
(docs/references.md): CapKV, "Rethinking KV Cache Eviction via a Unified Information-Theoretic
Objective" (arXiv:2604.25975).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, LayerView, Scorer, group_mean
from jaxkv.policies.expected_attention import average_rotation

_NORM_EPS = 1e-12  # torch.nn.functional.normalize's


def unit(x: jax.Array) -> jax.Array:
    """x over its L2 norm along the last axis (at least `_NORM_EPS`)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), _NORM_EPS)


@dataclasses.dataclass(frozen=True)
class CapacityScores(Scorer):
    """CAPKV's scores (module docstring). Attributes: as `Cap`'s."""

    sinks: int
    tau: float
    future_positions: int
    epsilon: float

    reads_values: ClassVar[bool] = True

    @property
    def query_moments_from(self) -> int:
        return self.sinks

    def layer_scores(self, view: LayerView) -> jax.Array:
        num_kv, head_dim = view.keys.shape[1], view.keys.shape[-1]
        group = view.query_mean.shape[1] // num_kv
        rotation = average_rotation(view.config, view.prompt_lengths, self.future_positions)
        anchor = jnp.einsum("bij,bnj->bni", rotation, view.query_mean, precision="highest")
        keys = jnp.repeat(unit(view.keys.astype(jnp.float32)), group, axis=1)  # [B, N, S, H]
        values = jnp.repeat(view.values.astype(jnp.float32), group, axis=1)
        alignment = jnp.einsum("bnh,bnsh->bns", unit(anchor), keys, precision="highest")
        logits = self.tau * jnp.clip(alignment, -1.0, 1.0)
        scored = jnp.repeat(view.held & (view.positions >= self.sinks), group, axis=1)
        logits = logits - jnp.max(jnp.where(scored, logits, -jnp.inf), axis=-1, keepdims=True)
        weights = jnp.where(scored, jnp.exp(logits), 0.0)
        scaled = values * jnp.sqrt(jnp.where(scored, weights + self.epsilon, 0.0))[..., None]
        capacity = jnp.eye(head_dim) + jnp.einsum(
            "bnsd,bnse->bnde", scaled, scaled, precision="highest"
        )
        solution = jnp.linalg.solve(capacity, jnp.swapaxes(values, -1, -2))  # [B, N, H, S]
        leverage = jnp.sum(jnp.swapaxes(values, -1, -2) * solution, axis=-2)  # [B, N, S]
        scores = group_mean(jnp.where(scored, weights * leverage, 0.0), num_kv)
        sinks = view.held & (view.positions < self.sinks)  # ranked first, as kvpress's max + 1
        return jnp.where(sinks, jnp.inf, scores)


@base.register
@dataclasses.dataclass(frozen=True)
class Cap(EvictionPolicy):
    """CapPress: query-aligned capacity scores (module docstring).

    Attributes:
      tau: the alignment's temperature (kvpress's default 5).
      future_positions: positions after the prompt RoPE's rotation is averaged over (512).
      epsilon: added to each weight inside the capacity matrix (1e-6).
    """

    name: ClassVar[str] = "cap"
    sinks: int = 4
    tau: float = 5.0
    future_positions: int = 512
    epsilon: float = 1e-6

    def _check(self) -> None:
        super()._check()
        if self.future_positions < 1:
            raise ValueError(f"future_positions={self.future_positions} must be >= 1")
        if self.epsilon < 0:
            raise ValueError(f"epsilon={self.epsilon} must be >= 0")

    def _scorer(self) -> CapacityScores:
        return CapacityScores(self.sinks, self.tau, self.future_positions, self.epsilon)
