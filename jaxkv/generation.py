"""Jitted generation over the paged KV state: chunked prefill, policy compression, decode loop."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import resolve_backend
from jaxkv.cache import KVState, decode_geometry, int8_decode_geometry, repack
from jaxkv.cache.int8 import check_dtype, start_int8
from jaxkv.forward import forward_cached
from jaxkv.policies import FullCache, Policy
from jaxkv.policies.base import DecodeContext, PrefillObservations
from jaxkv.policies.confkv import confidence
from jaxkv.sampling import Sampler
from models.decoder import Model, logits_from_hidden

DEFAULT_PAGE_SIZE = 16
DEFAULT_PREFILL_CHUNK = 512


@flax.struct.dataclass
class GenState:
    """Decode-loop state.

    Attributes:
      kv: the KV state.
      tokens: int32 [B, max_new_tokens] generated tokens (pad after a stop token).
      last_token: int32 [B] the newest token, fed to the next step.
      prompt_lengths: int32 [B].
      budget_tokens: int32 [B] (or [B, n]) tokens per head the policy may keep.
      done: bool [B] sequence hit a stop token.
      step: int32 [] tokens generated so far.
      pages_in_use: int32 [max_new_tokens] pages held after prefill (entry 0) and each step.
      int8_pages_in_use: int32 [max_new_tokens] the same for the int8 tier (0 without one).
      confidence: f32 [max_new_tokens, B] Conf-KV confidence of each step's next-token logits.
      key: PRNG key.
    """

    kv: KVState
    tokens: jax.Array
    last_token: jax.Array
    prompt_lengths: jax.Array
    budget_tokens: jax.Array
    done: jax.Array
    step: jax.Array
    pages_in_use: jax.Array
    int8_pages_in_use: jax.Array
    confidence: jax.Array
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
      confidence: f32 [steps, B] confidence of the logits each token was sampled from.
      state: the final KV state.
    """

    tokens: np.ndarray
    num_tokens: np.ndarray
    pages_in_use: np.ndarray
    int8_pages_in_use: np.ndarray
    memory_bytes: np.ndarray
    confidence: np.ndarray
    state: KVState


@dataclasses.dataclass(frozen=True)
class _Prompts:
    tokens: np.ndarray  # int32 [B, T_pad], right-padded
    lengths: np.ndarray  # int32 [B]
    chunk: int


