"""Jitted generation over the paged KV state: chunked prefill, policy compression, decode loop."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import collectives, sharding
from jaxkv.attention import Backend, resolve_backend
from jaxkv.cache import KVState, decode_geometry, int8_decode_geometry, repack
from jaxkv.cache.config import CacheConfig, check_count
from jaxkv.cache.geometry import decode_steps_bucket, pool_pages_bucket, table_pages_bucket
from jaxkv.cache.int8 import start_int8
from jaxkv.cache.repack import grow
from jaxkv.forward import combine_moments, forward_cached
from jaxkv.models.configs import ModelConfig
from jaxkv.models.decoder import Model, logits_from_hidden
from jaxkv.pallas_kernels.common import next_power_of_two
from jaxkv.policies import FullCache, Policy, from_spec
from jaxkv.policies.base import (
    DecodeContext,
    PolicyParams,
    PrefillObservations,
    after_decode_step,
)
from jaxkv.sampling import Sampler
from jaxkv.sharding import InferenceMesh

DEFAULT_PREFILL_CHUNK = 512
# Chunks shorter than this are not bucketed further (a prompt's chunk is a power of two >= it).
MIN_PREFILL_CHUNK = 16

# One prompt of token ids, or a batch: lists of ids, or an integer array [T] or [B, T].
PromptIds = Sequence[int] | Sequence[Sequence[int]] | np.ndarray | jax.Array


@flax.struct.dataclass
class GenState:
    """Decode-loop state.

    Attributes:
      kv: the KV state.
      tokens: int32 [B, S] generated tokens (pad after a stop token); S is max_new_tokens
        rounded up to its bucket (`jaxkv.cache.geometry`), the loop stops at max_new_tokens.
      last_token: int32 [B] the newest token, fed to the next step.
      prompt_lengths: int32 [B].
      budget_tokens: int32 [B] (or [B, n]) tokens per head the policy may keep.
      budget_ratio: f32 [B] the budget as a ratio of the sequence (0 for a token budget).
      max_new_tokens: int32 [] steps to run (traced, so that it does not recompile).
      done: bool [B] sequence hit a stop token.
      step: int32 [] tokens generated so far.
      pages_in_use: int32 [S] pages held after prefill (entry 0) and each step.
      int8_pages_in_use: int32 [S] the same for the int8 tier (0 without one).
      confidence: f32 [S, B] the policy's `step_confidence` of each step's logits (Conf-KV);
        None for policies that read none.
      key: PRNG key.
    """

    kv: KVState
    tokens: jax.Array
    last_token: jax.Array
    prompt_lengths: jax.Array
    budget_tokens: jax.Array
    budget_ratio: jax.Array
    max_new_tokens: jax.Array
    done: jax.Array
    step: jax.Array
    pages_in_use: jax.Array
    int8_pages_in_use: jax.Array
    confidence: jax.Array | None
    key: jax.Array


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Result of `generate` (host arrays).

    Attributes:
      tokens: int32 [B, max_new_tokens]; positions after a sequence's stop token hold pad_id.
      num_tokens: int32 [B] tokens generated per sequence (the stop token included).
      pages_in_use: int32 [steps] pages held after prefill and after each decode step (of the
        model-dtype pool).
      int8_pages_in_use: int32 [steps] the same of the int8 tier (0 without int8 storage).
      memory_bytes: int64 [steps] the bytes all those pages hold (and the int8 channel scales,
        and the local ring of ring policies).
      confidence: f32 [steps, B] the policy's confidence of the logits each token was sampled
        from (Conf-KV, with its weights); None for policies that read none.
      state: the final KV state; on a mesh, every device's state stacked on a leading axis
        [S] (`jaxkv.sharding`: shard s holds data shard s // model, model shard s % model).
    """

    tokens: np.ndarray
    num_tokens: np.ndarray
    pages_in_use: np.ndarray
    int8_pages_in_use: np.ndarray
    memory_bytes: np.ndarray
    confidence: np.ndarray | None
    state: KVState


@dataclasses.dataclass(frozen=True)
class _Prompts:
    tokens: np.ndarray  # int32 [B, T_pad], right-padded; T_pad = chunk * a power of two
    lengths: np.ndarray  # int32 [B]
    chunk: int
    num_chunks: int  # chunks that hold a prompt token (the rest of T_pad is never run)


