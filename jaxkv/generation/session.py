"""Sessions: a prefilled (and compressed) context as a value that reads more, forks and decodes.

    policy = from_spec("kvzip:0.3").for_tokenizer(tokenizer)  # its prompt in the model's ids
    session = prefill(model, context_ids, policy)          # prefill + the policy's compression
    session = session.extend(more_ids)                     # read more tokens over it
    out = decode(session, max_new_tokens=64)               # decode; `session` stays valid
    rows = session.fork(questions)                         # N rows over one copy of the context
    answers = decode(rows, max_new_tokens=32)

A `Session` is an immutable pytree: `extend` and `fork` return new sessions and never change
the one they read (nor does `decode`), so one compressed context serves any number of
continuations. `generate` is `decode(prefill(...))`.

Forked rows share the context's full pages (`jaxkv.cache.sharing`): bytes held = one context +
per row its question and answer. Nothing writes or frees a shared page: decoding a forked
session with a policy whose decode eviction would run is refused.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import sharding
from jaxkv.attention import Backend, resolve_backend
from jaxkv.cache import KVState
from jaxkv.cache.config import CacheConfig, check_count
from jaxkv.cache.geometry import decode_steps_bucket, pool_pages_bucket, table_pages_bucket
from jaxkv.cache.sharing import duplicate_entries, fork_pages_needed, fork_rows
from jaxkv.compile_log import counting_compiles
from jaxkv.generation.loop import (
    GenState,
    decode_loop,
    decode_loop_keeping_kv,
    repack_program,
    to_decode_geometry,
    token_listener,
)
from jaxkv.generation.mesh import SHARD, program
from jaxkv.generation.prefill import read_tokens, rows_compressed, run_prefill
from jaxkv.generation.request import (
    DEFAULT_PREFILL_CHUNK,
    PromptIds,
    checked_key,
    checked_stop_tokens,
    pad_prompts,
    set_up,
)
from jaxkv.models.decoder import Model, logits_from_hidden
from jaxkv.policies import Policy
from jaxkv.policies.base import PolicyParams
from jaxkv.sampling import Sampler
from jaxkv.sharding import InferenceMesh
from jaxkv.step.rows import Rows, row_keys


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Result of `generate` and `decode` (host arrays).

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
      compressed: bool [B] whether the policy had dropped any token each row had read when
        the decode began (`generate`: its prompt); False for a row kept whole, e.g. a prompt
        shorter than what the policy compresses (`Session.compressed`).
      decode_seconds: wall time of the decode (its compilation included on a first call).
      decode_compile_seconds: the part of `decode_seconds` spent compiling (0 when every
        program was compiled before).
      prefill_seconds: wall time of the prefill and compression (`generate`; None for
        `decode`, whose session was prefilled before), compilation included.
      prefill_compile_seconds: the part of `prefill_seconds` spent compiling (None with it).
    """

    tokens: np.ndarray
    num_tokens: np.ndarray
    pages_in_use: np.ndarray
    int8_pages_in_use: np.ndarray
    memory_bytes: np.ndarray
    policy_trace: np.ndarray | None
    state: KVState
    compressed: np.ndarray
    decode_seconds: float = 0.0
    decode_compile_seconds: float = 0.0
    prefill_seconds: float | None = None
    prefill_compile_seconds: float | None = None

    @property
    def tokens_per_second(self) -> float:
        """Tokens generated (all rows) per second of decode, its compilation left out."""
        running = self.decode_seconds - self.decode_compile_seconds
        return float(np.sum(self.num_tokens)) / max(running, 1e-9)


