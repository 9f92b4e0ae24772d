"""ExpectedAttention: the attention future queries are expected to pay each cached key.

kvpress 0.5.5's ExpectedAttentionPress ("Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution", arXiv:2510.00636). Each query head's
pre-RoPE queries over the prompt (past the first `sinks`) are fitted by a Gaussian (mean mu,
covariance S); RoPE's rotation averaged over the next `future_positions` positions, R, carries
them to where future queries will be (R mu, R S R^T). For a Gaussian query q, E[exp(q.k / sqrt(d))]
= exp(mu'.k / sqrt(d) + k^T S' k / (2 d)), so each key's score is that exponent, softmaxed over
the head's keys past the sinks, averaged over the KV head's query heads and multiplied by the
value's norm (plus `epsilon`). The sinks score +inf: always kept, alone or inside AdaKV.

`expected_attention_stats` (kvpress's ExpectedAttentionStatsPress) scores the same way from
statistics computed once on calibration text instead of the prompt's queries: its parameters
(`QueryStatistics`, `jaxkv train expected_attention_stats`) hold each query head's pre-RoPE
query mean and covariance per layer.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models import layers
from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, LayerView, Scorer, group_mean

STATISTICS = ("query_mean", "query_covariance")
STATISTICS_FILE = "statistics.npz"


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


@dataclasses.dataclass(frozen=True)
class StatisticsScores(ExpectedAttentionScores):
    """ExpectedAttention's scores from query statistics computed ahead of the prompt (the
    policy's parameters, `QueryStatistics`) instead of the prompt's own queries."""

    @property
    def query_moments_from(self) -> None:
        return None  # prefill records no query moments: the statistics are given

    def layer_scores(self, view: LayerView) -> jax.Array:
        stats, batch = view.policy_params, view.keys.shape[0]
        mean, covariance = (
            jnp.broadcast_to(stats[name].astype(jnp.float32), (batch, *stats[name].shape))
            for name in ("query_mean", "query_covariance")
        )
        return super().layer_scores(view.replace(query_mean=mean, query_covariance=covariance))


@dataclasses.dataclass(frozen=True)
class QueryStatistics(base.LearnedParams):
    """ExpectedAttention's query statistics computed on calibration text (`jaxkv train
    expected_attention_stats` writes them): {"query_mean": f32 [L, N, H], "query_covariance":
    f32 [L, N, H, H]}, each query head's pre-RoPE queries past the sinks, saved as
    `statistics.npz`."""

    kind: ClassVar[str] = "expected_attention_stats"
    description: ClassVar[str] = (
        "the query statistics (`jaxkv train expected_attention_stats` writes them)"
    )

    def init(self, model_config, key):
        """Zero means and identity covariances (untrained; plans use their shapes)."""
        del key
        cfg = model_config
        heads = (cfg.num_layers, cfg.num_heads)
        eye = jnp.eye(cfg.head_dim, dtype=jnp.float32)
        return {
            "query_mean": jnp.zeros((*heads, cfg.head_dim), jnp.float32),
            "query_covariance": jnp.broadcast_to(eye, (*heads, cfg.head_dim, cfg.head_dim)),
        }

    def load(self, path, model_config):
        """`path`: a statistics .npz file or a directory holding `statistics.npz`."""
        what = (
            "query statistics (an .npz of query_mean and query_covariance, `jaxkv train "
            "expected_attention_stats` writes one)"
        )
        with np.load(self.saved_file(path, STATISTICS_FILE, what)) as saved:
            params = {name: jnp.asarray(saved[name]) for name in STATISTICS}
        self.check(params, model_config)
        return params

    def check(self, params, model_config) -> None:
        cfg = model_config
        heads = (cfg.num_layers, cfg.num_heads, cfg.head_dim)
        expected = {"query_mean": heads, "query_covariance": (*heads, cfg.head_dim)}
        got = (
            {name: tuple(np.shape(params[name])) for name in STATISTICS if name in params}
            if isinstance(params, dict)
            else params
        )
        if got != expected:
            raise ValueError(
                f"policy 'expected_attention_stats' needs policy_params of shapes {expected} "
                f"(L, N query heads, H), got {got!r}"
            )

    def axes(self, params):
        del params
        return {
            "query_mean": ("layers", "heads", "head_dim"),
            "query_covariance": ("layers", "heads", "head_dim", "head_dim"),
        }


@base.register
@dataclasses.dataclass(frozen=True)
class ExpectedAttentionStats(ExpectedAttention):
    """ExpectedAttention with the query statistics of calibration text, as kvpress's
    ExpectedAttentionStatsPress (policy_params: `QueryStatistics`); attributes as
    `ExpectedAttention`'s."""

    name: ClassVar[str] = "expected_attention_stats"

    def _scorer(self) -> StatisticsScores:
        return StatisticsScores(
            self.sinks,
            self.future_positions,
            self.use_covariance,
            self.use_value_norm,
            self.epsilon,
        )

    def _parts(self) -> dict:
        return super()._parts() | {"params": QueryStatistics()}


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
