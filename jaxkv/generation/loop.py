"""The decode loop: the `lax.while_loop` that runs `jaxkv.step.decode.decode_step`, samples,
records and stops; before it, the compressed state moves into the decode geometry."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import collectives
from jaxkv.cache import (
    KVState,
    decode_geometry,
    int8_decode_geometry,
    keeps_prefill_pool,
    repack,
    retable,
)
from jaxkv.cache.sharing import duplicate_entries
from jaxkv.generation.mesh import MODEL, POLICY_PARAMS, ROWS, SAME, SHARD, program
from jaxkv.models.decoder import Model, logits_from_hidden
from jaxkv.policies import Policy
from jaxkv.sharding import InferenceMesh
from jaxkv.step.decode import StepContext, decode_and_sample, next_tokens
from jaxkv.step.rows import Rows


@flax.struct.dataclass
class GenState:
    """Decode-loop state.

    Attributes:
      kv: the KV state.
      context: the step's `StepContext` (its `rows`: each row's state).
      step: int32 [] tokens generated so far (every row of `generate` steps together).
      tokens: int32 [B, S] generated tokens (pad after a stop token); S is max_new_tokens
        rounded up to its bucket (`jaxkv.cache.geometry`), the loop stops at max_new_tokens.
      last_token: int32 [B] the newest token, fed to the next step.
      max_new_tokens: int32 [] steps to run (traced, so that it does not recompile).
      done: bool [B] sequence hit a stop token.
      pages_in_use: int32 [S] pages held after prefill (entry 0) and each step.
      int8_pages_in_use: int32 [S] the same for the int8 tier (0 without one).
      policy_trace: f32 [S, B] the decode eviction's `step_record` of each step's logits
        (Conf-KV: its confidence); None for policies that record none.
      listener: int32 [] the id of the host listener each step's tokens go to as they are
        sampled (`token_listener`); None when nobody streams them.
    """

    kv: KVState
    context: StepContext
    step: jax.Array
    tokens: jax.Array
    last_token: jax.Array
    max_new_tokens: jax.Array
    done: jax.Array
    pages_in_use: jax.Array
    int8_pages_in_use: jax.Array
    policy_trace: jax.Array | None
    listener: jax.Array | None = None


def _loop_step(model: Model, state: GenState, *, stop_tokens, pad_id: int) -> GenState:
    kv, logits, token, rows = decode_and_sample(
        model, state.kv, state.last_token, ~state.done, state.context
    )
    return _record(state, kv, logits, token, rows, stop_tokens, pad_id)


# Host listeners of streamed tokens, by id: the decode loop calls back with an id (an array,
# so that streaming does not recompile per listener).
_LISTENERS: dict[int, Callable] = {}


@contextlib.contextmanager
def token_listener(on_token: Callable | None):
    """The id (int32 []) of `on_token(step, tokens int32 [B], done bool [B])` while the block
    runs, called in order as the decode loop samples each step's tokens; None for None."""
    if on_token is None:
        yield None
        return
    listener = max(_LISTENERS, default=-1) + 1
    _LISTENERS[listener] = on_token
    try:
        yield np.int32(listener)
        jax.effects_barrier()  # every step delivered before the caller goes on
    finally:
        del _LISTENERS[listener]


def _deliver(listener, step, tokens, done) -> None:
    _LISTENERS[int(listener)](int(step), np.asarray(tokens), np.asarray(done))


def _record(
    state: GenState, kv: KVState, logits, token, rows: Rows, stop_tokens, pad_id: int
) -> GenState:
    token = jnp.where(state.done, pad_id, token)
    done = state.done | jnp.any(token[:, None] == stop_tokens[None, :], axis=-1)
    if state.listener is not None:
        jax.debug.callback(_deliver, state.listener, state.step, token, done, ordered=True)
    trace = state.policy_trace
    if trace is not None:
        trace = trace.at[state.step].set(_step_record(state.context.policy, logits))
    return dataclasses.replace(
        state,
        kv=kv,
        tokens=state.tokens.at[:, state.step].set(token),
        last_token=token,
        done=done,
        context=state.context.replace(rows=rows),
        step=state.step + 1,
        pages_in_use=state.pages_in_use.at[state.step].set(kv.pages_in_use()),
        int8_pages_in_use=state.int8_pages_in_use.at[state.step].set(
            0 if kv.pool.int8 is None else kv.pool.int8.pages_in_use()
        ),
        policy_trace=trace,
    )


def _step_record(policy: Policy, logits: jax.Array) -> jax.Array | None:
    """f32 [B] what the policy's decode eviction records of a step's logits [B, V]; None when
    it records nothing."""
    eviction = policy.decode_eviction
    return None if eviction is None else eviction.step_record(logits)


repack_program = program(static=("num_pages", "max_pages", "int8_geometry"), kv=SHARD)(
    repack
)  # generate then frees the prefill pool before its decode loop (`free_buffers_left_behind`)


