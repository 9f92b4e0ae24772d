"""Sessions: a prefilled (and compressed) context as a value that reads more and forks (its
decode driver is `jaxkv.generation.decoding`).

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
session with a policy whose decode eviction would run is refused. With int8 storage the rows
share the int8 tier's full pages and each copies the context's window (its tokens move as they
age); such a session reads in chunks of at most its window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import sharding
from jaxkv.attention import Backend, resolve_backend
from jaxkv.cache import KVState
from jaxkv.cache.config import CacheConfig, check_count
from jaxkv.cache.geometry import pool_pages_bucket, table_pages_bucket
from jaxkv.cache.sharing import fork_pages_needed, fork_rows
from jaxkv.generation.loop import (
    repack_program,
)
from jaxkv.generation.mesh import SHARD, program
from jaxkv.generation.prefill import read_tokens, rows_compressed, run_prefill
from jaxkv.generation.request import (
    DEFAULT_PREFILL_CHUNK,
    PromptIds,
    Request,
    checked_key,
    pad_prompts,
    set_up,
)
from jaxkv.models.decoder import Model, logits_from_hidden
from jaxkv.policies import Policy
from jaxkv.policies.base import PolicyParams
from jaxkv.sampling import Sampler
from jaxkv.sharding import InferenceMesh
from jaxkv.step.rows import Rows, row_keys


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
    return prefilled_session(request, kv, last_hidden, backend)


def prefilled_session(request: Request, kv, last_hidden, backend: Backend) -> Session:
    """The session of a set-up request whose prompts `kv` holds (prefilled and compressed),
    last_hidden [B, D] their last tokens' hidden states."""
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
    check_positions(session, max(len(r) for r in rows), "tokens read")
    return rows


def check_positions(session: Session, more: int, what: str) -> None:
    longest = int(np.max(session.lengths))
    limit = session.model.config.max_position_embeddings
    if longest + more > limit:
        raise ValueError(
            f"the session's longest row holds {longest} positions; {more} more {what} exceed "
            f"the model's max_position_embeddings={limit}"
        )


