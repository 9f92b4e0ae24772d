"""Chunked prefill with the policy's observations (`jaxkv.generation.observations`), then its
compression: one program for a pool sized up front, or chunk by chunk with the pool grown between
chunks for policies that admit an unknown share of the prompt; and `read_tokens`, the reading of
more tokens over a session (`extend`)."""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import collectives, sharding
from jaxkv.attention import Backend
from jaxkv.cache import KVState
from jaxkv.cache.geometry import pool_pages_bucket
from jaxkv.cache.int8 import start_int8
from jaxkv.cache.repack import grow
from jaxkv.generation.mesh import MODEL, POLICY_PARAMS, ROWS, SAME, SHARD, program
from jaxkv.generation.observations import (
    Observed,
    PrefillCarry,
    initial_carry,
    observations,
    observed_by,
    query_moments_from,
    record_window_queries,
)
from jaxkv.generation.request import Request, device_shares
from jaxkv.models.decoder import Model
from jaxkv.policies import Policy
from jaxkv.step.forward import combine_covariances, combine_moments, forward_cached

# Tokens of the longest forward pass a prefill chunk is run in: a policy whose method
# prescribes long chunks (Fast KVzip's 16K) evicts once per chunk, but its forward runs in pieces
# of at most this many tokens, so that activations and attention scores stay those of a piece.
MAX_FORWARD_TOKENS = 2048


def forward_piece(chunk: int) -> int:
    """Tokens per forward piece of a `chunk`-token prefill chunk: the chunk itself up to
    `MAX_FORWARD_TOKENS`, else its largest divisor within that bound (pieces tile the chunk);
    a chunk with no divisor of at least a quarter of the bound runs whole."""
    if chunk <= MAX_FORWARD_TOKENS:
        return chunk
    piece = next(size for size in range(MAX_FORWARD_TOKENS, 0, -1) if chunk % size == 0)
    return piece if 4 * piece >= MAX_FORWARD_TOKENS else chunk


def read_chunk(
    model: Model,
    tokens,
    starts,
    counts,
    lengths,
    offsets,
    budget_tokens,
    thresholds,
    kv: KVState,
    carry: PrefillCarry,
    policy_params,
    *,
    policy: Policy,
    backend: Backend,
    evict_chunks: bool,
):
    """Reads one chunk of each row: tokens [B, C] are row b's tokens starts[b] onwards of its
    lengths[b], of which the first counts[b] are read (a row with counts 0 reads nothing), token
    t at position offsets[b] + t; in `forward_piece(C)`-token pieces, then the chunk eviction's
    `after_prefill_chunk` (if the policy has one and `evict_chunks`) with each row's tokens seen
    so far (starts + counts: for a row that read nothing, what it had seen, which an eviction
    already made keeps whole). What the carry holds decides what is observed. Returns
    (kv, carry)."""
    chunk = tokens.shape[1]
    w = 0 if carry.window is None else carry.window.shape[3]
    piece = forward_piece(chunk)
    moments_from = None if carry.query_moments is None else query_moments_from(policy)

    def forward(index, state):
        """Forward piece `index` of `piece` tokens."""
        kv, carry = state
        within = index * piece + jnp.arange(piece)
        piece_tokens = jax.lax.dynamic_slice_in_dim(tokens, index * piece, piece, axis=1)
        token_index = starts[:, None] + within
        valid = (within < counts[:, None]) & (token_index < lengths[:, None])
        positions = jnp.where(valid, offsets[:, None] + token_index, -1)
        hidden, kv, collected = forward_cached(
            model,
            piece_tokens,
            positions,
            kv,
            policy=policy,
            backend=backend,
            collect_queries=w > 0,
            collect_input_stats=carry.moments is not None,
            collect_query_moments_from=moments_from,
            policy_params=policy_params,
            thresholds=thresholds,
        )
        if carry.hidden is not None:
            rows = jnp.arange(tokens.shape[0])[:, None]
            index_kept = jnp.where(valid, token_index, carry.hidden.shape[1])  # dropped past it
            carry = carry.replace(hidden=carry.hidden.at[rows, index_kept].set(hidden, mode="drop"))
        is_last = valid & (token_index == lengths[:, None] - 1)
        picked = jnp.einsum("bc,bcd->bd", is_last.astype(hidden.dtype), hidden)
        last_hidden = jnp.where(jnp.any(is_last, axis=1)[:, None], picked, carry.last_hidden)
        window, moments, query_moments = carry.window, carry.moments, carry.query_moments
        if w:
            read = jnp.where(valid, token_index, -1)
            window = record_window_queries(window, collected["queries"], read, lengths)
        if moments is not None:
            count = jnp.sum(valid, axis=1, keepdims=True).astype(jnp.float32)
            moments = combine_moments(
                *moments, count, collected["input_mean"], collected["input_m2"]
            )
        if query_moments is not None:
            counted = jnp.sum(positions >= moments_from, axis=1).astype(jnp.float32)
            query_moments = combine_covariances(
                *query_moments,
                counted[:, None, None],
                collected["query_mean"],
                collected["query_m2"],
            )
        return kv, carry.replace(
            last_hidden=last_hidden, window=window, moments=moments, query_moments=query_moments
        )

    state = (kv, carry)
    if piece == chunk:
        kv, carry = forward(0, state)
    else:
        kv, carry = jax.lax.fori_loop(0, chunk // piece, forward, state)
    if evict_chunks and policy.chunk_eviction is not None:
        kv = policy.chunk_eviction.after_prefill_chunk(
            kv,
            seen=jnp.minimum(starts + counts, lengths),
            prompt_lengths=lengths,
            budget_tokens=budget_tokens,
        )
    return kv, carry


def _prefill_span(
    model: Model,
    tokens,
    lengths,
    first_chunk,
    end_chunk,
    budget_tokens,
    thresholds,
    kv: KVState,
    carry: PrefillCarry,
    policy_params,
    offsets=None,
    *,
    chunk: int,
    policy: Policy,
    backend: Backend,
    evict_chunks: bool = True,
):
    """Prefills chunks [first_chunk, end_chunk) (traced) of tokens [B, T_pad] (`read_chunk`
    each, every row from the same token); the padded tail past the last prompt token is never
    run, so a prompt-length bucket costs no compute. Token t of row b sits at position
    `offsets[b] + t` (offsets int32 [B]: 0 for a prompt, the tokens already read when a
    session is extended). Returns (kv, carry)."""
    offsets = jnp.zeros_like(lengths) if offsets is None else offsets

    def step(index, state):
        start = index * chunk
        return read_chunk(
            model,
            jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1),
            jnp.full_like(lengths, start),
            jnp.full_like(lengths, chunk),
            lengths,
            offsets,
            budget_tokens,
            thresholds,
            *state,
            policy_params,
            policy=policy,
            backend=backend,
            evict_chunks=evict_chunks,
        )

    initial = collectives.varying_like((kv, carry), tokens)  # on a mesh: as the step's output
    return jax.lax.fori_loop(first_chunk, end_chunk, step, initial)