def to_decode_geometry(
    kv: KVState,
    policy: Policy,
    *,
    budget_tokens: np.ndarray,
    lengths: np.ndarray,
    placement: InferenceMesh | None,
    num_pages: int | None,
    max_new_tokens: int,
    shared: bool = False,
) -> KVState:
    """The state in a pool sized for what it holds and will hold during `max_new_tokens` steps
    (bounded by the policy's budget where it evicts; at most `num_pages`, the request's pool);
    the same state when that is its size, and in its own pool when a repack would save at most
    half of it (`keeps_prefill_pool`). lengths: int [B] tokens read per row; shared: whether
    rows share pages (`jaxkv.cache.sharing`: a shared page is held once)."""
    bound = None
    if policy.decode_eviction is not None:  # the held counts come to the host only then
        held = _held_per_head(kv, placement)
        bound = decode_tokens_bound(policy, budget_tokens, lengths, max_new_tokens, held)
    if bound is not None and placement is not None:
        # The bound is an average over heads; a budget shared across heads may all go to
        # this device's heads.
        share = placement.model if policy.decides_across_heads else 1
        bound = placement.rows_per_device(bound) * share
    duplicates = duplicate_entries(kv.page_table, kv.pool) if shared else 0
    decode_pages, max_pages = decode_geometry(kv, max_new_tokens, bound, duplicates)
    int8_geometry, tier = None, kv.pool.int8
    if tier is not None:
        duplicates = duplicate_entries(tier.page_table, tier.pool) if shared else 0
        int8_geometry = int8_decode_geometry(kv, max_new_tokens, duplicates)
    if num_pages is not None:
        decode_pages = min(decode_pages, num_pages)
    if int8_geometry is None and (decode_pages, max_pages) == (
        kv.pool.num_pages,
        kv.page_table.shape[-1],
    ):
        return kv
    if keeps_prefill_pool(kv.pool.num_pages, decode_pages, int8=int8_geometry is not None):
        return retable(kv, max_pages=max_pages)
    return repack_program(
        placement,
        kv=kv,
        num_pages=decode_pages,
        max_pages=max_pages,
        int8_geometry=int8_geometry,
    )


def decode_tokens_bound(
    policy: Policy, budget_tokens, lengths, max_new_tokens: int, held: np.ndarray
) -> np.ndarray | None:
    """int [B]: the tokens a head of each row holds on average during `max_new_tokens` decode
    steps, by the policy's decode eviction (`decode_tokens_bound`), or what it holds now (held
    f64 [B], on average) and what arrives before its first eviction where that is more (a
    session extended past its budget: a question read over a compressed context); None for a
    policy that does not evict while decoding."""
    eviction = policy.decode_eviction
    if eviction is None:
        return None
    bound = eviction.decode_tokens_bound(budget_tokens, lengths, max_new_tokens)
    first = held + min(eviction.decode_interval, max_new_tokens)
    return np.maximum(bound, np.ceil(first).astype(np.int64))


def _held_per_head(kv: KVState, placement: InferenceMesh | None) -> np.ndarray:
    """f64 [B]: the tokens a head of each row holds in its pages now, on average over the
    layers and (every device's) KV heads."""
    if placement is None:
        held = np.asarray(jax.device_get(kv.lengths))
    else:
        held = placement.unshard(kv.lengths, row_axis=1, head_axis=2)
    return held.astype(np.float64).mean(axis=(0, 2))


def _decode_loop(
    model,
    kv,
    last_hidden,
    rows,
    max_new_tokens,
    stop_tokens,
    policy_params,
    listener,
    *,
    steps_bucket,
    policy,
    pad_id,
    backend,
) -> GenState:
    """Decodes in a `lax.while_loop` until `max_new_tokens` (traced; the per-step arrays have
    `steps_bucket` entries), all sequences stopped, or the pool overflowed; each row as its
    `rows` say (`jaxkv.step.rows.Rows`: its policy values, key and sampler). `decode_loop`
    donates `kv` (the loop updates the pool in place); `decode_loop_keeping_kv` leaves it valid
    (a session decoded again), at the cost of a copy."""
    logits = logits_from_hidden(model.params, model.config, last_hidden)
    b = last_hidden.shape[0]
    records = _step_record(policy, logits) is not None
    state = GenState(
        kv=kv,
        context=StepContext(rows=rows, policy_params=policy_params, policy=policy, backend=backend),
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.full((b, steps_bucket), pad_id, jnp.int32),
        last_token=jnp.zeros((b,), jnp.int32),
        max_new_tokens=max_new_tokens,
        done=jnp.zeros((b,), bool),
        pages_in_use=jnp.zeros((steps_bucket,), jnp.int32),
        int8_pages_in_use=jnp.zeros((steps_bucket,), jnp.int32),
        policy_trace=jnp.zeros((steps_bucket, b), jnp.float32) if records else None,
        listener=listener,
    )
    token, rows = next_tokens(logits, rows, jnp.ones((b,), bool))
    state = _record(state, kv, logits, token, rows, stop_tokens, pad_id)

    def keep_going(state: GenState):
        # Every device of a mesh runs the same number of steps (the steps hold collectives).
        finished = collectives.all_shards(jnp.all(state.done))
        overflow = collectives.any_shard(state.kv.pool.overflow)
        return (state.step < state.max_new_tokens) & ~finished & ~overflow

    step = functools.partial(_loop_step, model, stop_tokens=stop_tokens, pad_id=pad_id)
    state = jax.lax.while_loop(keep_going, step, state)
    return state.replace(context=state.context.replace(policy_params=None))  # not an output


_DECODE_PLACEMENTS = dict(
    model=MODEL,
    kv=SHARD,
    last_hidden=SHARD,
    rows=ROWS,
    max_new_tokens=SAME,
    stop_tokens=SAME,
    policy_params=POLICY_PARAMS,
    listener=SAME,
)
_DECODE_STATIC = ("steps_bucket", "policy", "pad_id", "backend")
decode_loop = program(static=_DECODE_STATIC, donate=("kv",), **_DECODE_PLACEMENTS)(_decode_loop)
decode_loop_keeping_kv = program(static=_DECODE_STATIC, **_DECODE_PLACEMENTS)(_decode_loop)
