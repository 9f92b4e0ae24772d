"""Compactor (kvpress's CompactorPress): approximate leverage of the keys blended with
non-causal block attention, the first and last tokens always kept.

The prompt's first `sinks` (8) and last `recent` (4) positions are kept; the positions between
them are scored as a sequence of their own:
  - leverage (`leverage.leverage_scores`): each key's leverage among that range's pre-RoPE
    keys, centred and sketched, z-scored over the row's heads;
  - non-causal attention (`noncausal.block_attention_sums`): blocks of `block_size` positions
    from the range's first, each token's probability summed over its block's queries (group
    mean), times its value norm, averaged with its two neighbours in the range (zero past its
    ends), z-scored over the row's heads;
and a token's score is blending x leverage + attention. kvpress blends with its compression
ratio by default; here `blending=None` takes 1 - (kept tokens / prompt length) per row, which
differs from the ratio by the budget's rounding (under 1 / prompt length).

Paper (docs/references.md): "Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores" (arXiv:2507.08143). As kvpress's, scoring reads the whole prompt in
one pass: a prompt longer than the prefill chunk is refused (`check_prefill`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import collectives
from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, LayerView, Scorer
from jaxkv.policies.leverage import gaussian_sketch, leverage_scores, unrotated_keys, z_scores
from jaxkv.policies.noncausal import DEFAULT_BLOCK, block_attention_sums


def scored_range(positions: jax.Array, prompt_lengths: jax.Array, sinks: int, recent: int):
    """bool [B, K, S] (or [B, C]): the positions Compactor scores, between the prompt's first
    `sinks` and last `recent` (positions [B, K, S] or [B, C], -1 for none; prompt_lengths
    int32 [B])."""
    end = prompt_lengths.reshape((-1,) + (1,) * (positions.ndim - 1)) - recent
    return (positions >= sinks) & (positions < end)


def compactor_scores(keys, in_range, attention, sketch, blending) -> jax.Array:
    """f32 [B, K, S]: blending x z(leverage) + z(neighbour-averaged attention) over the scored
    range. keys [B, K, S, H] before RoPE in position order; in_range bool [B, K, S]; attention
    f32 [B, K, S] the stored block attention x value norm (0 outside the range); sketch
    [B, K, H, k]; blending f32 [B] (or a float)."""
    leverage = z_scores(leverage_scores(keys, in_range, sketch), in_range)
    padded = jnp.pad(jnp.where(in_range, attention, 0.0), ((0, 0), (0, 0), (1, 1)))
    averaged = (padded[..., :-2] + padded[..., 1:-1] + padded[..., 2:]) / 3.0
    blending = jnp.reshape(jnp.asarray(blending, jnp.float32), (-1, 1, 1))
    return blending * leverage + z_scores(averaged, in_range)


@dataclasses.dataclass(frozen=True)
class RangeBlockAttentionGate:
    """The gate part: block attention x value norm of the scored range (module docstring),
    written with the prompt (one chunk from position 0: `Compactor.check_prefill`); 0 for any
    other token."""

    block: int
    sinks: int
    recent: int

    def write_scores(self, layer_params, *, h, q, k_unrotated, k, v, positions):
        del layer_params, h, k_unrotated
        b, num_kv, c, _ = k.shape
        if c <= self.sinks:  # a decode step or a prompt of sinks alone: nothing scored
            return jnp.zeros((b, num_kv, c), jnp.float32)
        prompt_lengths = jnp.max(positions, axis=1) + 1
        in_range = scored_range(positions, prompt_lengths, self.sinks, self.recent)
        sums = block_attention_sums(  # [B, N, C - sinks]: the blocks start at the range's first
            q[:, :, self.sinks :], k[:, :, self.sinks :], in_range[:, self.sinks :], self.block
        )
        n = sums.shape[1]
        per_kv_head = sums.reshape(b, num_kv, n // num_kv, -1).mean(axis=2)
        scores = per_kv_head * jnp.linalg.norm(v[:, :, self.sinks :].astype(jnp.float32), axis=-1)
        scores = jnp.pad(scores, ((0, 0), (0, 0), (self.sinks, 0)))
        return jnp.where(in_range[:, None, :], scores, 0.0)


@dataclasses.dataclass(frozen=True)
class CompactorScores(Scorer):
    """Compactor's scores (module docstring). Attributes: as `Compactor`'s."""

    sketch_dimension: int
    blending: float | None
    sinks: int
    recent: int

    def layer_scores(self, view: LayerView) -> jax.Array:
        in_range = scored_range(view.positions, view.prompt_lengths, self.sinks, self.recent)
        sketch = gaussian_sketch(view, self.sketch_dimension)
        keys = unrotated_keys(view.config, view.keys, view.positions)
        if self.blending is None:
            kept = view.budget_tokens / jnp.maximum(view.prompt_lengths, 1)
            blending = 1.0 - jnp.minimum(kept.astype(jnp.float32), 1.0)
        else:
            blending = self.blending

        def every_head(keys, in_range, attention):  # z-scored over every device's heads
            return compactor_scores(keys, in_range, attention, sketch, blending)

        return collectives.over_all_heads(every_head, keys, in_range, view.token_scores, axis=1)


@base.register
@dataclasses.dataclass(frozen=True)
class Compactor(EvictionPolicy):
    """CompactorPress: leverage and non-causal attention blended (module docstring).

    Attributes:
      sinks, recent: the first and last prompt positions kept and not scored (kvpress's
        sink_size_start 8, sink_size_end 4).
      block_size: positions per attention block (kvpress's chunk_size, 256).
      sketch_dimension: the leverage's Gaussian sketch width (48).
      blending: the leverage's weight; None: 1 - the share of the prompt kept.
    """

    name: ClassVar[str] = "compactor"
    sinks: int = 8
    recent: int = 4
    block_size: int = DEFAULT_BLOCK
    sketch_dimension: int = 48
    blending: float | None = None

    def _check(self) -> None:
        super()._check()
        for field in ("block_size", "sketch_dimension"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}={value!r} must be an integer >= 1")
        if self.blending is not None and not (
            isinstance(self.blending, int | float) and np.isfinite(self.blending)
        ):
            raise ValueError(f"blending={self.blending!r} must be a finite number (or None)")

    def _scorer(self) -> CompactorScores:
        return CompactorScores(self.sketch_dimension, self.blending, self.sinks, self.recent)

    def _parts(self) -> dict:
        gate = RangeBlockAttentionGate(self.block_size, self.sinks, self.recent)
        return super()._parts() | {"gate": gate}

    def check_prefill(self, prompt_lengths: np.ndarray, chunk: int) -> None:
        longest = int(np.max(prompt_lengths, initial=0))
        if longest > chunk:
            raise ValueError(
                f"policy 'compactor' scores the whole prompt in one pass: prefill_chunk={chunk} "
                f"must be at least the longest prompt ({longest} tokens)"
            )
