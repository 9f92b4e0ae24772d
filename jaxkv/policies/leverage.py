"""LeverageScore as NVIDIA kvpress 0.5.5's LeverageScorePress implements it: each head keeps
its keys of highest (approximate) statistical leverage, the geometric outliers among its keys.

Per head, the prompt's keys before RoPE, centred, are projected by a Gaussian sketch Phi
[H, k] (N(0, 1/k), drawn from the request's key per layer and row): X = (K - mean K) Phi. A
token's score is its leverage in X, x^T (X^T X + 0.01 I)^-1 x (kvpress's Cholesky solve with
its first jitter), clamped at 0, then z-scored over the row's heads (kvpress: over the batch
too, which is one row there), so wrappers ranking across heads (AdaKV) see kvpress's values.
Paper (docs/references.md): "Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores" (arXiv:2507.08143). The keys are the cache's, un-rotated from
their positions (kvpress recomputes them from the hidden states: the same up to rounding).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv import collectives
from jaxkv.models import layers
from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, LayerView, Scorer

JITTER = 1e-2  # kvpress's first Cholesky jitter
HIGHEST = jax.lax.Precision.HIGHEST


def unrotated_keys(config, keys: jax.Array, positions: jax.Array) -> jax.Array:
    """keys [B, K, S, H] after RoPE at positions [B, K, S] -> before it (RoPE rotated back)."""
    cos, sin = layers.rope_cos_sin(config, jnp.maximum(positions, 0))
    b, k, s, h = keys.shape
    flat = keys.astype(jnp.float32).reshape(b * k, 1, s, h)
    back = layers.apply_rope(flat, cos.reshape(b * k, s, h), -sin.reshape(b * k, s, h))
    return back.reshape(b, k, s, h)


def leverage_scores(keys: jax.Array, held: jax.Array, sketch: jax.Array) -> jax.Array:
    """f32 [B, K, S]: each held key's leverage in its head's sketched, centred keys (0 for
    slots not held). keys [B, K, S, H] (before RoPE), held bool [B, K, S], sketch [B, K, H, k]."""
    weight = held[..., None].astype(jnp.float32)
    count = jnp.maximum(jnp.sum(weight, axis=-2, keepdims=True), 1.0)
    mean = jnp.sum(keys * weight, axis=-2, keepdims=True) / count
    x = jnp.einsum("bksh,bkhj->bksj", (keys - mean) * weight, sketch, precision=HIGHEST)
    gram = jnp.einsum("bksi,bksj->bkij", x, x, precision=HIGHEST)
    gram = 0.5 * (gram + jnp.swapaxes(gram, -1, -2)) + JITTER * jnp.eye(gram.shape[-1])
    factor = jax.scipy.linalg.cho_factor(gram, lower=True)
    solved = jax.scipy.linalg.cho_solve(factor, jnp.swapaxes(x, -1, -2))  # [B, K, k, S]
    scores = jnp.sum(x * jnp.swapaxes(solved, -1, -2), axis=-1)
    return jnp.where(held, jnp.maximum(scores, 0.0), 0.0)


def z_scores(scores: jax.Array, held: jax.Array) -> jax.Array:
    """scores [B, K, S] standardised over each row's held slots (unbiased std, as torch's;
    at least 1e-6)."""
    count = jnp.sum(held, axis=(1, 2), keepdims=True)
    mean = jnp.sum(jnp.where(held, scores, 0.0), axis=(1, 2), keepdims=True) / count
    squares = jnp.sum(jnp.where(held, (scores - mean) ** 2, 0.0), axis=(1, 2), keepdims=True)
    std = jnp.sqrt(squares / jnp.maximum(count - 1, 1))
    return (scores - mean) / jnp.maximum(std, 1e-6)


def gaussian_sketch(view: LayerView, sketch_dimension: int) -> jax.Array:
    """f32 [B, K_all, H, k]: each row's Gaussian sketch N(0, 1/k) of every KV head (all
    devices'), drawn from the layer's key and the request's row index: a mesh draws the same."""
    b, k, _, h = view.keys.shape

    def row_sketch(row):
        shape = (k * collectives.head_shards(), h, sketch_dimension)
        return jax.random.normal(jax.random.fold_in(view.key, row), shape)

    return jax.vmap(row_sketch)(collectives.global_rows(b)) / sketch_dimension**0.5


@dataclasses.dataclass(frozen=True)
class LeverageScores(Scorer):
    """LeverageScore's scores (module docstring). Attributes: as `LeverageScore`'s."""

    sketch_dimension: int

    def layer_scores(self, view: LayerView) -> jax.Array:
        sketch = gaussian_sketch(view, self.sketch_dimension)
        keys = unrotated_keys(view.config, view.keys, view.positions)

        def every_head(keys, held):  # a Cholesky solve's rounding follows its batch's shape:
            # on a mesh, solved over every device's heads at once, as one device solves them
            return z_scores(leverage_scores(keys, held, sketch), held)

        return collectives.over_all_heads(every_head, keys, view.held, axis=1)


@base.register
@dataclasses.dataclass(frozen=True)
class LeverageScore(EvictionPolicy):
    """Keep each head's keys of highest approximate leverage (module docstring).

    Attributes:
      sketch_dimension: k, the Gaussian sketch's width (kvpress's default 48).
    """

    name: ClassVar[str] = "leverage"
    sketch_dimension: int = 48

    def _check(self) -> None:
        super()._check()
        if (
            isinstance(self.sketch_dimension, bool)
            or not isinstance(self.sketch_dimension, int)
            or self.sketch_dimension < 1
        ):
            raise ValueError(f"sketch_dimension={self.sketch_dimension!r} must be an integer >= 1")

    def _scorer(self) -> LeverageScores:
        return LeverageScores(self.sketch_dimension)
