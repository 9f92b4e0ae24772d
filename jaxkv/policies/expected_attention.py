"""ExpectedAttention: the attention future queries are expected to pay each cached key.

kvpress 0.5.5's ExpectedAttentionPress ("Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution", arXiv:2510.00636). Each query head's
pre-RoPE queries over the prompt (past the first `sinks`) are fitted by a Gaussian (mean mu,
covariance S); RoPE's rotation averaged over the next `future_positions` positions, R, carries
them to where future queries will be (R mu, R S R^T). For a Gaussian query q, E[exp(q.k / sqrt(d))]
= exp(mu'.k / sqrt(d) + k^T S' k / (2 d)), so each key's score is that exponent, softmaxed over
the head's keys past the sinks, averaged over the KV head's query heads and multiplied by the
value's norm (plus `epsilon`). The sinks score +inf: always kept, alone or inside AdaKV.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv.models import layers
from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, LayerView, Scorer, group_mean


@dataclasses.dataclass(frozen=True)
class ExpectedAttentionScores(Scorer):
    """ExpectedAttention's scores (module docstring). Attributes: as `ExpectedAttention`'s."""

    sinks: int
    future_positions: int
    use_covariance: bool
    use_value_norm: bool
    epsilon: float

    @property
    def query_moments_from(self) -> int:
        return self.sinks

    @property
    def reads_values(self) -> bool:
        return self.use_value_norm

    def layer_scores(self, view: LayerView) -> jax.Array:
        keys = view.keys.astype(jnp.float32)  # [B, K, S, H]
        _, num_kv, _, head_dim = keys.shape
        group = view.query_mean.shape[1] // num_kv
        rotation = average_rotation(view.config, view.prompt_lengths, self.future_positions)
        mean = jnp.einsum("bij,bnj->bni", rotation, view.query_mean, precision="highest")
        grouped = jnp.repeat(keys, group, axis=1)  # [B, N, S, H]
        exponent = jnp.einsum("bnsh,bnh->bns", grouped, mean, precision="highest")
        exponent = exponent / head_dim**0.5
        if self.use_covariance:
            covariance = jnp.einsum(
                "bij,bnjk,blk->bnil",
                rotation,
                view.query_covariance,
                rotation,
                precision="highest",
            )
            quadratic = jnp.einsum(
                "bnsi,bnij,bnsj->bns", grouped, covariance, grouped, precision="highest"
            )
            exponent = exponent + quadratic / head_dim / 2
        scored = jnp.repeat(view.held & (view.positions >= self.sinks), group, axis=1)
        probs = jax.nn.softmax(jnp.where(scored, exponent, -jnp.inf), axis=-1)
        scores = group_mean(jnp.where(scored, probs, 0.0), num_kv)
        if self.use_value_norm:
            norms = jnp.linalg.norm(view.values.astype(jnp.float32), axis=-1)
            scores = (scores + self.epsilon) * norms
        sinks = view.held & (view.positions < self.sinks)  # ranked first, as kvpress's max + 1,
        return jnp.where(sinks, jnp.inf, scores)  # so that a wrapper (AdaKV) keeps them too


@base.register
@dataclasses.dataclass(frozen=True)
class ExpectedAttention(EvictionPolicy):
    """Keys ranked by the attention a Gaussian fit of the prompt's queries expects for them.

    Attributes:
      future_positions: how many positions after the prompt RoPE's rotation is averaged over.
      use_covariance: add the covariance term k^T S' k / (2 d) (else the mean's term only).
      use_value_norm: multiply by the value's L2 norm.
      epsilon: added to the softmaxed score before the value norm multiplies it.
    """

    name: ClassVar[str] = "expected_attention"
    sinks: int = 4
    future_positions: int = 512
    use_covariance: bool = True
    use_value_norm: bool = True
    epsilon: float = 0.0

    def _check(self) -> None:
        super()._check()
        if self.future_positions < 1:
            raise ValueError(f"future_positions={self.future_positions} must be >= 1")
        if self.epsilon < 0:
            raise ValueError(f"epsilon={self.epsilon} must be >= 0")

    def _scorer(self) -> ExpectedAttentionScores:
        return ExpectedAttentionScores(
            self.sinks,
            self.future_positions,
            self.use_covariance,
            self.use_value_norm,
            self.epsilon,
        )


def average_rotation(cfg, prompt_lengths: jax.Array, future_positions: int) -> jax.Array:
    """f32 [B, H, H]: RoPE's rotation matrix (rotate-half layout) averaged over the positions
    prompt_length ... prompt_length + future_positions - 1 of each sequence."""
    positions = prompt_lengths[:, None] + jnp.arange(future_positions)
    cos, sin = layers.rope_cos_sin(cfg, positions)  # [B, F, H]
    mean_cos, mean_sin = cos.mean(axis=1), sin.mean(axis=1)
    half = cfg.head_dim // 2
    eye = jnp.eye(half, dtype=jnp.float32)
    zeros = jnp.zeros_like(eye)
    rotate_half = jnp.block([[zeros, -eye], [eye, zeros]])  # x -> (-x2, x1)
    return jax.vmap(jnp.diag)(mean_cos) + mean_sin[:, :, None] * rotate_half