@flax.struct.dataclass
class Session:
    """A prefilled context: the KV state with what reading on and decoding need.

    Attributes:
      model: the model it was prefilled with (its params are leaves, not copies).
      kv: the KV state (on a mesh: every device's, stacked [S, ...]).
      last_hidden: [B, D] final-normed hidden state of each row's last token read.
      lengths: int32 [B] (host) tokens read per row: the next token's position.
      budget_tokens: int32 [B] (or [B, n], host) the policy's budget per head, from the prompt.
      budget_ratio: f32 [B] (host) the budget as a share of the growing sequence.
      thresholds: f32 [B, n] (host) the policy's thresholds (`Policy.thresholds`).
      policy_params: the policy's learned parameters (None without).
      policy: the policy (static).
      cache: the request's `CacheConfig` (static).
      backend: the attention backend (static).
      placement: the mesh, or None on one device (static).
      shared: whether rows share pages (a `fork`): no eviction may run (static).
    """

    model: Model
    kv: KVState
    last_hidden: jax.Array
    lengths: np.ndarray
    budget_tokens: np.ndarray
    budget_ratio: np.ndarray
    thresholds: np.ndarray
    policy_params: PolicyParams = None
    policy: Policy = flax.struct.field(pytree_node=False, default=None)
    cache: CacheConfig = flax.struct.field(pytree_node=False, default=None)
    backend: Backend = flax.struct.field(pytree_node=False, default=Backend.XLA)
    placement: InferenceMesh | None = flax.struct.field(pytree_node=False, default=None)
    shared: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def rows(self, sampler: Sampler, key: jax.Array) -> Rows:
        """The state each row decodes from (`jaxkv.step.rows.Rows`): what it has read,
        its policy values, its key (row b: `fold_in(key, b)`) and the sampler's settings."""
        return Rows.start(
            prompt_lengths=self.lengths,
            budget_tokens=self.budget_tokens,
            budget_ratio=self.budget_ratio,
            thresholds=self.thresholds,
            keys=row_keys(key, np.arange(self.batch)),
            sampling=sampler.rows(self.batch),
        )

    def memory_bytes(self) -> int:
        """Bytes the KV state holds (shared pages once); host-side int."""
        return self.kv.memory_bytes()

    def compressed(self) -> np.ndarray:
        """bool [B] (host): whether the policy dropped any token each row has read; False for
        a row held whole (a prompt shorter than what the policy compresses, a budget covering
        it, a policy that keeps everything)."""
        return rows_compressed(self.kv, self.lengths, self.placement)

    def extend(self, token_ids: PromptIds, *, prefill_chunk: int | None = None) -> Session:
        """This session with more tokens read (`extend`)."""
        return extend(self, token_ids, prefill_chunk=prefill_chunk)

    def fork(self, questions: Sequence[Sequence[int]], **kwargs) -> Session:
        """One row per question over this one-row session's pages (`fork`)."""
        return fork(self, questions, **kwargs)


def prefill_session(
    model: Model,
    prompt_ids: PromptIds,
    policy: Policy | str | None,
    *,
    reserve_tokens: int,
    positions_after_prompt: int,
    cache: CacheConfig | None,
    prefill_chunk: int | None,
    key: jax.Array,
    backend: Backend,
    policy_params: PolicyParams | None,
    mesh: jax.sharding.Mesh | None,
    on_prefill_chunk: Callable[[int, int], None] | None = None,
) -> Session:
    """`prefill` with the room to reserve and the positions to check given explicitly
    (`generate` reserves its decode's)."""
    request = set_up(
        model,
        prompt_ids,
        policy,
        reserve_tokens=reserve_tokens,
        positions_after_prompt=positions_after_prompt,
        cache=cache,
        prefill_chunk=prefill_chunk,
        policy_params=policy_params,
        mesh=mesh,
    )
    kv, last_hidden = run_prefill(
        request.model, request, key, request.policy_params, backend, on_prefill_chunk
    )
    lengths = request.prompts.lengths
    return Session(
        model=request.model,
        kv=kv,
        last_hidden=last_hidden,
        lengths=lengths,
        budget_tokens=request.budget_tokens,
        budget_ratio=request.policy.budget_ratio(len(lengths)),
        thresholds=request.thresholds,
        policy_params=request.policy_params,
        policy=request.policy,
        cache=request.cache,
        backend=backend,
        placement=request.placement,
    )


def prefill(
    model: Model,
    prompt_ids: PromptIds,
    policy: Policy | str | None = None,
    *,
    cache: CacheConfig | None = None,
    prefill_chunk: int | None = None,
    key: jax.Array | None = None,
    backend: str | Backend = "auto",
    reserve_tokens: int = 0,
    policy_params: PolicyParams | None = None,
    mesh: jax.sharding.Mesh | None = None,
    on_prefill_chunk: Callable[[int, int], None] | None = None,
) -> Session:
    """Prefills the prompts and applies the policy's compression: a `Session`.

    A policy that feeds the model text of its own (KVzip's repeat prompt) is given fitted to
    the model's tokenizer: `policies.from_spec("kvzip:0.3").for_tokenizer(tokenizer)`.
    `key` seeds stochastic policies (GVote); the same key gives the same result.
    `reserve_tokens`: room in the state for that many tokens after each prompt (`extend` and
    `decode` make more room when they need it, at the cost of a copy).
    `cache`, `policy_params`, `prefill_chunk`, `backend`, `mesh`, `on_prefill_chunk`: as for
    `generate`.
    """
    backend = resolve_backend(backend)
    reserve_tokens = check_count("reserve_tokens", reserve_tokens, 0)
    return prefill_session(
        model,
        prompt_ids,
        policy,
        reserve_tokens=reserve_tokens,
        positions_after_prompt=reserve_tokens,
        cache=cache,
        prefill_chunk=prefill_chunk,
        key=jax.random.PRNGKey(0) if key is None else checked_key(key),
        backend=backend,
        policy_params=policy_params,
        mesh=mesh,
        on_prefill_chunk=on_prefill_chunk,
    )


