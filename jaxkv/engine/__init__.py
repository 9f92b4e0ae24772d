"""Continuous batching: requests that come and go share one page pool and a fixed set of slots.

    engine = Engine(model, "snapkv:0.3", cache=CacheConfig(num_pages=2048), max_slots=8)
    first = engine.submit(prompt_ids, max_new_tokens=64)
    for event in engine.stream():           # TokenEvent(request_id, token, finished, reason)
        ...

`submit` refuses a request that its plan says the pool could not hold even alone
(`TooLargeForPoolError`, `pages_needed_alone`). Every page a request holds is the pool's, from
its first prompt chunk on: the engine's state has `max_slots` decode slots and `max_prefills`
prefill rows over one pool. Each `step` is a plan and its execution: the scheduler
(`jaxkv.engine.scheduler.plan_step`, pure host code over page counts) decides which prefilled
requests move into free slots, which are preempted when the running requests' next step would
not fit (swapped out to the host, their state kept whole), which slots decode, and which
prefill rows read their next chunk under the step's token budget (`max_batched_tokens`: vLLM's
knob, decode rows counted). The engine runs the plan with its jitted programs
(`jaxkv.engine.programs`): one decode step of every running slot, then one chunk of every
prefill row the plan reads, batched into one forward pass (several requests' chunks widen the
matmuls); a row whose prompt is read is compressed by the policy and samples its first token.
Finished requests return their pages at once, so a smaller cache per request admits more
requests.

Every slot carries its request's row state (`jaxkv.step.rows.Rows`: prompt length, budget, key,
step, sampler settings) and runs `generate`'s own decode step (`decode_and_sample`), and every
prefill row reads its prompt in `generate`'s chunks, so greedy and sampled tokens equal
`generate` on the same prompt, policy and key, preempted or not.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import Backend, resolve_backend
from jaxkv.cache import CacheConfig, KVState
from jaxkv.cache.config import check_count
from jaxkv.cache.geometry import pool_pages_bucket, table_pages_bucket
from jaxkv.compile_log import compiling_as
from jaxkv.engine import programs
from jaxkv.engine.scheduler import Prefilling, Ready, Running, View, Waiting, plan_step
from jaxkv.generation.prefill import empty_carry
from jaxkv.generation.request import (
    DEFAULT_PREFILL_CHUNK,
    Prompts,
    checked_key,
    checked_prompts,
    checked_stop_tokens,
    default_prefill_chunk,
    pad_prompts,
    prompt_lists,
)
from jaxkv.models.configs import ModelConfig
from jaxkv.models.decoder import Model
from jaxkv.pallas_kernels.common import next_power_of_two
from jaxkv.policies import FullCache, Policy, from_spec
from jaxkv.policies.base import PolicyParams
from jaxkv.sampling import Sampler
from jaxkv.step.parts import local_window
from jaxkv.step.rows import Rows, row_keys


class QueueFullError(ValueError):
    """`Engine.submit` found the waiting queue at its bound (`max_waiting`)."""


class TooLargeForPoolError(ValueError):
    """`Engine.submit`: the request's plan needs more pages than the pool holds, even alone.

    Attributes:
      pages_needed: the plan's pages (`pages_needed_alone`).
      num_pages: the pool's pages.
      field: what to shrink: "prompt_ids" (the prompt does not fit with a single new token) or
        "max_new_tokens" (a smaller one fits).
    """

    def __init__(self, message: str, *, pages_needed: int, num_pages: int, field: str):
        super().__init__(message)
        self.pages_needed, self.num_pages, self.field = pages_needed, num_pages, field


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """A token produced for a request (or its end without one: token -1).

    reason: why the request finished, None while it runs: "stop" (a stop token), "length"
      (max_new_tokens), "too_large" (it needed more pages than the pool has while running alone:
      its compressed prompt or its growth came out larger than `pages_needed_alone` planned, which
      `submit` checks).
    compressed: on the first token after a request's prefill, whether the policy compressed its
      prompt (False: kept whole, e.g. shorter than what the policy compresses); None on others.
    """

    request_id: int
    token: int
    finished: bool
    reason: str | None = None
    compressed: bool | None = None


@dataclasses.dataclass(eq=False)  # a request is itself: compared by identity
class _Request:
    """A request's host-side bookkeeping (mutable: the engine's own).

    Where it is: in the queue; in prefill row `row` (reading its prompt, `read` tokens so far,
    until `state` is set); ready (`state` set: its row state after its first token), in its
    prefill row or swapped out to the host (`swapped`: its one-row KV state); in a slot.
    """

    id: int
    prompts: Prompts  # its prompt, padded into its chunks
    budget_tokens: np.ndarray
    thresholds: np.ndarray
    peak_pages: int  # the most pages it holds from its first chunk to its first decode step
    max_new_tokens: int
    sampler: Sampler
    key: jax.Array  # the decode key (`generate` splits the request key into prefill, decode)
    prefill_key: jax.Array
    stop: frozenset[int]
    generated: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    order: int = -1  # when it first started its prefill, for whom to admit or preempt first
    row: int | None = None
    read: int = 0
    state: Rows | None = None
    swapped: KVState | None = None
    swapped_pages: tuple[int, int] = (0, 0)  # (held, growth) of its swapped-out state

    @property
    def length(self) -> int:
        return int(self.prompts.lengths[0])

    @property
    def next_chunk(self) -> int:
        return min(self.prompts.chunk, self.length - self.read)


def _heads(config: ModelConfig) -> int:
    return config.num_layers * config.num_kv_heads


def prefill_peak_pages(
    policy: Policy, config: ModelConfig, prompt_length: int, chunk: int, page_size: int
) -> int:
    """The most pages of the pool a request holds from its first prompt chunk to its first
    decode step (host): every head's prompt and one token more, or a chunk eviction's bound
    (Fast KVzip: what it keeps plus a chunk) where that is lower. A policy that admits or
    compresses holds at most the whole prompt while it reads it."""
    full = _heads(config) * -(-(prompt_length + 1) // page_size)
    if policy.chunk_eviction is None:
        return full
    lengths = np.array([prompt_length])
    return min(full, policy.chunk_eviction.prefill_pages(lengths, chunk, config, page_size, 1))


def engine_chunk(policy: Policy, prompt_length: int, prefill_chunk: int | None) -> int:
    """The chunk a prompt of `prompt_length` tokens is read in (`generate`'s)."""
    lengths = np.array([prompt_length])
    chunk = default_prefill_chunk(policy, lengths) if prefill_chunk is None else prefill_chunk
    return pad_prompts([[0] * prompt_length], lengths, chunk).chunk


def pages_needed_alone(
    policy: Policy,
    config: ModelConfig,
    prompt_length: int,
    max_new_tokens: int,
    page_size: int,
    prefill_chunk: int | None = None,
) -> int:
    """The most pages of the pool one request holds in the engine, alone (host; from shapes, as
    `jaxkv bench plan` plans a request): its prefill's peak (`prefill_peak_pages`) or its
    decode's, whichever is larger.

    At decode each of its layers x KV heads holds at most the policy's planned tokens after the
    prompt (`Policy.planned_tokens`: the budget; the whole prompt where what is kept depends on
    the data, e.g. WG-KV's gates or GVote's votes) and grows by max_new_tokens - 1 (the last
    token is sampled, never written), to its decode eviction's `decode_tokens_bound` where that
    is lower; admission asks room for one more token than the prompt holds. A plan below the
    whole prompt is an average that heads may split unevenly (a budget shared across heads,
    PyramidKV's layers): each head then rounds up to a page of its own.
    """
    chunk = engine_chunk(policy, prompt_length, prefill_chunk)
    peak = prefill_peak_pages(policy, config, prompt_length, chunk, page_size)
    lengths = np.array([prompt_length])
    budget = policy.budget_tokens(lengths)
    held = int(policy.planned_tokens(budget, lengths)[0][0])
    grown = held + max_new_tokens - 1
    if policy.decode_eviction is not None:
        bound = policy.decode_eviction.decode_tokens_bound(budget, lengths, max_new_tokens)
        grown = min(grown, int(bound[0]))
    tokens = max(grown, held + 1)
    heads = _heads(config)
    if held >= prompt_length and not policy.decides_across_heads:
        return max(peak, heads * -(-tokens // page_size))  # every head holds at most `tokens`
    return max(peak, (heads * tokens + heads * (page_size - 1)) // page_size)


class Engine:
    """Continuous batching over one paged pool (module docstring).

    Args:
      model: the model.
      policy: the cache policy every request uses (or its spec, "kvzip:0.3"); default full.
      cache: the pool: `CacheConfig(num_pages=...)` (required: the engine's memory), its page size
        and kv dtype; int8 storage is not supported here.
      max_slots: requests decoded at once.
      max_prefills: requests whose prompts are read at once (prefill rows).
      max_batched_tokens: the most tokens one step runs, a decode row's token and a prefill
        chunk's tokens counted (default: room for every slot and a full chunk of every prefill
        row); at least max_slots + the prefill chunk.
      max_context: the longest prompt + generation a request may have (default: the model's
        max_position_embeddings, at most 8192); sizes the page tables.
      max_waiting: the bound of the waiting queue (`submit` raises QueueFullError past it).
      policy_params, prefill_chunk, backend: as for `generate`.

    Compiles: `jaxkv.engine.programs` lists its programs; one engine compiles each once, except
    a prefill chunk (once per bucket of rows read at once, a power of two up to max_prefills,
    and of chunk tokens, a power of two from 16 up to the chunk), a compression that reads the
    prompt's tokens (per prompt bucket) and swaps (per bucket of a swapped request's pages).
    """

    def __init__(
        self,
        model: Model,
        policy: Policy | str | None = None,
        *,
        cache: CacheConfig,
        max_slots: int,
        max_prefills: int = 4,
        max_batched_tokens: int | None = None,
        max_context: int | None = None,
        max_waiting: int = 256,
        policy_params: PolicyParams | None = None,
        prefill_chunk: int | None = None,
        backend: str | Backend = "auto",
    ):
        policy = FullCache() if policy is None else policy
        self.policy = from_spec(policy) if isinstance(policy, str) else policy
        if not isinstance(cache, CacheConfig) or cache.num_pages is None:
            raise ValueError("cache must be a CacheConfig with num_pages set: the engine's pool")
        if cache.int8_window is not None:
            raise ValueError("the engine does not run int8 storage: give storage='model'")
        self.policy.check_params(policy_params, model.config)
        self.model, self.cache, self.policy_params = model, cache, policy_params
        self.max_slots = check_count("max_slots", max_slots, 1)
        self.max_prefills = check_count("max_prefills", max_prefills, 1)
        self.prefill_chunk = (
            None if prefill_chunk is None else check_count("prefill_chunk", prefill_chunk, 1)
        )
        chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else self.prefill_chunk
        if max_batched_tokens is None:
            max_batched_tokens = self.max_slots + self.max_prefills * chunk
        self.max_batched_tokens = check_count(
            "max_batched_tokens", max_batched_tokens, self.max_slots + min(chunk, 16)
        )
        limit = model.config.max_position_embeddings
        self.max_context = check_count(
            "max_context", min(limit, 8192) if max_context is None else max_context, 1
        )
        if self.max_context > limit:
            raise ValueError(
                f"max_context={self.max_context} exceeds the model's "
                f"max_position_embeddings={limit}"
            )
        self.max_waiting = check_count("max_waiting", max_waiting, 1)
        self.backend = resolve_backend(backend)
        cfg, p = model.config, cache.page_size
        width = table_pages_bucket(-(-self.max_context // p))
        self.kv = KVState.create(
            num_layers=cfg.num_layers,
            batch=self.max_slots + self.max_prefills,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            max_tokens=width * p,
            page_size=p,
            num_pages=cache.num_pages,
            dtype=cache.dtype_for(model.dtype),
            key_bounds=self.policy.selection is not None,
            local_window=local_window(self.policy),
        )
        static = self.policy.static()
        self._carry = empty_carry(None, model=model, batch=self.max_prefills, policy=static)
        self._slots: list[_Request | None] = [None] * self.max_slots
        self._prefill_rows: list[_Request | None] = [None] * self.max_prefills
        self._ready: list[_Request] = []  # prefilled, waiting for a slot, oldest first
        self._waiting: collections.deque[_Request] = collections.deque()
        self._next_id = 0
        self._started = 0
        self._rows: Rows | None = None  # every slot's row state, from the first admission on
        self.preemptions = 0

    # --- requests ------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampler: Sampler | None = None,
        key: jax.Array | None = None,
        stop_tokens: Sequence[int] | None = None,
    ) -> int:
        """Queues one prompt (token ids); returns its request id. Checked here, before anything
        runs: the ids, max_new_tokens >= 1, prompt + max_new_tokens <= max_context, the
        policy's budget, its chunk against max_batched_tokens, the pages the request may hold
        alone against the pool (`TooLargeForPoolError`), the key (required when sampling), the
        stop tokens; QueueFullError past `max_waiting`."""
        rows = prompt_lists(prompt_ids)
        if len(rows) != 1:
            raise ValueError(f"prompt_ids holds {len(rows)} prompts: submit one at a time")
        prompts = checked_prompts(self.model, self.policy, rows, self.prefill_chunk)
        length = int(prompts.lengths[0])
        max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
        if length + max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt of {length} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"engine's max_context={self.max_context}"
            )
        if prompts.chunk + self.max_slots > self.max_batched_tokens:
            raise ValueError(
                f"the prompt is read in chunks of {prompts.chunk} tokens with policy "
                f"{self.policy.name!r}: give max_batched_tokens >= {prompts.chunk + self.max_slots}"
                f" (the chunk and a token of each of max_slots={self.max_slots}), not "
                f"{self.max_batched_tokens}"
            )
        budget_tokens = self.policy.budget_tokens(prompts.lengths)
        self._check_fits_alone(length, max_new_tokens)
        sampler = Sampler() if sampler is None else sampler
        if key is None:
            if not sampler.greedy:
                raise ValueError("a PRNG key is required when sampling (temperature > 0)")
            key = jax.random.PRNGKey(0)
        stop = frozenset(checked_stop_tokens(self.model, stop_tokens))
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(
                f"the engine's queue holds max_waiting={self.max_waiting} requests: retry later"
            )
        prefill_key, decode_key = jax.random.split(checked_key(key))
        request = _Request(
            id=self._next_id,
            prompts=prompts,
            budget_tokens=budget_tokens,
            thresholds=self.policy.thresholds(1),
            peak_pages=prefill_peak_pages(
                self.policy, self.model.config, length, prompts.chunk, self.cache.page_size
            ),
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            key=decode_key,
            prefill_key=prefill_key,
            stop=stop,
        )
        self._next_id += 1
        self._waiting.append(request)
        return request.id

    def _check_fits_alone(self, length: int, max_new_tokens: int) -> None:
        """TooLargeForPoolError when the request's plan needs more pages than the pool has
        (the policy's own budget checks run first, named)."""

        def needed(new_tokens: int) -> int:
            return pages_needed_alone(
                self.policy,
                self.model.config,
                length,
                new_tokens,
                self.cache.page_size,
                self.prefill_chunk,
            )

        pool = self.kv.pool.num_pages
        pages = needed(max_new_tokens)
        if pages <= pool:
            return
        # needed() grows with max_new_tokens: the count of smaller ones that fit is the largest.
        fitting = bisect.bisect_right(range(1, max_new_tokens), pool, key=needed)
        advice = (
            f"give max_new_tokens <= {fitting}, or a shorter prompt"
            if fitting
            else "give a shorter prompt"
        )
        raise TooLargeForPoolError(
            f"prompt of {length} tokens + max_new_tokens={max_new_tokens} may need {pages} pages "
            f"with policy {self.policy.name!r}, more than the pool's num_pages={pool} hold: "
            f"{advice}, or a larger pool",
            pages_needed=pages,
            num_pages=pool,
            field="max_new_tokens" if fitting else "prompt_ids",
        )

    def cancel(self, request_id: int) -> bool:
        """Ends a request wherever it is now (queued, prefilling, ready, swapped out or
        running), its pages returned; False if unknown."""
        for request in list(self._waiting):
            if request.id == request_id:
                self._waiting.remove(request)
                return True
        for request in list(self._ready):
            if request.id == request_id:
                self._ready.remove(request)
                if request.row is not None:
                    self._free_prefill_row(request.row)
                return True
        for row, request in enumerate(self._prefill_rows):
            if request is not None and request.id == request_id:
                self._free_prefill_row(row)
                return True
        for slot, request in enumerate(self._slots):
            if request is not None and request.id == request_id:
                self._free_slot(slot)
                return True
        return False

    def has_work(self) -> bool:
        held = any(r is not None for r in self._slots + self._prefill_rows)
        return held or bool(self._waiting) or bool(self._ready)

    def stats(self) -> dict:
        """Requests running and waiting (queued, prefilling or prefilled), pages in use and the
        pool's size, the bytes of a local ring beside the pool (WG-KV's: every row's,
        reserved at creation; 0 without one), the KV bytes held in all (pages in use and ring;
        host values) and the preemptions so far."""
        in_rows = sum(r is not None and r.state is None for r in self._prefill_rows)
        return {
            "running": sum(r is not None for r in self._slots),
            "waiting": len(self._waiting) + in_rows + len(self._ready),
            "pages_in_use": int(self.kv.pages_in_use()),
            "num_pages": self.kv.pool.num_pages,
            "ring_bytes": self.kv.ring_bytes,
            "kv_bytes_in_use": self.kv.memory_bytes(),
            "preemptions": self.preemptions,
        }

    def stream(self) -> Iterator[TokenEvent]:
        """Steps until every request has finished, yielding each token as it is produced."""
        while self.has_work():
            yield from self.step()

    def run(self) -> dict[int, list[int]]:
        """Steps until every request has finished; each request's tokens."""
        tokens: dict[int, list[int]] = collections.defaultdict(list)
        for event in self.stream():
            if event.token >= 0:
                tokens[event.request_id].append(event.token)
        return dict(tokens)

    # --- the step: plan, execute ------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """One step: the scheduler's plan (`jaxkv.engine.scheduler.plan_step`) of what the
        engine holds now, executed in its order (refusals, preemptions, admissions, a decode
        step of every running request, a chunk of every prefill row it reads); the tokens
        produced."""
        plan = plan_step(self._view())
        events: list[TokenEvent] = []
        for order in plan.refuse:
            request = next(r for r in self._ready if r.order == order)
            self._ready.remove(request)
            if request.row is not None:
                self._free_prefill_row(request.row)
            events.append(TokenEvent(request.id, -1, True, "too_large"))
        queued = list(self._waiting)
        for index in plan.refuse_waiting:
            self._waiting.remove(queued[index])
            events.append(TokenEvent(queued[index].id, -1, True, "too_large"))
        for slot in plan.preempt:
            self._swap_out(self._slots[slot], slot)
            self._slots[slot] = None
        for row in plan.swap_out:
            self._swap_out(self._prefill_rows[row], self.max_slots + row)
            self._prefill_rows[row] = None
        for row in plan.abort:
            request = self._prefill_rows[row]
            self._free_prefill_row(row)
            request.read = 0
            self._waiting.appendleft(request)
        for slot in plan.too_large:
            request = self._slots[slot]
            self._free_slot(slot)
            events.append(TokenEvent(request.id, -1, True, "too_large"))
        for order, slot in plan.admit:
            self._admit(next(r for r in self._ready if r.order == order), slot)
        if plan.decode:
            with compiling_as("the engine's decode step"):
                self._decode(plan.decode, events)
        if plan.prefill or plan.start:
            for row in plan.start:
                self._start_prefill(self._waiting.popleft(), row)
            with compiling_as("the engine's prefill chunk"):
                self._read_chunks(sorted(plan.prefill + plan.start), events)
        return events

    def _view(self) -> View:
        """What the scheduler sees: each row's pages (one small program) and the pool's."""
        held, growth = (np.asarray(x) for x in programs.row_pages(self.kv))
        s = self.max_slots
        running = tuple(
            Running(slot, r.order, int(held[slot]), int(growth[slot]))
            for slot, r in enumerate(self._slots)
            if r is not None
        )
        ready = tuple(
            Ready(r.order, None, *r.swapped_pages)
            if r.row is None
            else Ready(r.order, r.row, int(held[s + r.row]), int(growth[s + r.row]))
            for r in self._ready
        )
        prefilling = []
        for row, r in enumerate(self._prefill_rows):
            if r is None or r.state is not None:
                continue
            row_held = int(held[s + row])
            reserved = max(r.peak_pages - row_held, 0)
            prefilling.append(
                Prefilling(
                    row=row,
                    order=r.order,
                    held_pages=row_held,
                    reserved_pages=reserved,
                    chunk_tokens=r.next_chunk,
                    chunk_pages=min(self._chunk_pages(r.next_chunk), reserved),
                )
            )
        free_rows = tuple(i for i, r in enumerate(self._prefill_rows) if r is None)
        waiting = tuple(
            Waiting(r.peak_pages, r.next_chunk) for r in list(self._waiting)[: len(free_rows)]
        )
        return View(
            running=running,
            ready=ready,
            prefilling=tuple(prefilling),
            waiting=waiting,
            free_slots=tuple(i for i, r in enumerate(self._slots) if r is None),
            free_rows=free_rows,
            free_pages=int(self.kv.pool.allocator.num_free),
            num_pages=self.kv.pool.num_pages,
            max_batched_tokens=self.max_batched_tokens,
        )

    def _chunk_pages(self, tokens: int) -> int:
        """The most pages reading `tokens` more tokens may allocate: a page per head for each
        `page_size` of them, and one more where a head's last page is part full."""
        return _heads(self.model.config) * (-(-tokens // self.cache.page_size) + 1)

    def _start_prefill(self, request: _Request, row: int) -> None:
        if request.order < 0:
            request.order = self._started
            self._started += 1
        request.row, request.read = row, 0
        self._prefill_rows[row] = request

    def _read_chunks(self, rows: list[int], events: list[TokenEvent]) -> None:
        """One chunk of each prefill row in `rows`, in one program (rows padded with empty
        ones to a power of two where there are enough); then the compression and first token
        of each row whose prompt is read."""
        empty = [row for row, r in enumerate(self._prefill_rows) if r is None]
        bucket = min(next_power_of_two(len(rows)), len(rows) + len(empty))
        batch = rows + empty[: bucket - len(rows)]
        counts = [self._prefill_rows[row].next_chunk if row in rows else 0 for row in batch]
        width = max(16, next_power_of_two(max(counts)))
        tokens = np.zeros((len(batch), width), np.int32)
        starts, lengths = np.zeros(len(batch), np.int32), np.zeros(len(batch), np.int32)
        template = self._prefill_rows[rows[0]]
        budget = np.zeros((len(batch),) + template.budget_tokens.shape[1:], np.int32)
        thresholds = np.zeros((len(batch),) + template.thresholds.shape[1:], np.float32)
        for i, (row, count) in enumerate(zip(batch, counts, strict=True)):
            request = self._prefill_rows[row]
            if request is None:
                continue
            starts[i], lengths[i] = request.read, request.length
            tokens[i, :count] = request.prompts.tokens[0, request.read : request.read + count]
            budget[i], thresholds[i] = request.budget_tokens[0], request.thresholds[0]
        self.kv, self._carry = programs.prefill_rows(
            self.model,
            self.kv,
            self._carry,
            np.asarray(batch, np.int32) + self.max_slots,
            tokens,
            starts,
            np.asarray(counts, np.int32),
            lengths,
            budget,
            thresholds,
            self.policy_params,
            policy=self.policy.static(),
            backend=self.backend,
        )
        self.kv.check()
        for row, count in zip(batch, counts, strict=True):
            request = self._prefill_rows[row]
            if count:
                request.read += count
                if request.read == request.length:
                    self._finish_prefill(request, events)

    def _finish_prefill(self, request: _Request, events: list[TokenEvent]) -> None:
        """The policy's compression of the request's prefilled row and its first token; it
        then waits for a slot, in its row (or ends, if that token ends it)."""
        compression = self.policy.prompt_compression
        reads_prompt = compression is not None and compression.needs_prompt_tokens
        tokens = request.prompts.tokens if reads_prompt else np.zeros((1, 1), np.int32)
        self.kv, last_hidden, compressed = programs.finish_row(
            self.model,
            self.kv,
            self._carry,
            np.int32(self.max_slots + request.row),
            tokens,
            np.int32(request.length),
            request.budget_tokens,
            request.thresholds,
            request.prefill_key,
            policy=self.policy.static(),
        )
        self.kv.check()
        row = Rows.start(
            prompt_lengths=[request.length],
            budget_tokens=request.budget_tokens,
            budget_ratio=self.policy.budget_ratio(1),
            thresholds=request.thresholds,
            keys=row_keys(request.key, [0]),
            sampling=request.sampler.rows(1),
        )
        token, request.state = programs.first_token(self.model, last_hidden, row)
        if self._emit(request, int(token), events, compressed=bool(compressed)):
            self._free_prefill_row(request.row)
        else:
            self._ready.append(request)
            self._ready.sort(key=lambda r: r.order)

    def _admit(self, request: _Request, slot: int) -> None:
        """Moves a ready request into `slot`: its row's pages (no copy) or its swapped-out
        state back into the pool, its row state into the slots'."""
        self._ready.remove(request)
        with compiling_as("the engine's admission"):
            if request.row is not None:
                self.kv = programs.move(
                    self.kv, np.int32(self.max_slots + request.row), np.int32(slot)
                )
                self._prefill_rows[request.row] = None
            else:
                self.kv = programs.swap_in(self.kv, request.swapped, np.int32(slot))
            if self._rows is None:
                self._rows = request.state.repeated(self.max_slots)
            self._rows = programs.insert_rows(self._rows, np.int32(slot), request.state)
        self.kv.check()
        request.row, request.swapped = None, None
        self._slots[slot] = request

    def _swap_out(self, request: _Request, row: int) -> None:
        """The request in kv row `row` (a slot or a ready request's prefill row) swapped out
        to the host, its pages freed: it waits for a slot again, its state whole."""
        held, growth = (int(np.asarray(x)[row]) for x in programs.row_pages(self.kv))
        num_pages = pool_pages_bucket(held, self.cache.page_size)
        with compiling_as("the engine's preemption"):
            self.kv, alone = programs.swap_out(self.kv, np.int32(row), num_pages=num_pages)
            if row < self.max_slots:
                request.state = programs.take_row_state(self._rows, np.int32(row))
        request.swapped = jax.device_get(alone)
        request.state = jax.device_get(request.state)
        request.swapped_pages = (held, growth)
        request.row = None
        request.preemptions += 1
        self.preemptions += 1
        if request not in self._ready:  # a running one: ready again
            self._ready.append(request)
            self._ready.sort(key=lambda r: r.order)

    def _emit(
        self,
        request: _Request,
        token: int,
        events: list,
        *,
        slot: int | None = None,
        compressed: bool | None = None,
    ) -> bool:
        """Records the request's new token; True when it finished (its `slot`, if it holds one,
        released)."""
        request.generated.append(token)
        reason = None
        if token in request.stop:
            reason = "stop"
        elif len(request.generated) >= request.max_new_tokens:
            reason = "length"
        events.append(TokenEvent(request.id, token, reason is not None, reason, compressed))
        if reason is not None and slot is not None:
            self._free_slot(slot)
        return reason is not None

    def _release(self, kv_row: int) -> None:
        rows = np.zeros((self.max_slots + self.max_prefills,), bool)
        rows[kv_row] = True
        self.kv = programs.release(self.kv, jnp.asarray(rows))

    def _free_slot(self, slot: int) -> None:
        self._release(slot)
        self._slots[slot] = None

    def _free_prefill_row(self, row: int) -> None:
        self._release(self.max_slots + row)
        self._prefill_rows[row].row = None
        self._prefill_rows[row] = None

    def _decode(self, slots: Sequence[int], events: list[TokenEvent]) -> None:
        tokens = np.zeros((self.max_slots,), np.int32)
        active = np.zeros((self.max_slots,), bool)
        for slot in slots:
            tokens[slot], active[slot] = self._slots[slot].generated[-1], True
        self.kv, new_tokens, self._rows = programs.decode_slots(
            self.model,
            self.kv,
            tokens,
            active,
            self._rows,
            self.policy_params,
            policy=self.policy.static(),
            backend=self.backend,
        )
        self.kv.check()
        new_tokens = np.asarray(new_tokens)
        for slot in slots:
            self._emit(self._slots[slot], int(new_tokens[slot]), events, slot=slot)
