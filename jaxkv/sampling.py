"""Token samplers: greedy, temperature, top-k and top-p, with an explicit PRNG key."""

from __future__ import annotations

import dataclasses
import math
import numbers

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Sampling settings; temperature 0 is greedy (argmax). Hashable, static under jit.

    top_k keeps the k most likely tokens; top_p keeps the smallest set whose probability reaches
    top_p (the most likely token is always kept). Both apply after the temperature.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0.0 <= t < math.inf:
            raise ValueError(f"temperature={t!r}: allowed are finite numbers >= 0 (0 = greedy)")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
            raise ValueError(f"top_k={k!r}: allowed are integers >= 1, or None for no limit")
        p = self.top_p
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < p <= 1.0
        ):
            raise ValueError(f"top_p={p!r}: allowed are numbers in (0, 1], or None for no limit")
        if self.temperature == 0 and (self.top_k is not None or self.top_p is not None):
            raise ValueError("top_k/top_p need temperature > 0 (temperature 0 is greedy)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rows(self, batch: int) -> SamplingRows:
        """These settings for each of `batch` rows (`sample_rows`' arrays, host)."""
        return SamplingRows(
            temperature=np.full((batch,), self.temperature, np.float32),
            top_k=np.full((batch,), 0 if self.top_k is None else self.top_k, np.int32),
            top_p=np.full((batch,), 2.0 if self.top_p is None else self.top_p, np.float32),
        )


@flax.struct.dataclass
class SamplingRows:
    """Each row's sampler settings (a `Sampler` per row, as arrays: rows of one batch may sample
    differently without a recompile).

    Attributes:
      temperature: f32 [B] (0: greedy).
      top_k: int32 [B] (0: no limit).
      top_p: f32 [B] (above 1: no limit).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


def sample_rows(logits: jax.Array, keys: jax.Array, settings: SamplingRows) -> jax.Array:
    """int32 [B] tokens from logits [B, V], row b with its key keys[b] and its settings (the
    `Sampler` rules: temperature first, then top-k, then top-p over what top-k kept; the most
    likely token is always kept). A step whose rows are all greedy skips the vocabulary sorts."""

    def one(row_logits, key, temperature, top_k, top_p):
        scaled = row_logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
        ranked = jnp.sort(scaled)[::-1]
        kth = ranked[jnp.clip(top_k - 1, 0, ranked.shape[0] - 1)]
        scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
        ranked = jnp.sort(scaled)[::-1]
        probs = jax.nn.softmax(ranked)
        kept = (jnp.cumsum(probs) - probs) < top_p  # the token that crosses top_p is kept too
        threshold = jnp.min(jnp.where(kept, ranked, jnp.inf))
        scaled = jnp.where((top_p <= 1.0) & (scaled < threshold), -jnp.inf, scaled)
        drawn = jax.random.categorical(key, scaled)
        return jnp.where(temperature > 0, drawn, jnp.argmax(row_logits)).astype(jnp.int32)

    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        return jax.vmap(one)(logits, keys, settings.temperature, settings.top_k, settings.top_p)

    return jax.lax.cond(jnp.any(settings.temperature > 0), sampled, greedy)