def compress_observed(
    model,
    tokens,
    lengths,
    budget_tokens,
    prompt_share,
    thresholds,
    kv,
    carry: PrefillCarry,
    key,
    policy_params,
    *,
    policy,
    int8_window,
):
    """The policy's prompt compression (if any) from what prefill observed (and the policy's
    learned parameters), then (with int8 storage, window `int8_window` not None) every head's
    tokens but the newest `int8_window` move to int8. Returns (kv, last_hidden)."""
    compression = policy.prompt_compression
    if compression is not None:
        observed = observations(
            tokens,
            lengths,
            budget_tokens,
            prompt_share,
            thresholds,
            carry,
            key,
            compression,
            policy_params,
        )
        kv = compression.compress(kv, observed, model)
    if int8_window is not None:
        kv = start_int8(kv, int8_window)
    return kv, carry.last_hidden


_SPAN_PLACEMENTS = dict(
    model=MODEL,
    tokens=ROWS,
    lengths=ROWS,
    budget_tokens=ROWS,
    thresholds=ROWS,
    kv=SHARD,
    policy_params=POLICY_PARAMS,
)


@program(
    static=("chunk", "policy", "int8_window", "backend"),
    donate=("kv",),
    num_chunks=SAME,
    key=SAME,
    prompt_share=ROWS,
    **_SPAN_PLACEMENTS,
)
def prefill_and_compress(
    model,
    tokens,
    lengths,
    num_chunks,
    budget_tokens,
    prompt_share,
    thresholds,
    kv,
    key,
    policy_params,
    *,
    chunk,
    policy,
    int8_window,
    backend,
):
    """Chunked prefill of every chunk, then `compress_observed`; donates `kv`."""
    carry = initial_carry(model, tokens.shape[0], observed_by(policy))
    kv, carry = _prefill_span(
        model,
        tokens,
        lengths,
        0,
        num_chunks,
        budget_tokens,
        thresholds,
        kv,
        carry,
        policy_params,
        chunk=chunk,
        policy=policy,
        backend=backend,
    )
    return compress_observed(
        model,
        tokens,
        lengths,
        budget_tokens,
        prompt_share,
        thresholds,
        kv,
        carry,
        key,
        policy_params,
        policy=policy,
        int8_window=int8_window,
    )