def _new_token_rows(session: Session, token_ids) -> list[list[int]]:
    """`token_ids` as one list per row of the session (one list: the one row of a one-row
    session), checked against the vocabulary and the model's context."""
    batch = session.batch
    if isinstance(token_ids, np.ndarray | jax.Array):
        token_ids = np.asarray(token_ids).reshape(-1, np.shape(token_ids)[-1]).tolist()
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, str) or not token_ids:
        raise ValueError("token_ids must be token ids (one row) or one list of ids per row")
    if all(isinstance(t, int | np.integer) for t in token_ids):
        token_ids = [token_ids]
    rows = [list(row) for row in token_ids]
    if len(rows) != batch:
        raise ValueError(f"token_ids has {len(rows)} rows; the session has {batch}")
    if not any(rows):
        raise ValueError("token_ids holds no token: give at least one")
    vocab = session.model.config.vocab_size
    for i, row in enumerate(rows):
        if any(
            isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < vocab
            for t in row
        ):
            raise ValueError(f"token_ids row {i} holds values outside the token ids [0, {vocab})")
    _check_positions(session, max(len(r) for r in rows), "tokens read")
    return rows


def _check_positions(session: Session, more: int, what: str) -> None:
    longest = int(np.max(session.lengths))
    limit = session.model.config.max_position_embeddings
    if longest + more > limit:
        raise ValueError(
            f"the session's longest row holds {longest} positions; {more} more {what} exceed "
            f"the model's max_position_embeddings={limit}"
        )


