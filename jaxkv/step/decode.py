"""The decode step: one token per sequence through the model over the paged cache
(`read_tokens`), then the policy's decode eviction on the steps it is due (`after_decode_step`).
Pure and jittable; the generation loop, the serving engine, the Conf-KV benchmark and teacher
forcing share it."""

from __future__ import annotations

import flax.struct
import jax

from jaxkv.attention import Backend
from jaxkv.cache import KVState
from jaxkv.cache.eviction import run_if
from jaxkv.models.decoder import Model, logits_from_hidden
from jaxkv.step.forward import forward_cached
from jaxkv.step.parts import DecodeContext, PolicyParts


@flax.struct.dataclass
class StepContext:
    """What a decode step needs besides the KV state and the tokens.

    Attributes:
      prompt_lengths: int32 [B].
      budget_tokens: int32 [B] (or [B, n]) tokens per head the policy may keep.
      budget_ratio: f32 [B] the budget as a ratio of the sequence (0 for a token budget).
      thresholds: f32 [B, n] the policy's thresholds (`Policy.thresholds`).
      key: the request's PRNG key; step s draws from `fold_in(key, s)` (`step_keys`).
      step: int32 [] tokens generated before this step.
      policy_params: the policy's learned parameters (None without).
      policy: the policy (static; a `jaxkv.policies.Policy` stripped of per-request values).
      backend: the attention backend (static).
    """

    prompt_lengths: jax.Array
    budget_tokens: jax.Array
    budget_ratio: jax.Array
    thresholds: jax.Array
    key: jax.Array
    step: jax.Array
    policy_params: object = None
    policy: PolicyParts = flax.struct.field(pytree_node=False, default=None)
    backend: Backend = flax.struct.field(pytree_node=False, default=Backend.XLA)


def step_keys(ctx: StepContext) -> tuple[jax.Array, jax.Array]:
    """(sampling key, policy key) of the step: `fold_in(fold_in(key, step), 0 / 1)`."""
    step_key = jax.random.fold_in(ctx.key, ctx.step)
    return jax.random.fold_in(step_key, 0), jax.random.fold_in(step_key, 1)


def read_tokens(
    model: Model, kv: KVState, tokens: jax.Array, positions: jax.Array, ctx: StepContext
) -> tuple[KVState, jax.Array]:
    """The reading half of a decode step: tokens int32 [B] at positions int32 [B] (-1: the row
    writes nothing) through the model over the cache (written to it as the policy admits).
    Returns (kv, logits f32 [B, V])."""
    policy = ctx.policy
    hidden, kv, _ = forward_cached(
        model,
        tokens[:, None],
        positions[:, None],
        kv,
        policy=policy,
        backend=ctx.backend,
        read_budget=ctx.budget_tokens if policy.selection is not None else None,
        policy_params=ctx.policy_params,
        thresholds=ctx.thresholds,
    )
    return kv, logits_from_hidden(model.params, model.config, hidden[:, 0])


def decode_context(ctx: StepContext, positions: jax.Array, logits: jax.Array, group_size: int):
    """The policy's `DecodeContext` of a step whose logits [B, V] are known."""
    return DecodeContext(
        prompt_lengths=ctx.prompt_lengths,
        budget_tokens=ctx.budget_tokens,
        budget_ratio=ctx.budget_ratio,
        thresholds=ctx.thresholds,
        positions=positions,
        logits=logits,
        key=step_keys(ctx)[1],
        step=ctx.step,
        group_size=group_size,
    )


def after_decode_step(policy: PolicyParts, kv: KVState, ctx: DecodeContext) -> KVState:
    """The state after a decode step: the decode eviction's `on_decode` on the steps it is due
    (ctx.step % `decode_interval` == 0), skipped on the others (in place: `run_if`)."""
    eviction = policy.decode_eviction
    if eviction is None:
        return kv
    due = ctx.step % eviction.decode_interval == 0
    return run_if(due, lambda kv: eviction.on_decode(kv, ctx), kv)


def decode_step(
    model: Model, kv: KVState, tokens: jax.Array, positions: jax.Array, ctx: StepContext
) -> tuple[KVState, jax.Array]:
    """One decode step: `read_tokens` (tokens int32 [B] at positions int32 [B], -1: the row
    writes nothing), then the policy's decode eviction on the steps
    it is due. Returns (kv, logits f32 [B, V]). Pure and jittable; the generation loop, the
    Conf-KV benchmark and teacher forcing share it."""
    kv, logits = read_tokens(model, kv, tokens, positions, ctx)
    decode_ctx = decode_context(ctx, positions, logits, model.config.group_size)
    return after_decode_step(ctx.policy, kv, decode_ctx), logits
