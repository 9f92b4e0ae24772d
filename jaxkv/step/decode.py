"""The decode step: one token per sequence through the model over the paged cache
(`read_tokens`), then the policy's decode eviction for the rows it is due (`after_decode_step`),
then each row's next token (`decode_and_sample`). Pure and jittable; the generation loop, a
session's decode, the serving engine's slots, the Conf-KV benchmark and teacher forcing share
it, each with its rows' `jaxkv.step.rows.Rows`."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxkv.attention import Backend
from jaxkv.cache import KVState
from jaxkv.cache.eviction import run_if
from jaxkv.models.decoder import Model, logits_from_hidden
from jaxkv.sampling import sample_rows
from jaxkv.step.forward import forward_cached
from jaxkv.step.parts import DecodeContext, PolicyParts
from jaxkv.step.rows import Rows


@flax.struct.dataclass
class StepContext:
    """What a decode step needs besides the KV state and the tokens.

    Attributes:
      rows: each row's state (`Rows`: its policy values, keys, step and position).
      policy_params: the policy's learned parameters (None without).
      policy: the policy (static; a `jaxkv.policies.Policy` stripped of per-request values).
      backend: the attention backend (static).
    """

    rows: Rows
    policy_params: object = None
    policy: PolicyParts = flax.struct.field(pytree_node=False, default=None)
    backend: Backend = flax.struct.field(pytree_node=False, default=Backend.XLA)


def read_tokens(
    model: Model, kv: KVState, tokens: jax.Array, positions: jax.Array, ctx: StepContext
) -> tuple[KVState, jax.Array]:
    """The reading half of a decode step: tokens int32 [B] at positions int32 [B] (-1: the row
    writes nothing) through the model over the cache (written to it as the policy admits).
    Returns (kv, logits f32 [B, V])."""
    policy, rows = ctx.policy, ctx.rows
    hidden, kv, _ = forward_cached(
        model,
        tokens[:, None],
        positions[:, None],
        kv,
        policy=policy,
        backend=ctx.backend,
        read_budget=rows.budget_tokens if policy.selection is not None else None,
        policy_params=ctx.policy_params,
        thresholds=rows.thresholds,
    )
    return kv, logits_from_hidden(model.params, model.config, hidden[:, 0])


def decode_context(ctx: StepContext, positions: jax.Array, logits: jax.Array, group_size: int):
    """The policy's `DecodeContext` of a step whose logits [B, V] are known: the rows whose
    decode eviction is due this step (`rows.steps` % its `decode_interval` == 0) keep their
    positions, the others get -1 and are left as they are."""
    rows, eviction = ctx.rows, ctx.policy.decode_eviction
    if eviction is not None:
        positions = jnp.where(rows.steps % eviction.decode_interval == 0, positions, -1)
    return DecodeContext(
        prompt_lengths=rows.prompt_lengths,
        budget_tokens=rows.budget_tokens,
        budget_ratio=rows.budget_ratio,
        thresholds=rows.thresholds,
        positions=positions,
        logits=logits,
        keys=rows.step_keys()[1],
        group_size=group_size,
    )


def after_decode_step(policy: PolicyParts, kv: KVState, ctx: DecodeContext) -> KVState:
    """The state after a decode step: the decode eviction's `on_decode` when a row is due (a
    position >= 0 in `ctx`), skipped otherwise (in place: `run_if`)."""
    eviction = policy.decode_eviction
    if eviction is None:
        return kv
    return run_if(jnp.any(ctx.positions >= 0), lambda kv: eviction.on_decode(kv, ctx), kv)


def decode_step(
    model: Model, kv: KVState, tokens: jax.Array, active: jax.Array, ctx: StepContext
) -> tuple[KVState, jax.Array]:
    """One decode step of the `active` rows (bool [B]; the others write nothing): each writes
    its newest token tokens int32 [B] at `ctx.rows.positions` (`read_tokens`), then the
    policy's decode eviction runs for the rows it is due. Returns (kv, logits f32 [B, V])."""
    positions = jnp.where(active, ctx.rows.positions, -1)
    kv, logits = read_tokens(model, kv, tokens, positions, ctx)
    decode_ctx = decode_context(ctx, positions, logits, model.config.group_size)
    return after_decode_step(ctx.policy, kv, decode_ctx), logits


def next_tokens(logits: jax.Array, rows: Rows, active: jax.Array) -> tuple[jax.Array, Rows]:
    """Each row's token sampled from logits [B, V] with its key and settings at its step, and
    the rows advanced for the `active` ones (bool [B]). Returns (tokens int32 [B], rows)."""
    tokens = sample_rows(logits, rows.step_keys()[0], rows.sampling)
    return tokens, rows.advanced(active)


def decode_and_sample(
    model: Model, kv: KVState, tokens: jax.Array, active: jax.Array, ctx: StepContext
) -> tuple[KVState, jax.Array, jax.Array, Rows]:
    """`decode_step`, then `next_tokens`: what the generation loop and the engine run each step.
    Returns (kv, logits f32 [B, V], tokens int32 [B], rows)."""
    kv, logits = decode_step(model, kv, tokens, active, ctx)
    new_tokens, rows = next_tokens(logits, ctx.rows, active)
    return kv, logits, new_tokens, rows