def _with_room(session: Session, more: np.ndarray) -> KVState:
    """The session's state with room for `more` int [B] tokens per row: the same state when
    its pool and tables hold them, else a copy in a larger pool (shared pages stay shared).
    On a mesh, every device's pool gets the size the fullest one needs."""
    kv = session.kv
    p = kv.pool.page_size
    held = sharding.to_host(kv.full_precision_lengths()).reshape(-1, *kv.lengths.shape[-3:])
    if session.placement is None:
        more_per_device = more[None]
    else:
        more_per_device = session.placement.rows_per_device(more)
    grown = held + more_per_device[:, None, :, None]  # [S, L, B, K]
    growth = np.sum(-(-grown // p) - -(-held // p), axis=(1, 2, 3))
    free = sharding.to_host(kv.pool.allocator.num_free).reshape(-1)
    width = int(np.max(-(-grown // p)))
    if np.all(growth <= free) and width <= kv.page_table.shape[-1]:
        return kv
    in_use = sharding.to_host(kv.pages_in_use()).reshape(-1)
    num_pages = pool_pages_bucket(int(np.max(in_use + growth)), p)
    kv = repack_program(
        session.placement,
        kv=kv,
        num_pages=max(num_pages, kv.pool.num_pages),
        max_pages=max(table_pages_bucket(width), kv.page_table.shape[-1]),
        int8_geometry=None,
    )
    kv.check()
    return kv


def _check_plain_storage(session: Session, what: str) -> None:
    if session.kv.pool.int8 is not None:
        raise ValueError(
            f"{what} a session with int8 storage is not supported: its tiers move tokens as "
            "they age; prefill without CacheConfig(storage=int8) to read on or fork"
        )


def extend(session: Session, token_ids: PromptIds, *, prefill_chunk: int | None = None) -> Session:
    """The session with more tokens read: one list of ids per row (rows may differ in length,
    some may be empty), read as prefill reads a prompt (in chunks of `prefill_chunk`, through
    the policy's admission and scoring) but not compressed: the policy's prompt compression
    and chunk eviction ran at `prefill`; its decode eviction runs in `decode`. Returns a new
    session; `session` stays valid."""
    rows = _new_token_rows(session, token_ids)
    _check_plain_storage(session, "extending")
    new_session, _ = _read(session, rows, prefill_chunk, keep_hidden=False)
    return new_session


def extend_with_logits(
    session: Session, token_ids: PromptIds, *, prefill_chunk: int | None = None
) -> tuple[Session, jax.Array]:
    """`extend`, and the logits f32 [B, T, V] the model gives after each token read (row b's
    first `len(token_ids[b])` entries; scoring a continuation token by token)."""
    rows = _new_token_rows(session, token_ids)
    _check_plain_storage(session, "extending")
    new_session, hidden = _read(session, rows, prefill_chunk, keep_hidden=True)
    if session.placement is not None:
        hidden = jnp.asarray(session.placement.join_rows(hidden))
    width = max(map(len, rows))
    model = session.model
    return new_session, logits_from_hidden(model.params, model.config, hidden[:, :width])


def _read(session: Session, rows: list[list[int]], prefill_chunk: int | None, keep_hidden: bool):
    more = np.array([len(row) for row in rows], np.int32)
    chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
    padded = pad_prompts(rows, more, chunk)
    kv = _with_room(session, more)
    kv, last_hidden, hidden = read_tokens(
        session.placement,
        model=session.model,
        tokens=padded.tokens,
        lengths=more,
        offsets=session.lengths,
        num_chunks=np.int32(padded.num_chunks),
        budget_tokens=session.budget_tokens,
        thresholds=session.thresholds,
        kv=kv,
        last_hidden=session.last_hidden,
        policy_params=session.policy_params,
        chunk=padded.chunk,
        policy=session.policy.static(),
        backend=session.backend,
        keep_hidden=keep_hidden,
    )
    kv.check()
    new = session.replace(kv=kv, last_hidden=last_hidden, lengths=session.lengths + more)
    return new, hidden


fork_program = program(static=("num_rows", "num_pages", "max_pages"), kv=SHARD)(fork_rows)


def fork(
    session: Session,
    questions: Sequence[Sequence[int]],
    *,
    reserve_tokens: int = 0,
    prefill_chunk: int | None = None,
) -> Session:
    """One row per question over the one-row `session`: every row's page tables point at the
    context's full pages (held once), its own pages hold the context's partial last pages, its
    question (read here, as `extend` reads) and what `decode` writes. `reserve_tokens`: room
    per row for that many tokens after its question (decode makes room otherwise, by a copy).
    Returns a session of len(questions) rows; `session` stays valid."""
    if not isinstance(questions, Sequence) or isinstance(questions, str) or not questions:
        raise ValueError("questions must be a non-empty list of token-id lists, one per row")
    if session.batch != 1:
        raise ValueError(
            f"fork reads one context: this session has {session.batch} rows (prefill one "
            "context, then fork it)"
        )
    if session.placement is not None:
        raise ValueError("fork runs on one device: prefill the context without a mesh")
    _check_plain_storage(session, "forking")
    reserve_tokens = check_count("reserve_tokens", reserve_tokens, 0)
    num_rows = len(questions)
    broadcast = session.replace(
        lengths=np.repeat(session.lengths, num_rows),
        last_hidden=jnp.repeat(session.last_hidden, num_rows, axis=0),
        budget_tokens=np.repeat(session.budget_tokens, num_rows, axis=0),
        budget_ratio=np.repeat(session.budget_ratio, num_rows, axis=0),
        thresholds=np.repeat(session.thresholds, num_rows, axis=0),
        shared=True,
    )
    rows = _new_token_rows(broadcast, [list(q) for q in questions])
    if not all(rows):
        empty = next(i for i, row in enumerate(rows) if not row)
        raise ValueError(f"question {empty} is empty: every question needs >= 1 token")
    kv = session.kv
    p, longest = kv.pool.page_size, max(map(len, rows)) + reserve_tokens
    heads = kv.num_layers * kv.page_table.shape[-2]
    own = num_rows * heads * (-(-longest // p) + 1)
    max_len = int(np.max(sharding.to_host(kv.lengths)))
    kv = fork_program(
        None,
        kv=kv,
        num_rows=num_rows,
        num_pages=pool_pages_bucket(fork_pages_needed(kv, num_rows) + own, p),
        max_pages=table_pages_bucket(-(-(max_len + longest) // p)),
    )
    kv.check()
    return extend(broadcast.replace(kv=kv), rows, prefill_chunk=prefill_chunk)


def _check_shared_decode(session: Session, max_new_tokens: int) -> None:
    """A forked session decodes only where no eviction runs: it would free shared pages."""
    if session.shared:
        check_shared_decode(session.policy, max_new_tokens)


def check_shared_decode(policy: Policy, max_new_tokens: int) -> None:
    """ValueError unless `policy` decodes `max_new_tokens` tokens of rows that share pages
    (a forked session, `ask`) without evicting: eviction would free pages the rows share."""
    eviction = policy.decode_eviction
    if eviction is None or max_new_tokens <= eviction.decode_interval:
        return
    raise ValueError(
        f"policy {policy.name!r} evicts during decode every "
        f"{eviction.decode_interval} step(s), which would free pages its rows share: decode "
        f"a forked session with max_new_tokens <= {eviction.decode_interval}, or with a "
        "policy that compresses the prompt only (e.g. 'kvzip:0.3', 'snapkv:0.3')"
    )


def decode(
    session: Session,
    max_new_tokens: int,
    *,
    sampler: Sampler | None = None,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
    pad_id: int = 0,
    on_token: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
) -> GenerateOutput:
    """Generates up to `max_new_tokens` tokens per row after what the session has read, the
    policy's decode eviction applied as in `generate`. `session` stays valid: decoding it again
    (another sampler, key or length) starts from the same state.

    sampler: default greedy; a PRNG `key` is required when it is not greedy. stop_tokens: ids
    that end a row (default: the model's eos ids). on_token: `on_token(step, tokens int32 [B],
    done bool [B])`, called in order as each step's tokens are sampled (from inside the jitted
    loop, through `jax.debug.callback`); one device only.
    """
    return _decode(
        session,
        max_new_tokens,
        sampler=sampler,
        key=key,
        stop_tokens=stop_tokens,
        pad_id=pad_id,
        consume=False,
        on_token=on_token,
    )


def sampling_key(sampler: Sampler | None, key) -> tuple[Sampler, jax.Array]:
    """(sampler, key): greedy by default; a key is required when sampling."""
    sampler = Sampler() if sampler is None else sampler
    if key is None:
        if not sampler.greedy:
            raise ValueError("a PRNG key is required when sampling (temperature > 0)")
        key = jax.random.PRNGKey(0)
    return sampler, checked_key(key)


def _decode(
    session: Session,
    max_new_tokens: int,
    *,
    sampler: Sampler | None,
    key,
    stop_tokens,
    pad_id: int,
    consume: bool,
    on_token=None,
) -> GenerateOutput:
    """`decode`; `consume`: the session's state may be donated to the loop (`generate`)."""
    if not isinstance(session, Session):
        raise ValueError(f"session={session!r}: give a jaxkv Session (jaxkv.prefill)")
    if on_token is not None and session.placement is not None:
        raise ValueError("on_token streams from one device: decode without a mesh")
    start = time.perf_counter()
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
    sampler, key = sampling_key(sampler, key)
    stop_tokens = checked_stop_tokens(session.model, stop_tokens)
    _check_positions(session, max_new_tokens, "new tokens")
    _check_shared_decode(session, max_new_tokens)
    policy, placement = session.policy, session.placement
    compressed = session.compressed()  # before the loop, which may consume the state
    kv = to_decode_geometry(
        session.kv,
        policy,
        budget_tokens=session.budget_tokens,
        lengths=session.lengths,
        placement=placement,
        num_pages=session.cache.num_pages if not session.shared else None,
        max_new_tokens=max_new_tokens,
        duplicate_entries=duplicate_entries(session.kv) if session.shared else 0,
    )
    loop = decode_loop if consume else decode_loop_keeping_kv
    with token_listener(on_token) as listener, counting_compiles() as compiled:
        state = loop(
            placement,
            model=session.model,
            kv=kv,
            last_hidden=session.last_hidden,
            rows=session.rows(sampler, key),
            max_new_tokens=np.int32(max_new_tokens),
            stop_tokens=jnp.asarray(stop_tokens, jnp.int32).reshape(-1),
            policy_params=session.policy_params,
            steps_bucket=decode_steps_bucket(max_new_tokens),
            policy=policy.static(),
            pad_id=pad_id,
            backend=session.backend,
            listener=listener,
        )
        out = _output(state, max_new_tokens, stop_tokens, placement, compressed)
    return dataclasses.replace(
        out, decode_seconds=time.perf_counter() - start, decode_compile_seconds=compiled.seconds
    )


def _output(
    state: GenState,
    max_new_tokens: int,
    stop_tokens,
    placement: InferenceMesh | None,
    compressed: np.ndarray,
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
        compressed=compressed,
    )