# The growing path (a policy with an admission part): a chunk per call, the pool checked between.
prefill_span = program(
    static=("chunk", "policy", "backend", "evict_chunks"),
    donate=("kv", "carry"),
    first_chunk=SAME,
    end_chunk=SAME,
    carry=SHARD,
    offsets=ROWS,
    **_SPAN_PLACEMENTS,
)(_prefill_span)
compress = program(
    static=("policy", "int8_window"),
    donate=("kv",),
    model=MODEL,
    tokens=ROWS,
    lengths=ROWS,
    budget_tokens=ROWS,
    prompt_share=ROWS,
    thresholds=ROWS,
    kv=SHARD,
    carry=SHARD,
    key=SAME,
    policy_params=POLICY_PARAMS,
)(compress_observed)
grow_pool = program(static=("num_pages", "int8_pages"), kv=SHARD)(grow)
empty_carry = program(static=("batch", "observed"), model=MODEL)(initial_carry)


@flax.struct.dataclass
class ChunkedPrefill:
    """A prefill in flight, one program call per chunk (`start_chunked_prefill`, then
    `prefill_next_chunk` until `done`, then `finish_chunked_prefill`): a caller can run other
    work in between (the engine's decode steps) or report progress.

    Attributes:
      kv: the state after the chunks read so far.
      carry: what the chunks recorded for the compression (`prefill_span`'s carry).
      chunks_done: chunks read so far (host int).
      num_chunks: chunks in all (host int).
    """

    kv: KVState
    carry: object
    chunks_done: int = flax.struct.field(pytree_node=False)
    num_chunks: int = flax.struct.field(pytree_node=False)

    @property
    def done(self) -> bool:
        return self.chunks_done == self.num_chunks


def start_chunked_prefill(
    model, request: Request, observed: Observed | None = None
) -> ChunkedPrefill:
    """A chunked prefill of the set-up request, no chunk read yet, recording what its policy's
    compression reads (or `observed`: what several policies' read, `observed_by`)."""
    _, rows = device_shares(model, request.prompts.lengths, request.placement)[0]
    observed = observed_by(request.policy) if observed is None else observed
    carry = empty_carry(request.placement, model=model, batch=len(rows), observed=observed)
    return ChunkedPrefill(
        kv=request.kv, carry=carry, chunks_done=0, num_chunks=request.prompts.num_chunks
    )


