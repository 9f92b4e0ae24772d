"""`generate` and `compress_prompt`: a request set up, prefilled and compressed, decoded."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import sharding
from jaxkv.attention import Backend, resolve_backend
from jaxkv.cache import KVState
from jaxkv.cache.config import CacheConfig, check_count
from jaxkv.cache.geometry import decode_steps_bucket
from jaxkv.generation.decode import GenState, decode_loop, to_decode_geometry
from jaxkv.generation.prefill import run_prefill
from jaxkv.generation.request import PromptIds, checked_key, checked_stop_tokens, set_up
from jaxkv.models.decoder import Model
from jaxkv.policies import Policy
from jaxkv.policies.base import PolicyParams
from jaxkv.sampling import Sampler
from jaxkv.sharding import InferenceMesh


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
      policy_trace: f32 [steps, B] what the policy recorded of the logits each token was
        sampled from (its decode eviction's `step_record`; Conf-KV: its confidence, with its
        weights); None for policies that record nothing.
      state: the final KV state; on a mesh, every device's state stacked on a leading axis
        [S] (`jaxkv.sharding`: shard s holds data shard s // model, model shard s % model).
    """

    tokens: np.ndarray
    num_tokens: np.ndarray
    pages_in_use: np.ndarray
    int8_pages_in_use: np.ndarray
    memory_bytes: np.ndarray
    policy_trace: np.ndarray | None
    state: KVState


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
    key = checked_key(key)
    stop_tokens = checked_stop_tokens(model, stop_tokens)
    request = set_up(
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
    kv, last_hidden = run_prefill(model, request, policy_key, policy_params, backend)
    kv = to_decode_geometry(kv, policy, request, max_new_tokens)
    lengths = request.prompts.lengths
    state = decode_loop(
        placement,
        model=model,
        kv=kv,
        last_hidden=last_hidden,
        lengths=lengths,
        budget_tokens=request.budget_tokens,
        budget_ratio=policy.budget_ratio(len(lengths)),
        max_new_tokens=np.int32(max_new_tokens),
        key=key,
        stop_tokens=jnp.asarray(stop_tokens, jnp.int32).reshape(-1),
        policy_params=policy_params,
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
    policy_trace = None
    if state.policy_trace is not None:
        policy_trace = per_row(jnp.swapaxes(state.policy_trace, -1, -2)).T[:steps]
    return GenerateOutput(
        tokens=tokens,
        num_tokens=num_tokens.astype(np.int32),
        pages_in_use=pages,
        int8_pages_in_use=int8_pages,
        memory_bytes=memory_bytes,
        policy_trace=policy_trace,
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
    request = set_up(
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
    kv, _ = run_prefill(request.model, request, key, request.policy_params, backend)
    return kv
