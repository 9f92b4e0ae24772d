"""Continuous batching: requests that come and go share one page pool and a fixed set of slots.

    engine = Engine(model, "snapkv:0.3", cache=CacheConfig(num_pages=2048), max_slots=8)
    first = engine.submit(prompt_ids, max_new_tokens=64)
    for event in engine.stream():           # TokenEvent(request_id, token, finished, reason)
        ...

`submit` refuses a request that its plan says the pool could not hold even alone
(`TooLargeForPoolError`, `pages_needed_alone`). Each `step` is a plan and its execution: the
scheduler (`jaxkv.engine.scheduler.plan_step`, pure host code over page counts) decides from
what the engine holds which prefilled request is admitted into a free slot, which running
requests are preempted (the newest, while the step's new pages would not fit; never the only
one), which slots decode; the engine then runs the plan with its jitted programs: the admission
(the request's pages into the pool, its row state into the slots'), one decode step of every
running slot (one program of fixed shapes: slots and pool are sized once), then the next chunk of
the prefill in flight (its own small state, so a long prompt never stalls the running requests
for its whole prefill). A request's first token is sampled as its prefill ends, before it waits
for a slot. Finished requests return their slots and pages at once, so a smaller cache per
request admits more requests.

Every slot carries its request's row state (`jaxkv.step.rows.Rows`: prompt length, budget, key,
step, sampler settings) and runs `generate`'s own decode step (`decode_and_sample`), so greedy
and sampled tokens equal `generate` on the same prompt, policy and key. A preempted request is
prefilled again over its prompt and the tokens it had (exact for policies that do not compress
the prompt).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import Backend, resolve_backend
from jaxkv.cache import CacheConfig, KVState
from jaxkv.cache.config import check_count
from jaxkv.cache.geometry import table_pages_bucket
from jaxkv.cache.rows import insert_row, release_rows
from jaxkv.compile_log import compiling_as
from jaxkv.engine.scheduler import Prefilled, Running, View, plan_step
from jaxkv.generation.prefill import (
    ChunkedPrefill,
    finish_chunked_prefill,
    prefill_next_chunk,
    rows_compressed,
    start_chunked_prefill,
)
from jaxkv.generation.request import (
    Request,
    checked_key,
    checked_stop_tokens,
    prompt_lengths,
    prompt_lists,
    set_up,
)
from jaxkv.models.configs import ModelConfig
from jaxkv.models.decoder import Model, logits_from_hidden
from jaxkv.policies import FullCache, Policy, from_spec
from jaxkv.policies.base import PolicyParams
from jaxkv.sampling import Sampler
from jaxkv.step.decode import StepContext, decode_and_sample, next_tokens
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


@dataclasses.dataclass
class _Request:
    """A request's host-side bookkeeping (mutable: the engine's own)."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    key: jax.Array  # the decode key (`generate` splits the request key into prefill, decode)
    prefill_key: jax.Array
    stop: frozenset[int]
    generated: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    order: int = 0  # admission order, for choosing whom to preempt


class _Prefilling(NamedTuple):
    """A request whose prefill is in flight."""

    request: _Request
    setup: Request
    prefill: ChunkedPrefill


class _Prefilled(NamedTuple):
    """A prefilled request waiting for a slot: its one-row state (compressed) and its row state
    (its first token sampled)."""

    request: _Request
    kv: KVState
    row: Rows