def prefill_next_chunk(
    model, request: Request, prefill: ChunkedPrefill, policy_params, backend: Backend
) -> ChunkedPrefill:
    """The prefill with its next chunk read. For a policy that admits an unknown share of the
    prompt (`request.grows`) the pool starts at the policy's guess and, before each chunk,
    grows (x2, bucketed) when fewer pages are free than the chunk could need, so that it holds
    what is admitted plus about one chunk. On a mesh every device's pool has the same size: the
    fullest device decides."""
    prompts, mesh, kv = request.prompts, request.placement, prefill.kv
    index = prefill.chunks_done
    if index >= prefill.num_chunks:
        raise ValueError(f"the prefill has read its {prefill.num_chunks} chunks: finish it")
    local_cfg, rows = device_shares(model, prompts.lengths, mesh)[0]
    heads = local_cfg.num_layers * local_cfg.num_kv_heads * len(rows)
    chunk_need = heads * (-(-prompts.chunk // kv.pool.page_size) + 1)
    kv.check()
    free = int(np.min(sharding.to_host(kv.pool.allocator.num_free)))
    if request.grows and free < chunk_need:
        in_use = kv.pool.num_pages - free
        wanted = max(2 * kv.pool.num_pages, in_use + chunk_need)
        num_pages = pool_pages_bucket(wanted, kv.pool.page_size)
        kv = grow_pool(mesh, kv=kv, num_pages=num_pages, int8_pages=None)  # int8 comes after
    kv, carry = prefill_span(
        mesh,
        model=model,
        tokens=prompts.tokens,
        lengths=prompts.lengths,
        first_chunk=np.int32(index),
        end_chunk=np.int32(index + 1),
        budget_tokens=request.budget_tokens,
        thresholds=request.thresholds,
        kv=kv,
        carry=prefill.carry,
        policy_params=policy_params,
        offsets=np.zeros_like(prompts.lengths),
        chunk=prompts.chunk,
        policy=request.policy.static(),
        backend=backend,
        evict_chunks=True,
    )
    return prefill.replace(kv=kv, carry=carry, chunks_done=index + 1)


def finish_chunked_prefill(
    model, request: Request, prefill: ChunkedPrefill, key
) -> tuple[KVState, jax.Array]:
    """The policy's compression after the last chunk: (kv, last_hidden [B, D])."""
    if not prefill.done:
        raise ValueError(
            f"the prefill has read {prefill.chunks_done} of its {prefill.num_chunks} chunks"
        )
    prompts = request.prompts
    return compress(
        request.placement,
        model=model,
        tokens=prompts.tokens,
        lengths=prompts.lengths,
        budget_tokens=request.budget_tokens,
        prompt_share=request.policy.prompt_share(len(prompts.lengths)),
        thresholds=request.thresholds,
        kv=prefill.kv,
        carry=prefill.carry,
        key=key,
        policy_params=request.policy_params,
        policy=request.policy.static(),
        int8_window=request.cache.int8_window,
    )


def rows_compressed(
    kv: KVState, tokens_read: np.ndarray, placement: sharding.InferenceMesh | None
) -> np.ndarray:
    """bool [B] (host): whether the policy dropped any of the `tokens_read` int [B] tokens of
    each row, i.e. some (layer, KV head) holds fewer (its pages in both tiers, plus its local
    ring); False for a row kept whole (a policy that keeps everything, a budget covering the
    prompt, a prompt shorter than what the policy compresses). On a mesh `kv` is every
    device's, stacked."""
    if placement is None:
        held = sharding.to_host(kv.tokens_held())
    else:
        held = placement.unshard(kv.lengths, row_axis=1, head_axis=2)
        if kv.ring is not None:
            count = np.minimum(placement.unshard(kv.ring.count, 1), kv.ring.window)
            held = held + count[..., None]
    return np.any(held < np.asarray(tokens_read)[None, :, None], axis=(0, 2))


@program(
    static=("chunk", "policy", "backend", "keep_hidden"),
    num_chunks=SAME,
    offsets=ROWS,
    last_hidden=SHARD,
    **_SPAN_PLACEMENTS,
)
def read_tokens(
    model,
    tokens,
    lengths,
    offsets,
    num_chunks,
    budget_tokens,
    thresholds,
    kv,
    last_hidden,
    policy_params,
    *,
    chunk,
    policy,
    backend,
    keep_hidden,
):
    """Reads more tokens over a prefilled state as prefill reads a prompt (in chunks, through
    the policy's admission and scoring), observing nothing, compressing nothing and running no
    chunk eviction: row b's tokens[b, :lengths[b]] go to positions offsets[b] onwards. Does not
    donate `kv` (a session stays valid). Returns (kv, last_hidden [B, D], the hidden states
    [B, T_pad, D] of every token when `keep_hidden`, else None)."""
    hidden = None
    if keep_hidden:
        hidden = jnp.zeros((*tokens.shape, last_hidden.shape[-1]), last_hidden.dtype)
    carry = PrefillCarry(last_hidden, window=None, moments=None, query_moments=None, hidden=hidden)
    kv, carry = _prefill_span(
        model,
        tokens,
        lengths,
        0,
        num_chunks,
        budget_tokens,
        thresholds,
        kv,
        carry,
        policy_params,
        offsets,
        chunk=chunk,
        policy=policy,
        backend=backend,
        evict_chunks=False,
    )
    return kv, carry.last_hidden, carry.hidden


def run_prefill(
    model: Model,
    request: Request,
    key,
    policy_params,
    backend: Backend,
    on_chunk: Callable[[int, int], None] | None = None,
) -> tuple[KVState, jax.Array]:
    """Prefill and compression of a set-up request: (kv, last_hidden [B, D]). With `on_chunk`
    and more than one chunk, one program call per chunk (`ChunkedPrefill`, as for a growing
    pool), calling `on_chunk(chunks done, chunks in all)` after each."""
    prompts = request.prompts
    if request.grows or (on_chunk is not None and prompts.num_chunks > 1):
        prefill = start_chunked_prefill(model, request)
        while not prefill.done:
            prefill = prefill_next_chunk(model, request, prefill, policy_params, backend)
            if on_chunk is not None:
                on_chunk(prefill.chunks_done, prefill.num_chunks)
        kv, last_hidden = finish_chunked_prefill(model, request, prefill, key)
    else:
        kv, last_hidden = prefill_and_compress(
            request.placement,
            model=model,
            tokens=prompts.tokens,
            lengths=prompts.lengths,
            num_chunks=np.int32(prompts.num_chunks),
            budget_tokens=request.budget_tokens,
            prompt_share=request.policy.prompt_share(len(prompts.lengths)),
            thresholds=request.thresholds,
            kv=request.kv,
            key=key,
            policy_params=policy_params,
            chunk=prompts.chunk,
            policy=request.policy.static(),
            int8_window=request.cache.int8_window,
            backend=backend,
        )
    kv.check()
    return kv, last_hidden