def _growth(p: int, held: np.ndarray, grown: np.ndarray) -> tuple[np.ndarray, int]:
    """(pages each device [S] adds when its heads grow from `held` to `grown` int [S, L, B, K]
    tokens in `p`-token pages, the most pages one head then needs)."""
    growth = np.sum(-(-grown // p) - -(-held // p), axis=(1, 2, 3))
    return growth, int(np.max(-(-grown // p)))


def _pages_to_grow(pool, page_table, held: np.ndarray, grown: np.ndarray):
    """Whether `pool` (one device's, or stacked [S, ...]) and its tables hold heads growing
    from `held` to `grown` int [S, L, B, K] tokens, and else the (num_pages, max_pages) of a
    pool that does: the fullest device's pages in use plus its growth (shared pages stay
    shared), and tables as wide as the longest head."""
    p = pool.page_size
    growth, width = _growth(p, held, grown)
    free = sharding.to_host(pool.allocator.num_free).reshape(-1)
    in_use = sharding.to_host(pool.allocator.pages_in_use()).reshape(-1)
    fits = bool(np.all(growth <= free)) and width <= page_table.shape[-1]
    num_pages = max(pool_pages_bucket(int(np.max(in_use + growth)), p), pool.num_pages)
    return fits, (num_pages, max(table_pages_bucket(width), page_table.shape[-1]))


def _per_device(kv: KVState, lengths) -> np.ndarray:
    """int [S, L, B, K] of a state's lengths [L, B, K] (or stacked [S, ...]), on the host."""
    return sharding.to_host(lengths).reshape(-1, *kv.lengths.shape[-3:])


def _tier_growth(kv: KVState, more: np.ndarray, chunk: int):
    """((held, grown) of the model-dtype pages, (held, grown) of the int8 tier or None): the
    tokens per head [S, L, B, K] before and at most during a read of more int [S, 1, B, 1]
    tokens per head in `chunk`-token chunks. With int8 storage the model-dtype pages hold at
    most the window plus a chunk (the step writes a chunk, then spills the oldest to int8)."""
    full = _per_device(kv, kv.full_precision_lengths())
    tier = kv.pool.int8
    if tier is None:
        return (full, full + more), None
    int8 = _per_device(kv, tier.lengths)
    peak = np.minimum(full + more, np.maximum(full, tier.window) + np.minimum(more, chunk))
    return (full, peak), (int8, int8 + np.maximum(full + more - tier.window, 0))


def _with_room(session: Session, more: np.ndarray, chunk: int) -> KVState:
    """The session's state with room for `more` int [B] tokens per row read in `chunk`-token
    chunks: the same state when its pools and tables hold them, else a copy in larger pools
    (shared pages stay shared). On a mesh, every device's pool gets the size the fullest one
    needs."""
    kv = session.kv
    if session.placement is None:
        more_per_device = more[None]
    else:
        more_per_device = session.placement.rows_per_device(more)
    full, int8 = _tier_growth(kv, more_per_device[:, None, :, None], chunk)
    fits, geometry = _pages_to_grow(kv.pool, kv.page_table, *full)
    int8_geometry = None
    if int8 is not None:
        tier = kv.pool.int8
        int8_fits, int8_geometry = _pages_to_grow(tier.pool, tier.page_table, *int8)
        fits = fits and int8_fits
    if fits:
        return kv
    kv = repack_program(
        session.placement,
        kv=kv,
        num_pages=geometry[0],
        max_pages=geometry[1],
        int8_geometry=int8_geometry,
    )
    kv.check()
    return kv


def read_chunk_size(session: Session, prefill_chunk: int | None) -> int:
    """The chunk `extend` reads in: `prefill_chunk`, by default `DEFAULT_PREFILL_CHUNK`; with
    int8 storage at most the session's `full_precision_window` (a chunk is read in the model
    dtype: a larger one is refused), by default the smaller of the two."""
    tier = session.kv.pool.int8
    if prefill_chunk is None:
        return DEFAULT_PREFILL_CHUNK if tier is None else min(DEFAULT_PREFILL_CHUNK, tier.window)
    prefill_chunk = check_count("prefill_chunk", prefill_chunk, 1)
    if tier is not None and prefill_chunk > tier.window:
        raise ValueError(
            f"prefill_chunk={prefill_chunk} exceeds the session's full_precision_window="
            f"{tier.window}: with int8 storage a chunk is read in the model dtype; give "
            f"prefill_chunk <= {tier.window}"
        )
    return prefill_chunk


def extend(session: Session, token_ids: PromptIds, *, prefill_chunk: int | None = None) -> Session:
    """The session with more tokens read: one list of ids per row (rows may differ in length,
    some may be empty), read as prefill reads a prompt (in chunks of `prefill_chunk`, through
    the policy's admission and scoring) but not compressed: the policy's prompt compression
    and chunk eviction ran at `prefill`; its decode eviction runs in `decode`. Returns a new
    session; `session` stays valid."""
    rows = _new_token_rows(session, token_ids)
    new_session, _ = _read(session, rows, prefill_chunk, keep_hidden=False)
    return new_session


def extend_with_logits(
    session: Session, token_ids: PromptIds, *, prefill_chunk: int | None = None
) -> tuple[Session, jax.Array]:
    """`extend`, and the logits f32 [B, T, V] the model gives after each token read (row b's
    first `len(token_ids[b])` entries; scoring a continuation token by token)."""
    rows = _new_token_rows(session, token_ids)
    new_session, hidden = _read(session, rows, prefill_chunk, keep_hidden=True)
    if session.placement is not None:
        hidden = jnp.asarray(session.placement.join_rows(hidden))
    width = max(map(len, rows))
    model = session.model
    return new_session, logits_from_hidden(model.params, model.config, hidden[:, :width])


def _read(session: Session, rows: list[list[int]], prefill_chunk: int | None, keep_hidden: bool):
    more = np.array([len(row) for row in rows], np.int32)
    padded = pad_prompts(rows, more, read_chunk_size(session, prefill_chunk))
    kv = _with_room(session, more, padded.chunk)
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


fork_program = program(static=("num_rows", "num_pages", "max_pages", "int8_geometry"), kv=SHARD)(
    fork_rows
)


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
    reserve_tokens = check_count("reserve_tokens", reserve_tokens, 0)
    chunk = read_chunk_size(session, prefill_chunk)
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
    longest = max(map(len, rows)) + reserve_tokens
    geometry = _fork_geometry(session.kv, num_rows, longest, chunk)
    kv = fork_program(None, kv=session.kv, num_rows=num_rows, **geometry)
    kv.check()
    return extend(broadcast.replace(kv=kv), rows, prefill_chunk=chunk)


def _fork_geometry(kv: KVState, num_rows: int, longest: int, chunk: int) -> dict:
    """`fork_rows`' geometry for `num_rows` rows over the one-row `kv`, each with room for
    `longest` more tokens read in `chunk`-token chunks: num_pages, max_pages and int8_geometry
    (None without an int8 tier)."""
    p = kv.pool.page_size
    forked, int8_forked = fork_pages_needed(kv, num_rows)
    full, int8 = _tier_growth(kv, np.array(longest), chunk)

    def geometry(forked_pages, held, grown):  # every row grows as the context's one row
        growth, width = _growth(p, held, grown)
        pages = forked_pages + num_rows * int(growth[0])
        return pool_pages_bucket(pages, p), table_pages_bucket(width)

    num_pages, max_pages = geometry(forked, *full)
    int8_geometry = None if int8 is None else geometry(int8_forked, *int8)
    return dict(num_pages=num_pages, max_pages=max_pages, int8_geometry=int8_geometry)