def _prompt_lists(prompts) -> list[list[int]]:
    """One prompt (token ids) or a batch (lists, or an int array [T] / [B, T]) as lists."""
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], str)
    ):
        raise ValueError(
            "prompt_ids must be token ids, not text: encode the prompt first "
            "(e.g. models.load_tokenizer(path).encode(text))"
        )
    if isinstance(prompts, np.ndarray | jax.Array):
        prompts = np.asarray(prompts)
        if prompts.ndim == 1:
            prompts = prompts[None]
        if prompts.ndim != 2:
            raise ValueError(f"prompt_ids has shape {prompts.shape}: expected [T] or [B, T]")
        if not np.issubdtype(prompts.dtype, np.integer):
            raise ValueError(f"prompt_ids has dtype {prompts.dtype}: token ids are integers")
        return [list(row) for row in prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompt_ids must be a non-empty list of token ids or of token-id lists")
    if all(isinstance(t, int | np.integer) for t in prompts):
        return [list(prompts)]
    return [_token_row(i, row) for i, row in enumerate(prompts)]


PROMPT_FORMS = (
    "give one prompt as token ids [T] or a batch as lists of token ids [B][T] "
    "(lists, or an int array of shape [T] or [B, T])"
)


def _nested(value) -> bool:
    """Whether `value` holds values itself: a list, tuple or array of >= 1 dimension (a string
    is left to the dtype check)."""
    if isinstance(value, str):
        return False
    return isinstance(value, Sequence) or getattr(value, "ndim", 0) > 0


def _token_row(index: int, row) -> list:
    """Batch entry `index` as a list of token ids; ValueError naming the allowed shapes for a
    scalar beside lists or a list nested one level too deep."""
    if not _nested(row):
        raise ValueError(f"prompt_ids[{index}] is {row!r}, beside lists: {PROMPT_FORMS}")
    ids = list(np.asarray(row)) if isinstance(row, np.ndarray | jax.Array) else list(row)
    deeper = next((t for t in ids if _nested(t)), None)
    if deeper is not None:
        raise ValueError(
            f"prompt_ids[{index}] holds {type(deeper).__name__} entries where token ids belong "
            f"(nested one level too deep): {PROMPT_FORMS}"
        )
    return ids


def _pad_prompts(prompts: list[list[int]], lengths: np.ndarray, prefill_chunk: int) -> _Prompts:
    """Right-pads validated prompts. The chunk is a power of two (>= 16) when the prompts are
    shorter than `prefill_chunk`; the padded length is the chunk times a power of two."""
    prefill_chunk = check_count("prefill_chunk", prefill_chunk, 1)
    longest = int(lengths.max())
    chunk = min(prefill_chunk, max(MIN_PREFILL_CHUNK, next_power_of_two(longest)))
    num_chunks = -(-longest // chunk)
    tokens = np.zeros((len(prompts), chunk * next_power_of_two(num_chunks)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return _Prompts(tokens=tokens, lengths=lengths, chunk=chunk, num_chunks=num_chunks)


def _prompt_lengths(model: Model, prompts: list[list[int]]) -> np.ndarray:
    lengths = np.array([len(p) for p in prompts], np.int32)
    if np.any(lengths == 0):
        raise ValueError(
            f"prompt {int(np.argmin(lengths))} is empty: every prompt needs >= 1 token"
        )
    vocab = model.config.vocab_size
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt {i} holds {ids.dtype} values: token ids are integers")
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={vocab})")
    return lengths


def _full_cache_pages(
    cfg: ModelConfig, lengths: np.ndarray, reserve_tokens: int, page_size: int
) -> int:
    """Pages a keep-everything cache needs for these prompts and `reserve_tokens` more each."""
    per_head = -(-(lengths + reserve_tokens) // page_size)
    return int(cfg.num_layers * cfg.num_kv_heads * per_head.sum())


def _device_shares(
    model: Model, lengths: np.ndarray, placement: InferenceMesh | None
) -> list[tuple[ModelConfig, np.ndarray]]:
    """(model config, prompt lengths) of each device's share of a request: its heads and rows
    (the whole request on one device; one entry per data shard on a mesh)."""
    if placement is None:
        return [(model.config, lengths)]
    cfg = placement.local_config(model.config)
    return [(cfg, lengths[rows]) for rows in placement.row_groups(len(lengths))]


def _create_state(
    model: Model,
    prompts: _Prompts,
    reserve_tokens: int,
    positions_after_prompt: int,
    policy: Policy,
    cache: CacheConfig,
    placement: InferenceMesh | None,
) -> KVState:
    """The empty prefill state (on a mesh: each device's, stacked); `num_pages` is per device."""
    cfg = model.config
    page_size, num_pages = cache.page_size, cache.num_pages
    longest = int(prompts.lengths.max())
    if longest + positions_after_prompt > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt length {longest} + {positions_after_prompt} new tokens = "
            f"{longest + positions_after_prompt} exceeds the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    dtype = cache.dtype_for(model.dtype)
    shares = _device_shares(model, prompts.lengths, placement)
    full_need = max(
        _full_cache_pages(local_cfg, lengths, reserve_tokens, page_size)
        for local_cfg, lengths in shares
    )
    if num_pages is None:
        needs = []
        for local_cfg, lengths in shares:
            # A budget shared across heads may all go to this device's heads.
            bound_cfg = cfg if policy.decides_across_heads else local_cfg
            bound = policy.prefill_pages(
                lengths, prompts.chunk, bound_cfg, page_size, reserve_tokens
            )
            full = _full_cache_pages(local_cfg, lengths, reserve_tokens, page_size)
            needs.append(full if bound is None else min(bound, full))
        num_pages = pool_pages_bucket(max(needs), page_size)
    elif isinstance(policy, FullCache) and num_pages < full_need:
        raise ValueError(
            f"num_pages={num_pages} is too small: the full cache needs {full_need} "
            f"pages of {page_size} tokens for these prompts"
            + ("" if placement is None else " on the fullest device")
        )
    table_pages = table_pages_bucket(-(-(longest + reserve_tokens) // page_size))
    local_cfg, lengths = shares[0]
    geometry = dict(
        num_layers=cfg.num_layers,
        batch=len(lengths),
        num_kv_heads=local_cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_tokens=table_pages * page_size,
        page_size=page_size,
        num_pages=num_pages,
        dtype=dtype,
        key_bounds=policy.selects_pages,
        local_window=policy.local_window,
    )
    if placement is None:
        return KVState.create(**geometry)
    return placement.run(KVState.create, (), (), geometry)


def _record_window_queries(window, queries, positions, lengths):
    """Stores the chunk's queries that fall in each prompt's last w positions.

    window [L, B, N, w, H]; queries [L, B, N, C, H]; positions [B, C]; lengths [B].
    """
    w = window.shape[3]
    slot = positions - (lengths[:, None] - w)
    slot = jnp.where((positions >= 0) & (slot >= 0), slot, w)  # w is out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)
    updates = queries.transpose(1, 3, 0, 2, 4).astype(window.dtype)  # [B, C, L, N, H]
    return window.at[:, rows, :, slot].set(updates, mode="drop")


@flax.struct.dataclass
class _PrefillCarry:
    """What prefill carries from chunk to chunk besides the KV state.

    Attributes:
      last_hidden: [B, D] final-normed hidden state of each prompt's last token (once seen).
      window: [L, B, N, w, H] observed queries (None unless the policy observes any).
      moments: the attention input's (count f32 [B, 1], mean, m2 f32 [L, B, D]) over the
        prompt tokens seen so far, combined chunk by chunk (None unless the policy asks).
    """

    last_hidden: jax.Array
    window: jax.Array | None
    moments: tuple[jax.Array, jax.Array, jax.Array] | None


def _empty_carry(model: Model, batch: int, policy: Policy) -> _PrefillCarry:
    cfg = model.config
    w = policy.observation_window
    shape = (cfg.num_layers, batch, cfg.num_heads, w, cfg.head_dim)
    zeros = jnp.zeros((cfg.num_layers, batch, cfg.hidden_size), jnp.float32)
    return _PrefillCarry(
        last_hidden=jnp.zeros((batch, cfg.hidden_size), model.dtype),
        window=jnp.zeros(shape, model.dtype) if w else None,
        moments=(jnp.zeros((batch, 1)), zeros, zeros) if policy.needs_input_stats else None,
    )


def _prefill_span(
    model: Model,
    tokens,
    lengths,
    first_chunk,
    end_chunk,
    budget_tokens,
    kv: KVState,
    carry: _PrefillCarry,
    policy_params,
    *,
    chunk: int,
    policy: Policy,
    backend: Backend,
):
    """Prefills chunks [first_chunk, end_chunk) (traced) of tokens [B, T_pad]; the padded tail
    past the last prompt token is never run, so a prompt-length bucket costs no compute.
    Returns (kv, carry)."""
    w = policy.observation_window

    def step(index, state):
        kv, carry = state
        start = index * chunk
        chunk_tokens = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        token_index = start + jnp.arange(chunk)
        positions = jnp.where(token_index < lengths[:, None], token_index, -1)
        hidden, kv, collected = forward_cached(
            model,
            chunk_tokens,
            positions,
            kv,
            policy=policy,
            backend=backend,
            collect_queries=w > 0,
            collect_input_stats=carry.moments is not None,
            policy_params=policy_params,
        )
        seen = jnp.minimum(start + chunk, lengths)
        kv = policy.after_prefill_chunk(
            kv, seen=seen, prompt_lengths=lengths, budget_tokens=budget_tokens
        )
        is_last = token_index == lengths[:, None] - 1
        picked = jnp.einsum("bc,bcd->bd", is_last.astype(hidden.dtype), hidden)
        last_hidden = jnp.where(jnp.any(is_last, axis=1)[:, None], picked, carry.last_hidden)
        window, moments = carry.window, carry.moments
        if w:
            window = _record_window_queries(window, collected["queries"], positions, lengths)
        if moments is not None:
            count = jnp.sum(positions >= 0, axis=1, keepdims=True).astype(jnp.float32)
            moments = combine_moments(
                *moments, count, collected["input_mean"], collected["input_m2"]
            )
        return kv, _PrefillCarry(last_hidden=last_hidden, window=window, moments=moments)

    initial = collectives.varying_like((kv, carry), tokens)  # on a mesh: as the step's output
    return jax.lax.fori_loop(first_chunk, end_chunk, step, initial)


def _compress(
    model, tokens, lengths, budget_tokens, kv, carry: _PrefillCarry, key, *, policy, int8_window
):
    """The policy's compression from what prefill observed, then (with int8 storage, window
    `int8_window` not None) every head's tokens but the newest `int8_window` move to int8.
    Returns (kv, last_hidden)."""
    mean = var = None
    if carry.moments is not None:
        count, mean, m2 = carry.moments
        var = m2 / jnp.maximum(count - 1, 1)  # unbiased
    obs = PrefillObservations(
        prompt_lengths=lengths,
        budget_tokens=budget_tokens,
        queries=carry.window,
        input_mean=mean,
        input_var=var,
        key=key,
        prompt_tokens=tokens if policy.needs_prompt_tokens else None,
    )
    kv = policy.compress(kv, obs, model)
    if int8_window is not None:
        kv = start_int8(kv, int8_window)
    return kv, carry.last_hidden


@functools.partial(
    jax.jit, static_argnames=("chunk", "policy", "int8_window", "backend"), donate_argnames=("kv",)
)
def _prefill_compressed(
    model,
    tokens,
    lengths,
    num_chunks,
    budget_tokens,
    kv,
    key,
    policy_params,
    *,
    chunk,
    policy,
    int8_window,
    backend,
):
    """Chunked prefill of every chunk, then `_compress`; donates `kv`."""
    carry = _empty_carry(model, tokens.shape[0], policy)
    kv, carry = _prefill_span(
        model,
        tokens,
        lengths,
        0,
        num_chunks,
        budget_tokens,
        kv,
        carry,
        policy_params,
        chunk=chunk,
        policy=policy,
        backend=backend,
    )
    return _compress(
        model,
        tokens,
        lengths,
        budget_tokens,
        kv,
        carry,
        key,
        policy=policy,
        int8_window=int8_window,
    )


# The growing path (`Policy.prefill_pool_grows`): one chunk per call, the pool checked between.
_prefill_span_jit = jax.jit(
    _prefill_span, static_argnames=("chunk", "policy", "backend"), donate_argnames=("kv", "carry")
)
_compress_jit = jax.jit(
    _compress, static_argnames=("policy", "int8_window"), donate_argnames=("kv",)
)
_grow_jit = jax.jit(grow, static_argnames=("num_pages",))
_empty_carry_jit = jax.jit(_empty_carry, static_argnames=("batch", "policy"))


def _call(jitted, placement: InferenceMesh | None, kinds: tuple[str, ...], *args, **statics):
    """`jitted(*args, **statics)` on one device, or its function as a sharded program on the
    mesh (`InferenceMesh.run`: `kinds` says how each argument is split)."""
    if placement is None:
        return jitted(*args, **statics)
    return placement.run(jitted.__wrapped__, kinds, args, statics)


def _prefill_growing(model, request: _Request, key, policy_params, backend: Backend):
    """Chunked prefill for a policy that admits an unknown share of the prompt: the pool starts
    at the policy's guess and, before each chunk, grows (x2, bucketed) when fewer pages are
    free than the chunk could need, so that it holds what is admitted plus about one chunk.
    On a mesh every device's pool has the same size: the fullest device decides."""
    prompts, policy, placement = request.prompts, request.policy.static(), request.placement
    kv = request.kv
    local_cfg, rows = _device_shares(model, prompts.lengths, placement)[0]
    heads = local_cfg.num_layers * local_cfg.num_kv_heads * len(rows)
    chunk_need = heads * (-(-prompts.chunk // kv.pool.page_size) + 1)
    carry = _call(_empty_carry_jit, placement, ("model",), model, batch=len(rows), policy=policy)
    span_kinds = ("model", "rows", "rows", "same", "same", "rows", "donate", "donate", "params")
    for index in range(prompts.num_chunks):
        kv.check()
        free = int(np.min(sharding.to_host(kv.pool.allocator.num_free)))
        if free < chunk_need:
            in_use = kv.pool.num_pages - free
            wanted = max(2 * kv.pool.num_pages, in_use + chunk_need)
            num_pages = pool_pages_bucket(wanted, kv.pool.page_size)
            kv = _call(_grow_jit, placement, ("shard",), kv, num_pages=num_pages)
        kv, carry = _call(
            _prefill_span_jit,
            placement,
            span_kinds,
            model,
            prompts.tokens,
            prompts.lengths,
            np.int32(index),
            np.int32(index + 1),
            request.budget_tokens,
            kv,
            carry,
            policy_params,
            chunk=prompts.chunk,
            policy=policy,
            backend=backend,
        )
    return _call(
        _compress_jit,
        placement,
        ("model", "rows", "rows", "rows", "donate", "shard", "same"),
        model,
        prompts.tokens,
        prompts.lengths,
        request.budget_tokens,
        kv,
        carry,
        key,
        policy=policy,
        int8_window=request.cache.int8_window,
    )


def _decode_step(
    model: Model,
    policy_params,
    state: GenState,
    *,
    policy: Policy,
    sampler: Sampler,
    stop_tokens,
    pad_id: int,
    backend: Backend,
) -> GenState:
    positions = jnp.where(state.done, -1, state.prompt_lengths + state.step - 1)
    hidden, kv, _ = forward_cached(
        model,
        state.last_token[:, None],
        positions[:, None],
        state.kv,
        policy=policy,
        backend=backend,
        read_budget=state.budget_tokens if policy.selects_pages else None,
        policy_params=policy_params,
    )
    logits = logits_from_hidden(model.params, model.config, hidden[:, 0])
    step_key = jax.random.fold_in(state.key, state.step)
    ctx = DecodeContext(
        prompt_lengths=state.prompt_lengths,
        budget_tokens=state.budget_tokens,
        budget_ratio=state.budget_ratio,
        positions=positions,
        logits=logits,
        key=jax.random.fold_in(step_key, 1),
        step=state.step,
        group_size=model.config.group_size,
    )
    kv = after_decode_step(policy, kv, ctx)
    token = _sample(sampler, logits, jax.random.fold_in(step_key, 0))
    return _record(state, kv, logits, token, stop_tokens, pad_id, policy)


def _sample(sampler: Sampler, logits: jax.Array, key: jax.Array) -> jax.Array:
    """int32 [B] tokens from logits [B, V]; row b draws with `fold_in(key, b)` (b: its row in
    the whole request), so sampled tokens do not depend on the batch's split over a mesh."""
    if sampler.greedy:
        return sampler(logits, key)
    row_keys = jax.vmap(lambda row: jax.random.fold_in(key, row))(
        collectives.global_rows(logits.shape[0])
    )
    return jax.vmap(lambda row_logits, row_key: sampler(row_logits[None], row_key)[0])(
        logits, row_keys
    )


def _record(
    state: GenState, kv: KVState, logits, token, stop_tokens, pad_id: int, policy: Policy
) -> GenState:
    token = jnp.where(state.done, pad_id, token)
    done = state.done | jnp.any(token[:, None] == stop_tokens[None, :], axis=-1)
    confidence = state.confidence
    if confidence is not None:
        confidence = confidence.at[state.step].set(policy.step_confidence(logits))
    return dataclasses.replace(
        state,
        kv=kv,
        tokens=state.tokens.at[:, state.step].set(token),
        last_token=token,
        done=done,
        step=state.step + 1,
        pages_in_use=state.pages_in_use.at[state.step].set(kv.pages_in_use()),
        int8_pages_in_use=state.int8_pages_in_use.at[state.step].set(
            0 if kv.pool.int8 is None else kv.pool.int8.pages_in_use()
        ),
        confidence=confidence,
    )


@functools.partial(jax.jit, static_argnames=("num_pages", "max_pages", "int8_geometry"))
def _repack(kv, *, num_pages, max_pages, int8_geometry):
    """`repack` into the decode geometry, on its own: the caller drops the prefill state after
    it, so that its pool is freed before the decode loop starts instead of living beside it."""
    return repack(kv, num_pages=num_pages, max_pages=max_pages, int8_geometry=int8_geometry)


@functools.partial(
    jax.jit,
    static_argnames=("steps_bucket", "policy", "sampler", "pad_id", "backend"),
    donate_argnames=("kv",),
)
def _decode(
    model,
    kv,
    last_hidden,
    lengths,
    budget_tokens,
    budget_ratio,
    max_new_tokens,
    key,
    stop_tokens,
    policy_params,
    *,
    steps_bucket,
    policy,
    sampler,
    pad_id,
    backend,
) -> GenState:
    """Decodes in a `lax.while_loop` until `max_new_tokens` (traced; the per-step arrays have
    `steps_bucket` entries), all sequences stopped, or the pool overflowed. Donates `kv`: the
    loop updates the pool in place."""
    logits = logits_from_hidden(model.params, model.config, last_hidden)
    b = lengths.shape[0]
    records_confidence = policy.step_confidence(logits) is not None
    state = GenState(
        kv=kv,
        tokens=jnp.full((b, steps_bucket), pad_id, jnp.int32),
        last_token=jnp.zeros((b,), jnp.int32),
        prompt_lengths=lengths,
        budget_tokens=budget_tokens,
        budget_ratio=budget_ratio,
        max_new_tokens=max_new_tokens,
        done=jnp.zeros((b,), bool),
        step=jnp.zeros((), jnp.int32),
        pages_in_use=jnp.zeros((steps_bucket,), jnp.int32),
        int8_pages_in_use=jnp.zeros((steps_bucket,), jnp.int32),
        confidence=jnp.zeros((steps_bucket, b), jnp.float32) if records_confidence else None,
        key=key,
    )
    token = _sample(sampler, logits, jax.random.fold_in(key, 0))
    state = _record(state, kv, logits, token, stop_tokens, pad_id, policy)

    def keep_going(state: GenState):
        # Every device of a mesh runs the same number of steps (the steps hold collectives).
        finished = collectives.all_shards(jnp.all(state.done))
        overflow = collectives.any_shard(state.kv.pool.overflow)
        return (state.step < state.max_new_tokens) & ~finished & ~overflow

    step = functools.partial(
        _decode_step,
        model,
        policy_params,
        policy=policy,
        sampler=sampler,
        stop_tokens=stop_tokens,
        pad_id=pad_id,
        backend=backend,
    )
    return jax.lax.while_loop(keep_going, step, state)


@dataclasses.dataclass(frozen=True)
class _Request:
    """A validated request, set up the same way for `generate` and `compress_prompt`."""

    policy: Policy
    cache: CacheConfig
    prompts: _Prompts
    budget_tokens: np.ndarray
    kv: KVState  # on a mesh: every device's, stacked [S, ...]
    grows: bool  # the prefill pool starts at the policy's guess and grows as it fills
    placement: InferenceMesh | None  # the mesh, or None on one device
    model: Model  # on a mesh: its parameters placed once, split by the rules table
    policy_params: object  # likewise


def _set_up(
    model: Model,
    prompt_ids,
    policy: Policy | str | None,
    *,
    reserve_tokens: int,
    positions_after_prompt: int,
    cache: CacheConfig | None,
    prefill_chunk: int | None,
    policy_params,
    mesh: jax.sharding.Mesh | None = None,
) -> _Request:
    """Checks everything on the host (before compiling) and creates the prefill state, with
    room for `reserve_tokens` written after each prompt and `positions_after_prompt` more
    positions than the prompt (checked against the model's context)."""
    placement = sharding.as_inference_mesh(mesh)
    policy = FullCache() if policy is None else policy
    if isinstance(policy, str):
        policy = from_spec(policy)
    if not isinstance(policy, Policy):
        raise ValueError(
            f"policy={policy!r} must be a jaxkv.policies.Policy or a spec such as "
            "'snapkv:0.25' (policies.from_spec)"
        )
    cache = CacheConfig() if cache is None else cache
    if not isinstance(cache, CacheConfig):
        raise ValueError(f"cache={cache!r} must be a jaxkv.CacheConfig")
    if cache.int8_window is not None and policy.selects_pages:
        raise ValueError(f"policy {policy.name!r} selects pages, which int8 storage does not do")
    policy.check_params(policy_params, model.config)
    prompt_lists = _prompt_lists(prompt_ids)
    lengths = _prompt_lengths(model, prompt_lists)
    if prefill_chunk is None:
        prefill_chunk = policy.prefill_chunk(lengths, DEFAULT_PREFILL_CHUNK)
    prompts = _pad_prompts(prompt_lists, lengths, prefill_chunk)
    if placement is not None:
        placement.check(model.config, len(lengths))
    budget_tokens = policy.budget_tokens(prompts.lengths)
    policy.check_prefill(prompts.lengths, prompts.chunk)
    kv = _create_state(
        model,
        prompts,
        reserve_tokens,
        positions_after_prompt,
        policy,
        cache,
        placement,
    )
    grows = cache.num_pages is None and policy.prefill_pool_grows
    if placement is not None:
        model = placement.place(model, placement.model_specs(model))
        policy_params = placement.place_policy_params(policy, policy_params)
    return _Request(
        policy=policy,
        cache=cache,
        prompts=prompts,
        budget_tokens=budget_tokens,
        kv=kv,
        grows=grows,
        placement=placement,
        model=model,
        policy_params=policy_params,
    )


def _run_prefill(model, request: _Request, key, policy_params, backend: Backend):
    prompts = request.prompts
    if request.grows:
        kv, last_hidden = _prefill_growing(model, request, key, policy_params, backend)
        kv.check()
        return kv, last_hidden
    kv, last_hidden = _call(
        _prefill_compressed,
        request.placement,
        ("model", "rows", "rows", "same", "rows", "donate", "same", "params"),
        model,
        prompts.tokens,
        prompts.lengths,
        np.int32(prompts.num_chunks),
        request.budget_tokens,
        request.kv,
        key,
        policy_params,
        chunk=prompts.chunk,
        policy=request.policy.static(),
        int8_window=request.cache.int8_window,
        backend=backend,
    )
    kv.check()
    return kv, last_hidden


def _to_decode_geometry(
    kv: KVState, policy: Policy, request: _Request, max_new_tokens: int
) -> KVState:
    """The compressed state in a pool sized for what it holds and will hold during decode
    (bounded by the policy's budget where it evicts); the same state when that is its size."""
    bound = policy.decode_tokens_bound(
        request.budget_tokens, request.prompts.lengths, max_new_tokens
    )
    if bound is not None and request.placement is not None:
        # The bound is an average over heads; a budget shared across heads may all go to
        # this device's heads.
        share = request.placement.model if policy.decides_across_heads else 1
        bound = request.placement.rows_per_device(bound) * share
    decode_pages, max_pages = decode_geometry(kv, max_new_tokens, bound)
    int8_geometry = None
    if kv.pool.int8 is not None:
        int8_geometry = int8_decode_geometry(kv, max_new_tokens)
    if request.cache.num_pages is not None:
        decode_pages = min(decode_pages, request.cache.num_pages)
    if int8_geometry is None and (decode_pages, max_pages) == (
        kv.pool.num_pages,
        kv.page_table.shape[-1],
    ):
        return kv
    return _call(
        _repack,
        request.placement,
        ("shard",),
        kv,
        num_pages=decode_pages,
        max_pages=max_pages,
        int8_geometry=int8_geometry,
    )


def _checked_key(key) -> jax.Array:
    """A PRNG key as `jax.random.PRNGKey(seed)` makes it; a named error for anything else."""
    key_array = jnp.asarray(key)
    typed = jnp.issubdtype(key_array.dtype, jax.dtypes.prng_key)
    if not typed and (key_array.shape != (2,) or key_array.dtype != jnp.uint32):
        raise ValueError(
            f"key={key!r}: give a PRNG key, e.g. jax.random.PRNGKey(0) (uint32 [2]), not a seed"
        )
    return key


def _checked_stop_tokens(model: Model, stop_tokens) -> tuple[int, ...]:
    """The ids that end a sequence (default the config's eos ids); one int is one id."""
    if stop_tokens is None:
        return tuple(model.config.eos_token_ids)
    ids = (stop_tokens,) if isinstance(stop_tokens, int | np.integer) else tuple(stop_tokens)
    vocab = model.config.vocab_size
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise ValueError(f"stop_tokens holds {token!r}: give token ids (ints)")
        if not 0 <= token < vocab:
            raise ValueError(f"stop_tokens holds {token}: ids are in [0, vocab_size={vocab})")
    return tuple(int(token) for token in ids)


def generate(
    model: Model,
    prompt_ids: PromptIds,
    *,
    max_new_tokens: int,
    policy: Policy | str | None = None,
    sampler: Sampler | None = None,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
    pad_id: int = 0,
    cache: CacheConfig | None = None,
    prefill_chunk: int | None = None,
    backend: str | Backend = "xla",
    policy_params: PolicyParams | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> GenerateOutput:
    """Generates up to `max_new_tokens` tokens for a batch of prompts of different lengths.

    Args:
      model: the model (config + params).
      prompt_ids: one prompt (list of ids) or a batch (list of lists, or an int array [B, T]).
      policy: cache policy, or its spec ("snapkv:0.25", `policies.from_spec`); default: keep
        everything.
      sampler: default greedy. A PRNG `key` is required when the sampler is not greedy.
      stop_tokens: ids that end a sequence (default: the config's eos ids).
      cache: how the paged cache holds tokens (`jaxkv.CacheConfig`: page size, pool pages,
        kv dtype, int8 storage; default CacheConfig()). The pool defaults to what the policy
        holds during prefill (a full cache: the whole request). After prefill and compression
        the state moves into a pool and page tables sized for what it holds plus the
        generation, bounded by the policy's budget where it evicts during decode (at most
        cache.num_pages), so the decode loop holds and reads only that. The prefill state is
        donated: its pool is freed before decoding starts.
      prefill_chunk: tokens per prefill chunk (default: the policy's choice, else 512).
      backend: "xla", "pallas" or "interpret" (`jaxkv.attention.Backend`).
      policy_params: the policy's learned parameters (gates), leaves stacked [L, ...]; checked
        against the model by `policy.check_params`.
      mesh: a (data, model) device mesh (`jaxkv.sharding.make_inference_mesh`) to run on:
        batch rows split over "data", KV heads (with their query heads and MLP columns) over
        "model"; each device holds the pages of its own rows and heads, and `cache.num_pages` is per
        device. Tokens equal one device's, sampled ones too (each row draws with its own key).
        None: one device.
    Shapes that depend on the request (pool and table sizes, prompt padding, max_new_tokens)
    are bucketed (`jaxkv.cache.geometry`), so a stream of requests compiles a bounded number of
    times; budgets travel as arrays and never recompile.
    Raises:
      ValueError on bad input before compiling; PoolExhaustedError if the pool runs out.
    """
    backend = resolve_backend(backend)
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
    sampler = Sampler() if sampler is None else sampler
    if key is None:
        if not sampler.greedy:
            raise ValueError("a PRNG key is required when sampling (temperature > 0)")
        key = jax.random.PRNGKey(0)
    key = _checked_key(key)
    stop_tokens = _checked_stop_tokens(model, stop_tokens)
    request = _set_up(
        model,
        prompt_ids,
        policy,
        reserve_tokens=max_new_tokens - 1,  # the last sampled token is never written
        positions_after_prompt=max_new_tokens,
        cache=cache,
        prefill_chunk=prefill_chunk,
        policy_params=policy_params,
        mesh=mesh,
    )
    policy, placement = request.policy, request.placement
    model, policy_params = request.model, request.policy_params
    policy_key, key = jax.random.split(key)
    kv, last_hidden = _run_prefill(model, request, policy_key, policy_params, backend)
    kv = _to_decode_geometry(kv, policy, request, max_new_tokens)
    lengths = request.prompts.lengths
    state = _call(
        _decode,
        placement,
        ("model", "donate", "shard", "rows", "rows", "rows", "same", "same", "same", "params"),
        model,
        kv,
        last_hidden,
        lengths,
        request.budget_tokens,
        policy.budget_ratio(len(lengths)),
        np.int32(max_new_tokens),
        key,
        jnp.asarray(stop_tokens, jnp.int32).reshape(-1),
        policy_params,
        steps_bucket=decode_steps_bucket(max_new_tokens),
        policy=policy.static(),
        sampler=sampler,
        pad_id=pad_id,
        backend=backend,
    )
    return _output(state, max_new_tokens, stop_tokens, placement)


def _output(
    state: GenState, max_new_tokens: int, stop_tokens, placement: InferenceMesh | None
) -> GenerateOutput:
    """The host-side result of the decode loop (a mesh's rows joined, its pages summed)."""
    state.kv.check()
    if placement is None:
        per_row, summed = np.asarray, np.asarray
    else:
        per_row, summed = placement.join_rows, placement.sum_shards
    steps = int(np.max(sharding.to_host(state.step)))
    tokens = per_row(state.tokens)[:, :max_new_tokens]
    is_stop = np.isin(tokens, np.asarray(stop_tokens, np.int32))
    num_tokens = np.where(is_stop.any(axis=1), is_stop.argmax(axis=1) + 1, steps)
    pages = summed(state.pages_in_use)[:steps]
    int8_pages = summed(state.int8_pages_in_use)[:steps]
    memory_bytes = pages.astype(np.int64) * state.kv.pool.page_bytes + state.kv.ring_bytes
    if state.kv.pool.int8 is not None:
        tier = state.kv.pool.int8
        memory_bytes += int8_pages.astype(np.int64) * tier.pool.page_bytes
        memory_bytes += tier.channel_scale_bytes
    confidence = None
    if state.confidence is not None:
        confidence = per_row(jnp.swapaxes(state.confidence, -1, -2)).T[:steps]
    return GenerateOutput(
        tokens=tokens,
        num_tokens=num_tokens.astype(np.int32),
        pages_in_use=pages,
        int8_pages_in_use=int8_pages,
        memory_bytes=memory_bytes,
        confidence=confidence,
        state=state.kv,
    )


def compress_prompt(
    model: Model,
    prompt_ids: PromptIds,
    policy: Policy | str | None = None,
    *,
    cache: CacheConfig | None = None,
    prefill_chunk: int | None = None,
    key: jax.Array | None = None,
    backend: str | Backend = "xla",
    reserve_tokens: int = 0,
    policy_params: PolicyParams | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> KVState:
    """Prefills the prompts and applies the policy's compression; returns the KV state.

    `key` seeds stochastic policies (GVote); the same key gives the same result.
    `reserve_tokens`: room in every page table for that many tokens after the prompt, so the
    caller can go on writing to the returned state (questions, continuations).
    `cache`, `policy_params`, `prefill_chunk`, `backend`, `mesh`: as for `generate` (on a mesh the
    result is every device's state, stacked [S, ...]).
    """
    backend = resolve_backend(backend)
    reserve_tokens = check_count("reserve_tokens", reserve_tokens, 0)
    request = _set_up(
        model,
        prompt_ids,
        policy,
        reserve_tokens=reserve_tokens,
        positions_after_prompt=reserve_tokens,
        cache=cache,
        prefill_chunk=prefill_chunk,
        policy_params=policy_params,
        mesh=mesh,
    )
    key = jax.random.PRNGKey(0) if key is None else key
    kv, _ = _run_prefill(request.model, request, key, request.policy_params, backend)
    return kv
