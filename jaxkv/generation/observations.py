"""What prefill carries from chunk to chunk for the policy besides the KV state: each prompt's
last hidden state, its last queries (the observation window), the moments of the attention input
and of the pre-RoPE queries; taken and put by rows (the engine's prefill rows), and turned into the
`PrefillObservations` a prompt compression reads."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jaxkv.models.decoder import Model
from jaxkv.policies import Policy
from jaxkv.step.parts import PrefillObservations, observation_window


def record_window_queries(window, queries, positions, lengths):
    """Stores the chunk's queries that fall in each prompt's last w positions.

    window [L, B, N, w, H]; queries [L, B, N, C, H]; positions [B, C] each token's index in
    its prompt (-1: none); lengths [B].
    """
    w = window.shape[3]
    slot = positions - (lengths[:, None] - w)
    slot = jnp.where((positions >= 0) & (slot >= 0), slot, w)  # w is out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
    updates = queries.transpose(1, 3, 0, 2, 4).astype(window.dtype)  # [B, C, L, N, H]
    return window.at[:, rows, :, slot].set(updates, mode="drop")


@flax.struct.dataclass
class PrefillCarry:
    """What prefill carries from chunk to chunk besides the KV state.

    Attributes:
      last_hidden: [B, D] final-normed hidden state of each prompt's last token (once seen).
      window: [L, B, N, w, H] observed queries (None unless the policy observes any).
      moments: the attention input's (count f32 [B, 1], mean, m2 f32 [L, B, D]) over the
        prompt tokens seen so far, combined chunk by chunk (None unless the policy asks).
      query_moments: the pre-RoPE queries' (count f32 [B, 1, 1], mean f32 [L, B, N, H], m2
        [L, B, N, H, H]) over the prompt tokens seen so far from the policy's
        `query_moments_from` position on (None unless the policy asks).
      hidden: [B, T_pad, D] every token's final-normed hidden state (None unless a caller of
        `read_tokens` asks for the tokens' logits).
    """

    last_hidden: jax.Array
    window: jax.Array | None
    moments: tuple[jax.Array, jax.Array, jax.Array] | None
    query_moments: tuple[jax.Array, jax.Array, jax.Array] | None
    hidden: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Observed:
    """What a prefill records for prompt compressions (static).

    Attributes:
      window: each prompt's last queries recorded per layer (0: none).
      input_stats: whether the attention input's moments are recorded.
      query_moments_from: the first position whose pre-RoPE query enters each head's moments
        (None: none recorded).
    """

    window: int = 0
    input_stats: bool = False
    query_moments_from: int | None = None


def observed_by(*policies: Policy) -> Observed:
    """What one prefill must record for each of `policies`' compressions (read once for all:
    the longest window, the moments any of them reads). Raises ValueError for two that count
    query moments from different positions."""
    compressions = [p.prompt_compression for p in policies if p.prompt_compression is not None]
    starts = {c.query_moments_from for c in compressions} - {None}
    if len(starts) > 1:
        names = [p.name for p in policies]
        raise ValueError(
            f"policies {names} record query moments from different positions {sorted(starts)}: "
            "one prefill records one, prefill them separately"
        )
    return Observed(
        window=max((observation_window(p) for p in policies), default=0),
        input_stats=any(c.needs_input_stats for c in compressions),
        query_moments_from=next(iter(starts), None),
    )


def carry_seen_by(carry: PrefillCarry, policy: Policy) -> PrefillCarry:
    """`carry`, recorded for several policies (`observed_by`), as a prefill for `policy` alone
    would have recorded it: its own last queries (the window's last slots) and moments."""
    observed = observed_by(policy)
    window = None
    if observed.window:
        window = carry.window[:, :, :, carry.window.shape[3] - observed.window :]
    return carry.replace(
        window=window,
        moments=carry.moments if observed.input_stats else None,
        query_moments=carry.query_moments if observed.query_moments_from is not None else None,
    )


def initial_carry(model: Model, batch: int, observed: Observed) -> PrefillCarry:
    """The carry of `batch` prompts before their first chunk, recording `observed`."""
    cfg = model.config
    w = observed.window
    shape = (cfg.num_layers, batch, cfg.num_heads, w, cfg.head_dim)
    zeros = jnp.zeros((cfg.num_layers, batch, cfg.hidden_size), jnp.float32)
    query_moments = None
    if observed.query_moments_from is not None:
        heads = (cfg.num_layers, batch, cfg.num_heads, cfg.head_dim)
        query_moments = (
            jnp.zeros((batch, 1, 1)),
            jnp.zeros(heads, jnp.float32),
            jnp.zeros((*heads, cfg.head_dim), jnp.float32),
        )
    return PrefillCarry(
        last_hidden=jnp.zeros((batch, cfg.hidden_size), model.dtype),
        window=jnp.zeros(shape, model.dtype) if w else None,
        moments=(jnp.zeros((batch, 1)), zeros, zeros) if observed.input_stats else None,
        query_moments=query_moments,
    )


def _carry_row_axes(carry: PrefillCarry) -> PrefillCarry:
    """The row axis of each of the carry's arrays (a carry of ints): moments are (count [B, ...],
    mean [L, B, ...], m2 [L, B, ...])."""
    moments = (0, 1, 1)
    return PrefillCarry(
        last_hidden=0,
        window=None if carry.window is None else 1,
        moments=None if carry.moments is None else moments,
        query_moments=None if carry.query_moments is None else moments,
        hidden=None if carry.hidden is None else 0,
    )


def carry_rows(carry: PrefillCarry, rows: jax.Array) -> PrefillCarry:
    """The carry of rows `rows` (int32 [R])."""
    return jax.tree.map(lambda x, axis: jnp.take(x, rows, axis=axis), carry, _carry_row_axes(carry))


def put_carry_rows(carry: PrefillCarry, rows: jax.Array, part: PrefillCarry) -> PrefillCarry:
    """`carry` with rows `rows` (int32 [R], distinct) replaced by `part`'s."""

    def put(whole, new, axis):
        return whole.at[(slice(None),) * axis + (rows,)].set(new)

    return jax.tree.map(put, carry, part, _carry_row_axes(carry))


def with_rows_reset(carry: PrefillCarry, fresh: PrefillCarry, reset: jax.Array) -> PrefillCarry:
    """`carry` with the rows where `reset` (bool [B]) is set taken from `fresh` (a request
    starting its prefill in a row another one used)."""

    def pick(old, new, axis):
        shape = [1] * old.ndim
        shape[axis] = -1
        return jnp.where(reset.reshape(shape), new, old)

    return jax.tree.map(pick, carry, fresh, _carry_row_axes(carry))


def query_moments_from(policy: Policy) -> int | None:
    compression = policy.prompt_compression
    return None if compression is None else compression.query_moments_from


def observations(
    tokens,
    lengths,
    budget_tokens,
    prompt_share,
    thresholds,
    carry: PrefillCarry,
    key,
    compression,
    policy_params,
):
    mean = var = None
    if carry.moments is not None:
        count, mean, m2 = carry.moments
        var = m2 / jnp.maximum(count - 1, 1)  # unbiased
    query_mean = query_covariance = None
    if carry.query_moments is not None:
        count, query_mean, m2 = carry.query_moments
        query_covariance = m2 / jnp.maximum(count, 1)[..., None]  # population, as kvpress
    return PrefillObservations(
        prompt_lengths=lengths,
        budget_tokens=budget_tokens,
        prompt_share=prompt_share,
        thresholds=thresholds,
        queries=carry.window,
        input_mean=mean,
        input_var=var,
        key=key,
        prompt_tokens=tokens if compression.needs_prompt_tokens else None,
        query_mean=query_mean,
        query_covariance=query_covariance,
        policy_params=policy_params,
    )
