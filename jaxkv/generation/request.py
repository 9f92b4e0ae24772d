"""A request, checked and set up on the host before anything compiles: prompts validated and
padded into chunks, the budget in tokens, the prefill pool sized for what the policy holds, the
model and policy parameters placed on the mesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import sharding
from jaxkv.cache import KVState
from jaxkv.cache.config import CacheConfig, check_count
from jaxkv.cache.geometry import pool_pages_bucket, table_pages_bucket
from jaxkv.models.configs import ModelConfig
from jaxkv.models.decoder import Model
from jaxkv.pallas_kernels.common import next_power_of_two
from jaxkv.policies import FullCache, Policy, from_spec
from jaxkv.sharding import InferenceMesh
from jaxkv.step.parts import local_window

DEFAULT_PREFILL_CHUNK = 512


def default_prefill_chunk(policy: Policy, prompt_lengths: np.ndarray) -> int:
    """Tokens per prefill chunk when the caller gives none: `DEFAULT_PREFILL_CHUNK`, unless the
    policy's chunk eviction prescribes its own (Fast KVzip's 16K chunks at long context)."""
    if policy.chunk_eviction is None:
        return DEFAULT_PREFILL_CHUNK
    return policy.chunk_eviction.prefill_chunk(prompt_lengths, DEFAULT_PREFILL_CHUNK)


# Chunks shorter than this are not bucketed further (a prompt's chunk is a power of two >= it).
MIN_PREFILL_CHUNK = 16

# One prompt of token ids, or a batch: lists of ids, or an integer array [T] or [B, T].
PromptIds = Sequence[int] | Sequence[Sequence[int]] | np.ndarray | jax.Array


@dataclasses.dataclass(frozen=True)
class Prompts:
    tokens: np.ndarray  # int32 [B, T_pad], right-padded; T_pad = chunk * a power of two
    lengths: np.ndarray  # int32 [B]
    chunk: int
    num_chunks: int  # chunks that hold a prompt token (the rest of T_pad is never run)


def prompt_lists(prompts) -> list[list[int]]:
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


def pad_prompts(prompts: list[list[int]], lengths: np.ndarray, prefill_chunk: int) -> Prompts:
    """Right-pads validated prompts. The chunk is a power of two (>= 16) when the prompts are
    shorter than `prefill_chunk`; the padded length is the chunk times a power of two."""
    prefill_chunk = check_count("prefill_chunk", prefill_chunk, 1)
    longest = int(lengths.max())
    chunk = min(prefill_chunk, max(MIN_PREFILL_CHUNK, next_power_of_two(longest)))
    num_chunks = -(-longest // chunk)
    tokens = np.zeros((len(prompts), chunk * next_power_of_two(num_chunks)), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return Prompts(tokens=tokens, lengths=lengths, chunk=chunk, num_chunks=num_chunks)


def prompt_lengths(model: Model, prompts: list[list[int]]) -> np.ndarray:
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


def checked_prompts(
    model: Model, policy: Policy, rows: list[list[int]], prefill_chunk: int | None
) -> Prompts:
    """Prompts (lists of ids) checked against the model and the policy's prefill, padded into
    chunks of `prefill_chunk` tokens (default `default_prefill_chunk`)."""
    lengths = prompt_lengths(model, rows)
    if prefill_chunk is None:
        prefill_chunk = default_prefill_chunk(policy, lengths)
    prompts = pad_prompts(rows, lengths, prefill_chunk)
    policy.check_prefill(prompts.lengths, prompts.chunk)
    return prompts


def _full_cache_pages(
    cfg: ModelConfig, lengths: np.ndarray, reserve_tokens: int, page_size: int
) -> int:
    """Pages a keep-everything cache needs for these prompts and `reserve_tokens` more each."""
    per_head = -(-(lengths + reserve_tokens) // page_size)
    return int(cfg.num_layers * cfg.num_kv_heads * per_head.sum())


def device_shares(
    model: Model, lengths: np.ndarray, placement: InferenceMesh | None
) -> list[tuple[ModelConfig, np.ndarray]]:
    """(model config, prompt lengths) of each device's share of a request: its heads and rows
    (the whole request on one device; one entry per data shard on a mesh)."""
    if placement is None:
        return [(model.config, lengths)]
    cfg = placement.local_config(model.config)
    return [(cfg, lengths[rows]) for rows in placement.row_groups(len(lengths))]


def prefill_geometry(
    model: Model,
    prompts: Prompts,
    reserve_tokens: int,
    positions_after_prompt: int,
    policy: Policy,
    cache: CacheConfig,
    placement: InferenceMesh | None,
) -> dict:
    """The keyword arguments of `KVState.create` for the empty prefill state (host side: the
    model's params may be abstract); on a mesh each device's, `num_pages` per device."""
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
    shares = device_shares(model, prompts.lengths, placement)
    full_need = max(
        _full_cache_pages(local_cfg, lengths, reserve_tokens, page_size)
        for local_cfg, lengths in shares
    )
    # The part that sizes the prefill pool: the admission's first guess (the pool grows as it
    # fills) or the chunk eviction's bound; without either, the full cache's need.
    sizer = policy.admission if policy.admission is not None else policy.chunk_eviction
    if num_pages is None:
        needs = []
        for local_cfg, lengths in shares:
            # A budget shared across heads may all go to this device's heads.
            bound_cfg = cfg if policy.decides_across_heads else local_cfg
            bound = None
            if sizer is not None:
                bound = sizer.prefill_pages(
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
        key_bounds=policy.selection is not None,
        local_window=local_window(policy),
    )
    return geometry


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated request, set up the same way for `generate` and `compress_prompt`."""

    policy: Policy
    cache: CacheConfig
    prompts: Prompts
    budget_tokens: np.ndarray
    thresholds: np.ndarray  # f32 [B, n] `Policy.thresholds`
    kv: KVState  # on a mesh: every device's, stacked [S, ...]
    grows: bool  # the prefill pool starts at the policy's guess and grows as it fills
    placement: InferenceMesh | None  # the mesh, or None on one device
    model: Model  # on a mesh: its parameters placed once, split by the rules table
    policy_params: object  # likewise


def resolved_policy(policy: Policy | str | None) -> Policy:
    """The policy a public entry point was given: a Policy, a spec (`policies.from_spec`), or
    None for the full cache."""
    policy = FullCache() if policy is None else policy
    if isinstance(policy, str):
        policy = from_spec(policy)
    if not isinstance(policy, Policy):
        raise ValueError(
            f"policy={policy!r} must be a jaxkv.policies.Policy or a spec such as "
            "'snapkv:0.25' (policies.from_spec)"
        )
    return policy


def set_up(
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
) -> Request:
    """Checks everything on the host (before compiling) and creates the prefill state, with
    room for `reserve_tokens` written after each prompt and `positions_after_prompt` more
    positions than the prompt (checked against the model's context)."""
    placement = sharding.as_inference_mesh(mesh)
    policy = resolved_policy(policy)
    cache = CacheConfig() if cache is None else cache
    if not isinstance(cache, CacheConfig):
        raise ValueError(f"cache={cache!r} must be a jaxkv.CacheConfig")
    if cache.int8_window is not None and policy.selection is not None:
        raise ValueError(f"policy {policy.name!r} selects pages, which int8 storage does not do")
    policy.check_params(policy_params, model.config)
    prompts = checked_prompts(model, policy, prompt_lists(prompt_ids), prefill_chunk)
    if placement is not None:
        placement.check(model.config, len(prompts.lengths))
    budget_tokens = policy.budget_tokens(prompts.lengths)
    geometry = prefill_geometry(
        model, prompts, reserve_tokens, positions_after_prompt, policy, cache, placement
    )
    if placement is None:
        kv = KVState.create(**geometry)
    else:
        kv = placement.run(KVState.create, (), (), geometry)
    grows = cache.num_pages is None and policy.admission is not None
    if placement is not None:
        model = placement.place(model, placement.model_specs(model))
        policy_params = placement.place_policy_params(policy, policy_params)
    return Request(
        policy=policy,
        cache=cache,
        prompts=prompts,
        budget_tokens=budget_tokens,
        thresholds=policy.thresholds(len(prompts.lengths)),
        kv=kv,
        grows=grows,
        placement=placement,
        model=model,
        policy_params=policy_params,
    )


def checked_key(key) -> jax.Array:
    """A PRNG key as `jax.random.PRNGKey(seed)` makes it; a named error for anything else."""
    key_array = jnp.asarray(key)
    typed = jnp.issubdtype(key_array.dtype, jax.dtypes.prng_key)
    if not typed and (key_array.shape != (2,) or key_array.dtype != jnp.uint32):
        raise ValueError(
            f"key={key!r}: give a PRNG key, e.g. jax.random.PRNGKey(0) (uint32 [2]), not a seed"
        )
    return key


def checked_stop_tokens(model: Model, stop_tokens) -> tuple[int, ...]:
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