def _prepare_prompts(model: Model, prompts, prefill_chunk: int) -> _Prompts:
    """Validates and right-pads prompts; T_pad is a multiple of the prefill chunk."""
    if isinstance(prompts, np.ndarray | jax.Array):
        prompts = np.asarray(prompts)
        if prompts.ndim == 1:
            prompts = prompts[None]
        if prompts.ndim != 2:
            raise ValueError(f"prompt_ids has shape {prompts.shape}: expected [T] or [B, T]")
        prompts = [list(row) for row in prompts]
    elif not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompt_ids must be a non-empty list of token ids or of token-id lists")
    elif all(isinstance(t, int | np.integer) for t in prompts):
        prompts = [list(prompts)]
    if prefill_chunk <= 0:
        raise ValueError(f"prefill_chunk={prefill_chunk} must be > 0")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if np.any(lengths == 0):
        raise ValueError(
            f"prompt {int(np.argmin(lengths))} is empty: every prompt needs >= 1 token"
        )
    vocab = model.config.vocab_size
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={vocab})")
    longest = int(lengths.max())
    chunk = min(prefill_chunk, -(-longest // 16) * 16)
    padded = -(-longest // chunk) * chunk
    tokens = np.zeros((len(prompts), padded), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return _Prompts(tokens=tokens, lengths=lengths, chunk=chunk)


def _full_cache_pages(
    model: Model, lengths: np.ndarray, max_new_tokens: int, page_size: int
) -> int:
    """Pages a keep-everything cache needs for these prompts and generation length."""
    cfg = model.config
    # The last sampled token is never written, hence max_new_tokens - 1.
    per_head = -(-(lengths + max(max_new_tokens - 1, 0)) // page_size)
    return int(cfg.num_layers * cfg.num_kv_heads * per_head.sum())


def _create_state(
    model: Model,
    prompts: _Prompts,
    max_new_tokens: int,
    policy: Policy,
    page_size: int,
    num_pages: int | None,
    kv_dtype,
) -> KVState:
    cfg = model.config
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a positive power of two")
    max_tokens = int(prompts.lengths.max()) + max_new_tokens
    if max_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt length {int(prompts.lengths.max())} + max_new_tokens={max_new_tokens} = "
            f"{max_tokens} exceeds the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    full_need = _full_cache_pages(model, prompts.lengths, max_new_tokens, page_size)
    if policy.int8_window is not None:
        check_dtype(kv_dtype if kv_dtype is not None else model.dtype)
    if num_pages is None:
        bound = policy.prefill_pages(
            prompts.lengths, prompts.chunk, cfg, page_size, max(max_new_tokens - 1, 0)
        )
        num_pages = full_need if bound is None else min(bound, full_need)
    elif isinstance(policy, FullCache) and num_pages < full_need:
        raise ValueError(
            f"num_pages={num_pages} is too small: the full cache needs {full_need} "
            f"pages of {page_size} tokens for these prompts"
        )
    return KVState.create(
        num_layers=cfg.num_layers,
        batch=len(prompts.lengths),
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_tokens=max_tokens,
        page_size=page_size,
        num_pages=num_pages,
        dtype=kv_dtype if kv_dtype is not None else model.dtype,
        key_bounds=policy.selects_pages,
        local_window=policy.local_window,
    )


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


def _prefill(
    model: Model,
    tokens,
    lengths,
    budget_tokens,
    kv: KVState,
    key,
    policy_params,
    *,
    chunk: int,
    policy: Policy,
    backend: str,
):
    """Chunked prefill.

    Returns (kv, final-normed hidden state of each prompt's last token [B, D], the
    PrefillObservations the policy asked for).
    """
    cfg = model.config
    b, padded = tokens.shape
    w = policy.observation_window
    stats = policy.needs_input_stats
    starts = jnp.arange(0, padded, chunk)
    chunks = tokens.reshape(b, -1, chunk).transpose(1, 0, 2)

    def step(carry, xs):
        kv, last_hidden, window, sums = carry
        chunk_tokens, start = xs
        index = start + jnp.arange(chunk)
        positions = jnp.where(index < lengths[:, None], index, -1)
        hidden, kv, collected = forward_cached(
            model,
            chunk_tokens,
            positions,
            kv,
            policy=policy,
            backend=backend,
            collect_queries=w > 0,
            collect_input_stats=stats,
            policy_params=policy_params,
        )
        seen = jnp.minimum(start + chunk, lengths)
        kv = policy.after_prefill_chunk(
            kv, seen=seen, prompt_lengths=lengths, budget_tokens=budget_tokens
        )
        is_last = index == lengths[:, None] - 1
        picked = jnp.einsum("bc,bcd->bd", is_last.astype(hidden.dtype), hidden)
        last_hidden = jnp.where(jnp.any(is_last, axis=1)[:, None], picked, last_hidden)
        if w:
            window = _record_window_queries(window, collected["queries"], positions, lengths)
        if stats:
            sums = (sums[0] + collected["input_sum"], sums[1] + collected["input_sq_sum"])
        return (kv, last_hidden, window, sums), None

    shape = (cfg.num_layers, b, cfg.num_heads, w, cfg.head_dim)
    window = jnp.zeros(shape, model.dtype) if w else None
    zeros = jnp.zeros((cfg.num_layers, b, cfg.hidden_size), jnp.float32)
    sums = (zeros, zeros) if stats else None
    init = (kv, jnp.zeros((b, cfg.hidden_size), model.dtype), window, sums)
    (kv, last_hidden, window, sums), _ = jax.lax.scan(step, init, (chunks, starts))
    mean = var = None
    if stats:
        n = lengths[None, :, None].astype(jnp.float32)
        mean = sums[0] / n
        var = jnp.maximum(sums[1] - n * mean * mean, 0.0) / jnp.maximum(n - 1, 1)
    obs = PrefillObservations(
        prompt_lengths=lengths,
        budget_tokens=budget_tokens,
        queries=window,
        input_mean=mean,
        input_var=var,
        key=key,
        prompt_tokens=tokens if policy.needs_prompt_tokens else None,
    )
    return kv, last_hidden, obs


@functools.partial(jax.jit, static_argnames=("chunk", "policy", "backend"), donate_argnames=("kv",))
def _prefill_compressed(
    model, tokens, lengths, budget_tokens, kv, key, policy_params, *, chunk, policy, backend
):
    """Chunked prefill, the policy's compression, then (with int8 storage) every head's tokens
    but the newest `full_precision_window` move to int8; donates `kv`."""
    kv, last_hidden, obs = _prefill(
        model,
        tokens,
        lengths,
        budget_tokens,
        kv,
        key,
        policy_params,
        chunk=chunk,
        policy=policy,
        backend=backend,
    )
    kv = policy.compress(kv, obs, model)
    if policy.int8_window is not None:
        kv = start_int8(kv, policy.int8_window)
    return kv, last_hidden


def _decode_step(
    model: Model,
    policy_params,
    state: GenState,
    *,
    policy: Policy,
    sampler: Sampler,
    stop_tokens,
    pad_id: int,
    backend: str,
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
        positions=positions,
        logits=logits,
        key=jax.random.fold_in(step_key, 1),
        group_size=model.config.group_size,
    )
    kv = policy.on_decode(kv, ctx)
    token = sampler(logits, jax.random.fold_in(step_key, 0))
    return _record(state, kv, logits, token, stop_tokens, pad_id)


def _record(state: GenState, kv: KVState, logits, token, stop_tokens, pad_id: int) -> GenState:
    token = jnp.where(state.done, pad_id, token)
    done = state.done | jnp.any(token[:, None] == stop_tokens[None, :], axis=-1)
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
        confidence=state.confidence.at[state.step].set(confidence(logits)),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "max_new_tokens",
        "num_pages",
        "max_pages",
        "int8_geometry",
        "policy",
        "sampler",
        "pad_id",
        "backend",
    ),
)
def _decode(
    model,
    kv,
    last_hidden,
    lengths,
    budget_tokens,
    key,
    stop_tokens,
    policy_params,
    *,
    max_new_tokens,
    num_pages,
    max_pages,
    int8_geometry,
    policy,
    sampler,
    pad_id,
    backend,
) -> GenState:
    """Repacks the compressed state into a pool of `num_pages` pages (tables of `max_pages`),
    then decodes in a `lax.while_loop` until max_new_tokens, all sequences stopped, or the pool
    overflowed. `kv` is not donated: the repacked state has other shapes."""
    kv = repack(kv, num_pages=num_pages, max_pages=max_pages, int8_geometry=int8_geometry)
    logits = logits_from_hidden(model.params, model.config, last_hidden)
    b = lengths.shape[0]
    state = GenState(
        kv=kv,
        tokens=jnp.full((b, max_new_tokens), pad_id, jnp.int32),
        last_token=jnp.zeros((b,), jnp.int32),
        prompt_lengths=lengths,
        budget_tokens=budget_tokens,
        done=jnp.zeros((b,), bool),
        step=jnp.zeros((), jnp.int32),
        pages_in_use=jnp.zeros((max_new_tokens,), jnp.int32),
        int8_pages_in_use=jnp.zeros((max_new_tokens,), jnp.int32),
        confidence=jnp.zeros((max_new_tokens, b), jnp.float32),
        key=key,
    )
    token = sampler(logits, jax.random.fold_in(key, 0))
    state = _record(state, kv, logits, token, stop_tokens, pad_id)

    def keep_going(state: GenState):
        return (state.step < max_new_tokens) & ~jnp.all(state.done) & ~state.kv.pool.overflow

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


def generate(
    model: Model,
    prompt_ids,
    *,
    max_new_tokens: int,
    policy: Policy | None = None,
    sampler: Sampler | None = None,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
    pad_id: int = 0,
    page_size: int = DEFAULT_PAGE_SIZE,
    num_pages: int | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    kv_dtype=None,
    backend: str = "xla",
    policy_params=None,
) -> GenerateOutput:
    """Generates up to `max_new_tokens` tokens for a batch of prompts of different lengths.

    Args:
      model: the model (config + params).
      prompt_ids: one prompt (list of ids) or a batch (list of lists, or an int array [B, T]).
      policy: cache policy (default: keep everything).
      sampler: default greedy. A PRNG `key` is required when the sampler is not greedy.
      stop_tokens: ids that end a sequence (default: the config's eos ids).
      page_size, num_pages: the paged cache's geometry; num_pages defaults to what a full
        cache needs for this request. After prefill and compression the state is repacked
        into a pool and page tables sized for what it holds plus the generation (at most
        num_pages), so the decode loop holds and reads only that.
      prefill_chunk: tokens per prefill chunk.
      policy_params: the policy's learned parameters (gates), leaves stacked [L, ...]; checked
        against the model by `policy.check_params`.
    Raises:
      ValueError on bad input before compiling; PoolExhaustedError if the pool runs out.
    """
    resolve_backend(backend)
    policy = FullCache() if policy is None else policy
    policy.check_params(policy_params, model.config)
    sampler = Sampler() if sampler is None else sampler
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if key is None:
        if not sampler.greedy:
            raise ValueError("a PRNG key is required when sampling (temperature > 0)")
        key = jax.random.PRNGKey(0)
    stop_tokens = model.config.eos_token_ids if stop_tokens is None else tuple(stop_tokens)
    prompts = _prepare_prompts(model, prompt_ids, prefill_chunk)
    budget_tokens = policy.budget_tokens(prompts.lengths)
    policy.check_prefill(prompts.lengths, prompts.chunk)
    kv = _create_state(model, prompts, max_new_tokens, policy, page_size, num_pages, kv_dtype)
    policy_key, key = jax.random.split(key)
    kv, last_hidden = _prefill_compressed(
        model,
        prompts.tokens,
        prompts.lengths,
        budget_tokens,
        kv,
        policy_key,
        policy_params,
        chunk=prompts.chunk,
        policy=policy.static(),
        backend=backend,
    )
    kv.check()
    decode_pages, max_pages = decode_geometry(kv, max_new_tokens)
    int8_geometry = None
    if kv.pool.int8 is not None:
        int8_geometry = int8_decode_geometry(kv, max_new_tokens)
    if num_pages is not None:
        decode_pages = min(decode_pages, num_pages)
    state = _decode(
        model,
        kv,
        last_hidden,
        prompts.lengths,
        budget_tokens,
        key,
        jnp.asarray(stop_tokens, jnp.int32).reshape(-1),
        policy_params,
        max_new_tokens=max_new_tokens,
        num_pages=decode_pages,
        max_pages=max_pages,
        int8_geometry=int8_geometry,
        policy=policy.static(),
        sampler=sampler,
        pad_id=pad_id,
        backend=backend,
    )
    state.kv.check()
    tokens = np.asarray(state.tokens)
    steps = int(state.step)
    is_stop = np.isin(tokens, np.asarray(stop_tokens, np.int32))
    num_tokens = np.where(is_stop.any(axis=1), is_stop.argmax(axis=1) + 1, steps)
    pages = np.asarray(state.pages_in_use)[:steps]
    int8_pages = np.asarray(state.int8_pages_in_use)[:steps]
    memory_bytes = pages.astype(np.int64) * state.kv.pool.page_bytes + state.kv.ring_bytes
    if state.kv.pool.int8 is not None:
        tier = state.kv.pool.int8
        memory_bytes += int8_pages.astype(np.int64) * tier.pool.page_bytes
        memory_bytes += tier.channel_scale_bytes
    return GenerateOutput(
        tokens=tokens,
        num_tokens=num_tokens.astype(np.int32),
        pages_in_use=pages,
        int8_pages_in_use=int8_pages,
        memory_bytes=memory_bytes,
        confidence=np.asarray(state.confidence)[:steps],
        state=state.kv,
    )


def compress_prompt(
    model: Model,
    prompt_ids,
    policy: Policy | None = None,
    *,
    page_size: int = DEFAULT_PAGE_SIZE,
    num_pages: int | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    kv_dtype=None,
    key: jax.Array | None = None,
    backend: str = "xla",
    reserve_tokens: int = 0,
    policy_params=None,
) -> KVState:
    """Prefills the prompts and applies the policy's compression; returns the KV state.

    `key` seeds stochastic policies (GVote); the same key gives the same result.
    `reserve_tokens`: room in every page table for that many tokens after the prompt, so the
    caller can go on writing to the returned state (questions, continuations).
    `policy_params`: as for `generate`.
    """
    resolve_backend(backend)
    policy = FullCache() if policy is None else policy
    policy.check_params(policy_params, model.config)
    prompts = _prepare_prompts(model, prompt_ids, prefill_chunk)
    budget_tokens = policy.budget_tokens(prompts.lengths)
    policy.check_prefill(prompts.lengths, prompts.chunk)
    if reserve_tokens < 0:
        raise ValueError(f"reserve_tokens={reserve_tokens} must be >= 0")
    kv = _create_state(model, prompts, reserve_tokens, policy, page_size, num_pages, kv_dtype)
    kv, _ = _prefill_compressed(
        model,
        prompts.tokens,
        prompts.lengths,
        budget_tokens,
        kv,
        jax.random.PRNGKey(0) if key is None else key,
        policy_params,
        chunk=prompts.chunk,
        policy=policy.static(),
        backend=backend,
    )
    kv.check()
    return kv