def pages_needed_alone(
    policy: Policy, config: ModelConfig, prompt_length: int, max_new_tokens: int, page_size: int
) -> int:
    """The most pages of the pool one request holds in the engine, alone (host; from shapes, as
    `jaxkv bench plan` plans a request).

    Each of its layers x KV heads holds at most the policy's planned tokens after the prompt
    (`Policy.planned_tokens`: the budget; the whole prompt where what is kept depends on the
    data, e.g. WG-KV's gates or GVote's votes) and grows by max_new_tokens - 1 (the last token is
    sampled, never written), to its decode eviction's `decode_tokens_bound` where that is lower;
    admission asks room for one more token than the prompt holds. A plan below the whole prompt
    is an average that heads may split unevenly (a budget shared across heads, PyramidKV's
    layers): each head then rounds up to a page of its own.
    """
    lengths = np.array([prompt_length])
    budget = policy.budget_tokens(lengths)
    held = int(policy.planned_tokens(budget, lengths)[0][0])
    grown = held + max_new_tokens - 1
    if policy.decode_eviction is not None:
        bound = policy.decode_eviction.decode_tokens_bound(budget, lengths, max_new_tokens)
        grown = min(grown, int(bound[0]))
    tokens = max(grown, held + 1)
    heads = config.num_layers * config.num_kv_heads
    if held >= prompt_length and not policy.decides_across_heads:
        return heads * -(-tokens // page_size)  # every head holds at most `tokens`
    return (heads * tokens + heads * (page_size - 1)) // page_size


@functools.partial(jax.jit, static_argnames=("policy", "backend"), donate_argnames=("kv",))
def _decode_slots(model, kv, tokens, active, rows, policy_params, *, policy, backend):
    """One decode step of the active slots (bool [B]; the others write nothing), as
    `generate`'s loop runs it (`decode_and_sample`). Donates `kv`. Returns (kv, tokens int32
    [B], rows)."""
    context = StepContext(rows=rows, policy_params=policy_params, policy=policy, backend=backend)
    kv, _, tokens, rows = decode_and_sample(model, kv, tokens, active, context)
    return kv, tokens, rows


@jax.jit
def _first_token(model, last_hidden, row: Rows):
    """The token a prefilled request samples next (`next_tokens` of its one row, as `generate`
    samples its first), and the row after it."""
    logits = logits_from_hidden(model.params, model.config, last_hidden)
    tokens, row = next_tokens(logits, row, jnp.ones((1,), bool))
    return tokens[0], row


@jax.jit
def _row_pages(kv: KVState) -> tuple[jax.Array, jax.Array]:
    """int32 [B] each row's pages held, and the pages its next decode step may allocate (one per
    (layer, KV head) whose last page is full)."""
    held = jnp.sum(kv.page_table >= 0, axis=(0, 2, 3))
    full = kv.full_precision_lengths() % kv.pool.page_size == 0
    return held, jnp.sum(full, axis=(0, 2))


_insert = jax.jit(insert_row, donate_argnames=("kv",))
_insert_rows = jax.jit(Rows.insert, donate_argnums=(0,))
_release = jax.jit(release_rows, donate_argnames=("kv",))


class Engine:
    """Continuous batching over one paged pool (module docstring).

    Args:
      model: the model.
      policy: the cache policy every request uses (or its spec, "kvzip:0.3"); default full.
      cache: the pool: `CacheConfig(num_pages=...)` (required: the engine's memory), its page size
        and kv dtype; int8 storage is not supported here.
      max_slots: requests decoded at once.
      max_context: the longest prompt + generation a request may have (default: the model's
        max_position_embeddings, at most 8192); sizes the page tables.
      max_waiting: the bound of the waiting queue (`submit` raises QueueFullError past it).
      policy_params, prefill_chunk, backend: as for `generate`.
    """

    def __init__(
        self,
        model: Model,
        policy: Policy | str | None = None,
        *,
        cache: CacheConfig,
        max_slots: int,
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
        self.prefill_chunk = prefill_chunk
        self.backend = resolve_backend(backend)
        cfg, p = model.config, cache.page_size
        width = table_pages_bucket(-(-self.max_context // p))
        self.kv = KVState.create(
            num_layers=cfg.num_layers,
            batch=self.max_slots,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            max_tokens=width * p,
            page_size=p,
            num_pages=cache.num_pages,
            dtype=cache.dtype_for(model.dtype),
            key_bounds=self.policy.selection is not None,
            local_window=local_window(self.policy),
        )
        self._slots: list[_Request | None] = [None] * self.max_slots
        self._waiting: collections.deque[_Request] = collections.deque()
        self._prefilling: _Prefilling | None = None
        self._prefilled: _Prefilled | None = None
        self._next_id = 0
        self._admitted = 0
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
        policy's budget, the pages the request may hold alone against the pool
        (`TooLargeForPoolError`), the key (required when sampling), the stop tokens;
        QueueFullError past `max_waiting`."""
        rows = prompt_lists(prompt_ids)
        if len(rows) != 1:
            raise ValueError(f"prompt_ids holds {len(rows)} prompts: submit one at a time")
        length = int(prompt_lengths(self.model, rows)[0])
        max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
        if length + max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt of {length} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"engine's max_context={self.max_context}"
            )
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
            prompt=rows[0],
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
                self.policy, self.model.config, length, new_tokens, self.cache.page_size
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
        """Ends a waiting or running request now, its pages returned; False if unknown."""
        for request in list(self._waiting):
            if request.id == request_id:
                self._waiting.remove(request)
                return True
        if self._prefilling is not None and self._prefilling.request.id == request_id:
            self._prefilling = None
            return True
        if self._prefilled is not None and self._prefilled.request.id == request_id:
            self._prefilled = None
            return True
        for slot, request in enumerate(self._slots):
            if request is not None and request.id == request_id:
                self._free([slot])
                return True
        return False

    def has_work(self) -> bool:
        busy = self._prefilling is not None or self._prefilled is not None
        return busy or bool(self._waiting) or any(r is not None for r in self._slots)

    def stats(self) -> dict:
        """Requests running and waiting, pages in use and the pool's size, the bytes of a
        local ring beside the pool (WG-KV's: every slot's, reserved at creation; 0 without one)
        and the KV bytes held in all (pages in use and ring; host values)."""
        return {
            "running": sum(r is not None for r in self._slots),
            "waiting": len(self._waiting)
            + (self._prefilling is not None)
            + (self._prefilled is not None),
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
        engine holds now, executed in its order (admission, preemption, a decode step of every
        running request, the next prefill chunk); the tokens produced."""
        plan = plan_step(self._view())
        events: list[TokenEvent] = []
        if plan.refuse:
            events.append(TokenEvent(self._prefilled.request.id, -1, True, "too_large"))
            self._prefilled = None
        for slot in plan.preempt:
            self._preempt(slot)
        for slot in plan.too_large:
            request = self._slots[slot]
            self._free([slot])
            events.append(TokenEvent(request.id, -1, True, "too_large"))
        if plan.admit is not None:
            self._admit(plan.admit)
        if plan.decode:
            with compiling_as("the engine's decode step"):
                self._decode(plan.decode, events)
        if plan.prefill:
            self._advance_prefill(events)
        return events

    def _view(self) -> View:
        """What the scheduler sees: each slot's pages (one small program) and the pool's."""
        held, growth = (np.asarray(x) for x in _row_pages(self.kv))
        running = tuple(
            Running(slot, request.order, int(held[slot]), int(growth[slot]))
            for slot, request in enumerate(self._slots)
            if request is not None
        )
        prefilled = None
        if self._prefilled is not None:
            kv = self._prefilled.kv  # its own pool: every page is the row's
            lengths = np.asarray(kv.full_precision_lengths())
            prefilled = Prefilled(
                held_pages=int(kv.pages_in_use()),
                growth_pages=int(np.sum(lengths % kv.pool.page_size == 0)),
            )
        return View(
            running=running,
            free_slots=tuple(i for i, r in enumerate(self._slots) if r is None),
            prefilled=prefilled,
            prefilling=self._prefilling is not None,
            waiting=len(self._waiting),
            free_pages=int(self.kv.pool.allocator.num_free),
            num_pages=self.kv.pool.num_pages,
        )

    def _advance_prefill(self, events: list[TokenEvent]) -> None:
        """The next chunk of the prefill in flight (the queue's first request's, started here
        when none is); after its last, the compression and the request's first token."""
        if self._prefilling is None:
            request = self._waiting.popleft()
            setup = set_up(
                self.model,
                [request.prompt + request.generated],
                self.policy,
                reserve_tokens=0,
                positions_after_prompt=request.max_new_tokens - len(request.generated),
                cache=dataclasses.replace(self.cache, num_pages=None),
                prefill_chunk=self.prefill_chunk,
                policy_params=self.policy_params,
            )
            self._prefilling = _Prefilling(request, setup, start_chunked_prefill(self.model, setup))
        request, setup, prefill = self._prefilling
        prefill = prefill_next_chunk(self.model, setup, prefill, self.policy_params, self.backend)
        self._prefilling = _Prefilling(request, setup, prefill)
        if not prefill.done:
            return
        self._prefilling = None
        kv, last_hidden = finish_chunked_prefill(self.model, setup, prefill, request.prefill_key)
        kv.check()
        if kv.page_table.shape[-1] > self.kv.page_table.shape[-1]:
            raise ValueError(f"request {request.id} is longer than max_context={self.max_context}")
        compressed = bool(rows_compressed(kv, setup.prompts.lengths, None)[0])
        token, row = _first_token(self.model, last_hidden, self._row(request, setup))
        if not self._emit(request, int(token), events, compressed=compressed):
            self._prefilled = _Prefilled(request, kv, row)

    def _admit(self, slot: int) -> None:
        """Moves the prefilled request into `slot`: its pages into the pool, its row state into
        the slots'."""
        request, kv, row = self._prefilled
        self._prefilled = None
        with compiling_as("the engine's admission"):
            self.kv = _insert(self.kv, kv, np.int32(slot))
            if self._rows is None:
                self._rows = row.repeated(self.max_slots)
            self._rows = _insert_rows(self._rows, np.int32(slot), row)
        self.kv.check()
        self._slots[slot] = request
        request.order = self._admitted
        self._admitted += 1

    def _row(self, request: _Request, setup) -> Rows:
        """The request's row state after its prefill: what was prefilled (its prompt, and after
        a preemption the tokens it had generated, whose count its keys go on from)."""
        generated = len(request.generated)
        return Rows.start(
            prompt_lengths=[len(request.prompt) + generated],
            budget_tokens=setup.budget_tokens,
            budget_ratio=setup.policy.budget_ratio(1),
            thresholds=setup.thresholds,
            keys=row_keys(request.key, [0]),
            sampling=request.sampler.rows(1),
            steps=[generated],
        )

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
            self._free([slot])
        return reason is not None

    def _free(self, slots: list[int]) -> None:
        rows = np.zeros((self.max_slots,), bool)
        rows[slots] = True
        self.kv = _release(self.kv, jnp.asarray(rows))
        for slot in slots:
            self._slots[slot] = None

    def _preempt(self, slot: int) -> None:
        """The slot's request back to the front of the queue, its pages freed: it is prefilled
        again over its prompt and the tokens it had."""
        request = self._slots[slot]
        self._free([slot])
        request.preemptions += 1
        self.preemptions += 1
        self._waiting.appendleft(request)

    def _decode(self, slots: Sequence[int], events: list[TokenEvent]) -> None:
        tokens = np.zeros((self.max_slots,), np.int32)
        active = np.zeros((self.max_slots,), bool)
        for slot in slots:
            tokens[slot], active[slot] = self._slots[slot].generated[-1], True
        self.kv, new_tokens, self._rows = _decode_slots(
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
