"""The per-row state of a decode: what one sequence carries from its set-up to its last token.

A `Rows` is made once when a request is set up (`Rows.start`) and is carried by `generate`'s
loop, a session's decode and the serving engine's slots (a slot's insert is one row update,
`Rows.insert`). Every decode step reads it the same way (`jaxkv.step.decode`): the position a
row writes, its policy values, the keys it samples and evicts with, and when its decode
eviction is due. A row's randomness is a function of its own key and step only:

    step s of a row samples with fold_in(fold_in(key, s), 0) and evicts with ... , 1)

so a request samples the same tokens alone, in a batch, on a mesh or in any engine slot.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxkv.sampling import SamplingRows


@flax.struct.dataclass
class Rows:
    """Per-row values of a decode (arrays [B, ...]; host or device).

    Attributes:
      prompt_lengths: int32 [B] tokens read before the decode (the policy's prompt).
      budget_tokens: int32 [B] (or [B, n]) tokens per head the policy may keep.
      budget_ratio: f32 [B] the budget as a share of the sequence (0 for a token budget).
      thresholds: f32 [B, n] the policy's thresholds (`Policy.thresholds`).
      keys: uint32 [B, 2] each row's PRNG key.
      steps: int32 [B] tokens sampled so far.
      positions: int32 [B] position of the newest token (the last one read, then the last one
        sampled): the token the next decode step writes.
      sampling: each row's sampler settings.
    """

    prompt_lengths: jax.Array
    budget_tokens: jax.Array
    budget_ratio: jax.Array
    thresholds: jax.Array
    keys: jax.Array
    steps: jax.Array
    positions: jax.Array
    sampling: SamplingRows

    @classmethod
    def start(
        cls,
        *,
        prompt_lengths,
        budget_tokens,
        budget_ratio,
        thresholds,
        keys,
        sampling: SamplingRows,
        steps=None,
    ) -> Rows:
        """Rows that have read their prompts (`prompt_lengths` tokens) and sampled `steps`
        tokens (default none; a request prefilled again over what it had generated keeps its
        count, and so its keys)."""
        lengths = jnp.asarray(prompt_lengths, jnp.int32)
        steps = jnp.zeros_like(lengths) if steps is None else jnp.asarray(steps, jnp.int32)
        return cls(
            prompt_lengths=lengths,
            budget_tokens=budget_tokens,
            budget_ratio=budget_ratio,
            thresholds=thresholds,
            keys=keys,
            steps=steps,
            positions=lengths - 1,
            sampling=sampling,
        )

    def step_keys(self) -> tuple[jax.Array, jax.Array]:
        """(sampling keys, policy keys) uint32 [B, 2] of each row's current step."""

        def keys(key, step):
            step_key = jax.random.fold_in(key, step)
            return jax.random.fold_in(step_key, 0), jax.random.fold_in(step_key, 1)

        return jax.vmap(keys)(self.keys, self.steps)

    def advanced(self, active: jax.Array) -> Rows:
        """After a token is sampled for the `active` rows (bool [B]): their step and newest
        position move on by one."""
        step = jnp.asarray(active, jnp.int32)
        return self.replace(steps=self.steps + step, positions=self.positions + step)

    def insert(self, slot, row: Rows) -> Rows:
        """These rows with row `slot` replaced by the one row of `row` (jittable)."""
        return jax.tree.map(lambda rows, new: rows.at[slot].set(new[0]), self, row)

    def row(self, slot) -> Rows:
        """The one-row state of row `slot` (jittable)."""
        return jax.tree.map(lambda rows: rows[slot][None], self)

    def repeated(self, batch: int) -> Rows:
        """`batch` copies of this one-row state: an engine's slots, before any insert."""
        return jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x), batch, axis=0), self)


def row_keys(key: jax.Array, rows: jax.Array) -> jax.Array:
    """uint32 [B, 2]: the key of each row of a request whose key is `key` (row b:
    `fold_in(key, b)`; rows int [B] their index in the whole request)."""
    return jax.vmap(lambda row: jax.random.fold_in(key, row))(jnp.asarray(rows, jnp.int32))
