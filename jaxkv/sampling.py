"""Token samplers: greedy, temperature, top-k and top-p, with an explicit PRNG key."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp


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

    def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """Samples int32 [B] from f32 logits [B, V]."""
        if self.greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits.astype(jnp.float32) / self.temperature
        if self.top_k is not None:
            logits = _keep_top_k(logits, self.top_k)
        if self.top_p is not None:
            logits = _keep_top_p(logits, self.top_p)
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _keep_top_k(logits: jax.Array, k: int) -> jax.Array:
    k = min(k, logits.shape[-1])
    threshold = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _keep_top_p(logits: jax.Array, top_p: float) -> jax.Array:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    kept = mass_before < top_p  # the token that crosses top_p is kept too
    threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)
