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
requests. With int8 storage (`CacheConfig(storage="int8")`) an int8 tier's pool lies beside the
pool: each request's tokens but each head's newest window move there once its prompt is
compressed, and the scheduler plans both pools (`jaxkv.engine.pages.Pages`).

Every slot carries its request's row state (`jaxkv.step.rows.Rows`: prompt length, budget, key,
step, sampler settings) and runs `generate`'s own decode step (`decode_and_sample`), and every
prefill row reads its prompt in `generate`'s chunks, so greedy and sampled tokens equal
`generate` on the same prompt, policy and key, preempted or not.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import sharding
from jaxkv.attention import Backend, resolve_backend
from jaxkv.cache import CacheConfig
from jaxkv.cache.config import check_count
from jaxkv.compile_log import compiling_as, counting_compiles
from jaxkv.engine.batching import chunk_batch
from jaxkv.engine.contexts import Context, ContextEvent, UnknownContextError, check_session
from jaxkv.engine.executor import Executor
from jaxkv.engine.intake import Intake, check_storage
from jaxkv.engine.lanes import Lanes
from jaxkv.engine.ledger import Ledger
from jaxkv.engine.limits import check_limits
from jaxkv.engine.pages import Pages
from jaxkv.engine.requests import QueueFullError, Request, TokenEvent, TooLargeForPoolError
from jaxkv.engine.scheduler import drop_order
from jaxkv.generation.request import (
    checked_key,
    checked_stop_tokens,
    prompt_lists,
)
from jaxkv.generation.session import Session
from jaxkv.models.decoder import Model
from jaxkv.pallas_kernels.common import next_power_of_two
from jaxkv.policies import FullCache, Policy, from_spec
from jaxkv.policies.base import PolicyParams
from jaxkv.sampling import Sampler
from jaxkv.step.rows import Rows, row_keys


class Engine:
    """Continuous batching over one paged pool (module docstring).

    Args:
      model: the model.
      policy: the cache policy every request uses (or its spec, "kvzip:0.3"); default full.
      cache: the pool: `CacheConfig(num_pages=...)` (required: the engine's memory; on a mesh,
        each device's), its page size and kv dtype; with `storage="int8"` an int8 tier's pool of
        `int8_pages` pages beside it (default num_pages): each request's tokens but each head's
        newest `full_precision_window` move there once its prompt is compressed, as `generate`
        stores them (not with a policy that selects pages or keeps a local ring).
      max_slots: requests decoded at once.
      max_prefills: requests whose prompts are read at once (prefill rows).
      max_batched_tokens: the most tokens one step runs on a lane, a decode row's token and a
        prefill chunk's tokens counted (default: room for every slot and a full chunk of every
        prefill row); at least the lane's slots + 16.
      max_context: the longest prompt + generation a request may have (default: the model's
        max_position_embeddings, at most 8192); sizes the page tables.
      max_waiting: the bound of the waiting queue (`submit` raises QueueFullError past it).
      max_contexts: context rows: cached contexts held at once (`add_context`; 0: none; on a
        mesh a multiple of its data axis, each lane holding its share).
      mesh: a (data, model) mesh (`jaxkv.sharding.make_inference_mesh`) as `generate` takes:
        slots and prefill rows split over `data` (each data shard a lane with a pool per
        device; max_slots and max_prefills multiples of it), KV heads with their query heads
        over `model`. None: one device.
      policy_params, prefill_chunk, backend: as for `generate`.

    Compiles: `jaxkv.engine.programs` lists its programs; one engine compiles each once, except
    a prefill chunk (once per bucket of rows read at once, a power of two up to max_prefills,
    and of chunk tokens, a power of two from 16 up to the chunk), a compression that reads the
    prompt's tokens (per prompt bucket) and swaps (per bucket of a swapped request's pages).
    `warm_up` compiles every prefill bucket before requests arrive.
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
        max_contexts: int = 0,
        mesh: jax.sharding.Mesh | None = None,
        policy_params: PolicyParams | None = None,
        prefill_chunk: int | None = None,
        backend: str | Backend = "auto",
    ):
        policy = FullCache() if policy is None else policy
        self.policy = from_spec(policy) if isinstance(policy, str) else policy
        if not isinstance(cache, CacheConfig) or cache.num_pages is None:
            raise ValueError("cache must be a CacheConfig with num_pages set: the engine's pool")
        check_storage(self.policy, cache)
        self.policy.check_params(policy_params, model.config)
        placement = sharding.as_inference_mesh(mesh)
        self.limits = check_limits(
            model.config,
            placement,
            max_slots=max_slots,
            max_prefills=max_prefills,
            max_contexts=max_contexts,
            max_batched_tokens=max_batched_tokens,
            max_context=max_context,
            max_waiting=max_waiting,
            prefill_chunk=prefill_chunk,
        )
        if placement is not None:
            model = placement.place(model, placement.model_specs(model))
            policy_params = placement.place_policy_params(self.policy, policy_params)
        self.placement = placement
        shards = 1 if placement is None else placement.data
        self.lanes = Lanes(
            placement,
            slots=self.limits.max_slots // shards,
            prefills=self.limits.max_prefills // shards,
            contexts=self.limits.max_contexts // shards,
        )
        self.model, self.cache = model, cache
        self.device_config = (
            model.config if placement is None else placement.local_config(model.config)
        )
        self.pool_pages = Pages(cache.num_pages, cache.int8_pool_pages)  # each device's pools
        self.intake = Intake(
            model=model,
            policy=self.policy,
            cache=cache,
            device_config=self.device_config,
            limits=self.limits,
            lane_slots=self.lanes.slots,
            pool_pages=self.pool_pages,
        )
        self.executor = Executor(
            model,
            self.policy,
            cache=cache,
            lanes=self.lanes,
            placement=placement,
            max_context=self.limits.max_context,
            policy_params=policy_params,
            backend=resolve_backend(backend),
        )
        self.ledger = Ledger.empty(
            self.limits.max_slots, self.limits.max_prefills, self.limits.max_contexts
        )
        self._pending: list[TokenEvent | ContextEvent] = []  # events the next step returns
        self._next_id = 0
        self._next_context = 0
        self._uses = 0  # requests that named a context so far: contexts' recency
        self._started = 0
        self.preemptions = 0
        self.contexts_evicted = 0
        self._dropped_hits = 0

    # --- requests ------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampler: Sampler | None = None,
        key: jax.Array | None = None,
        stop_tokens: Sequence[int] | None = None,
        budget: float | int | None = None,
        context: int | None = None,
    ) -> int:
        """Queues one prompt (token ids); returns its request id. Checked here, before anything
        runs: the ids, max_new_tokens >= 1, prompt + max_new_tokens <= max_context, the
        policy's budget, its chunk against max_batched_tokens, the pages the request may hold
        alone against the pool (`TooLargeForPoolError`), the key (required when sampling), the
        stop tokens; QueueFullError past `max_waiting`. budget: the request's own budget for
        the engine's policy (a ratio of the prompt or a token count, as `budget=` of
        `policies.get`; default: the policy's): budgets travel as arrays, so it compiles
        nothing new.

        context: the id of a cached context (`add_context`) the prompt is read after, as
        `jaxkv.ask` reads a question over a compressed context (the prompt is not compressed;
        the context's positions come first; UnknownContextError for an id the engine does not
        hold); the policy must not evict during decode within max_new_tokens, as for `ask`."""
        rows = prompt_lists(prompt_ids)
        if len(rows) != 1:
            raise ValueError(f"prompt_ids holds {len(rows)} prompts: submit one at a time")
        max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
        sampler = Sampler() if sampler is None else sampler
        if key is None:
            if not sampler.greedy:
                raise ValueError("a PRNG key is required when sampling (temperature > 0)")
            key = jax.random.PRNGKey(0)
        stop = frozenset(checked_stop_tokens(self.model, stop_tokens))
        prefill_key, decode_key = jax.random.split(checked_key(key))
        if context is None:
            request, lane = self.intake.prompt_request(rows, max_new_tokens, budget), None
        else:
            if budget is not None:
                raise ValueError(
                    f"budget={budget!r} with context={context}: a request on a cached context "
                    "reads it as it was compressed; give the budget to add_context"
                )
            held = self._named_context(context)
            request = self.intake.question_request(rows, max_new_tokens, held)
            lane = self.lanes.context_lane(held.row)
        request = dataclasses.replace(
            request,
            id=self._next_id,
            lane=lane,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            key=decode_key,
            prefill_key=prefill_key,
            stop=stop,
        )
        self._queue(request)
        if request.context is not None:
            self._uses += 1
            request.context.readers.add(request.id)
            request.context.last_used = self._uses
            request.context.hits += 1
        return request.id

    def add_context(
        self,
        context_ids: Sequence[int],
        *,
        budget: float | int | None = None,
        key: jax.Array | None = None,
        evict_first: bool = False,
    ) -> int:
        """Queues a context (token ids) to prefill and compress once with the engine's policy
        into a context row of the pool; returns its id at once. Requests name it from now on
        (`submit(..., context=id)`: they wait for it) and a step's events hold
        `ContextEvent(id, "ready")` when it is. It stays until `drop_context`, or until the
        scheduler drops it, idle (no request reads or waits for it), for pages that requests
        need or a row a new context needs (`ContextEvent(id, "evicted")`): those added with
        `evict_first` first (the server's automatic contexts, a chat's earlier turns), then the
        least recently used.

        Checked here: max_contexts >= 1; the ids, the policy's budget (`budget`: as `submit`'s),
        the context and one more token within max_context, its chunk, the pages it may hold
        alone (`TooLargeForPoolError`); ContextsFullError when every context row holds a
        context that requests read or wait for (an idle one is dropped for the new one, least
        recently used first). key: seeds a stochastic policy's compression, as `ask`'s key
        does (default PRNGKey(0))."""
        if not self.limits.max_contexts:
            raise ValueError("the engine holds no contexts: give Engine(..., max_contexts >= 1)")
        rows = prompt_lists(context_ids)
        if len(rows) != 1:
            raise ValueError(f"context_ids holds {len(rows)} prompts: add one at a time")
        key = jax.random.PRNGKey(0) if key is None else checked_key(key)
        policy_key, _ = jax.random.split(key)  # `ask`'s prefill key
        request = self.intake.prompt_request(rows, 1, budget)
        self._check_queue_room()  # before an idle context is dropped for the new one
        row = self._free_context_row()
        held = Context(
            id=self._next_context,
            row=row,
            tokens=request.length,
            budget_tokens=request.budget_tokens,
            budget_ratio=request.budget_ratio,
            thresholds=request.thresholds,
            request=None,
            last_used=self._uses,
            evict_first=evict_first,
        )
        request = dataclasses.replace(
            request,
            id=self._next_id,
            max_new_tokens=1,
            sampler=Sampler(),
            key=policy_key,
            prefill_key=policy_key,
            stop=frozenset(),
            makes_context=held,
            lane=self.lanes.context_lane(row),
        )
        self._queue(request)
        held.request = request
        self.ledger.contexts[held.id] = self.ledger.context_rows[row] = held
        self._next_context += 1
        return held.id

    def drop_context(self, context_id: int) -> bool:
        """Drops a cached context, its pages returned to the pool (its prefill cancelled, if
        it is still read); while requests read it, it takes no new ones and is dropped when
        the last ends. False if the engine does not hold it."""
        held = self.ledger.contexts.get(context_id)
        if held is None or held.dropping:
            return False
        held.dropping = True
        if not held.readers:
            self._drop(held)
        return True

    def contexts(self) -> dict[int, dict]:
        """Each cached context the engine holds: its tokens, whether it is ready, the requests
        that read it now and have read it, and the pages its row holds (every device's)."""
        return {
            held.id: {
                "tokens": held.tokens,
                "ready": held.ready,
                "readers": len(held.readers),
                "hits": held.hits,
                "pages": held.pages.model,
                "int8_pages": held.pages.int8,
            }
            for held in self.ledger.contexts.values()
            if not held.dropping
        }

    def context_session(self, context_id: int) -> Session:
        """A ready cached context as a one-row `Session` (its pages copied out of the pool): what
        `jaxkv.save_session` writes, `add_session` takes back and `jaxkv.ask` reads. On one
        device only."""
        held = self._named_context(context_id)
        if not held.ready:
            raise ValueError(
                f"context={context_id} is not ready: step the engine until its "
                "ContextEvent(state='ready')"
            )
        if self.placement is not None:
            raise ValueError("a context on a mesh is not copied out: run the engine on one device")
        lane = self.lanes.context_lane(held.row)
        kv = self.executor.copy_row(lane, self.lanes.context_kv_row(held.row))
        return Session(
            model=self.model,
            kv=kv,
            last_hidden=jnp.asarray(held.last_hidden),
            lengths=np.array([held.tokens], np.int32),
            budget_tokens=held.budget_tokens,
            budget_ratio=held.budget_ratio,
            thresholds=held.thresholds,
            policy_params=self.executor.policy_params,
            policy=self.policy,
            cache=self.cache,
            backend=self.executor.backend,
        )

    def add_session(self, session: Session, *, evict_first: bool = False) -> int:
        """A one-row session made with this engine's model and policy (`jaxkv.prefill`,
        `jaxkv.load_session`, `context_session`) as a cached context, ready at once: its held
        pages copied into a context row (idle contexts dropped for them, as `add_context`
        says; `evict_first` as there). Refused, named: no context rows, a mesh, a session of
        several rows or forked, another policy or model configuration, another page geometry or
        storage (int8 with another window), more tokens a head than max_context, more pages
        than the pools can free (`TooLargeForPoolError`)."""
        if not self.limits.max_contexts:
            raise ValueError("the engine holds no contexts: give Engine(..., max_contexts >= 1)")
        if self.placement is not None:
            raise ValueError("a session is not added to an engine on a mesh: run it on one device")
        check_session(
            session, self.executor.kv, self.model.config, self.policy, self.limits.max_context
        )
        theirs = session.kv
        tier = theirs.pool.int8
        pages = Pages(int(theirs.pages_in_use()), 0 if tier is None else int(tier.pages_in_use()))
        row = self._free_context_row()
        lane = self.lanes.context_lane(row)
        self._make_room(lane, pages)
        held = Context(
            id=self._next_context,
            row=row,
            tokens=int(session.lengths[0]),
            budget_tokens=np.asarray(session.budget_tokens),
            budget_ratio=np.asarray(session.budget_ratio),
            thresholds=np.asarray(session.thresholds),
            request=None,
            ready=True,
            last_used=self._uses,
            pages=pages,
            evict_first=evict_first,
            last_hidden=np.asarray(session.last_hidden),
        )
        with compiling_as("the engine's preemption"):
            self.executor.insert(lane, self.lanes.context_kv_row(row), theirs)
        self.ledger.contexts[held.id] = self.ledger.context_rows[row] = held
        self._next_context += 1
        return held.id

    def _free_pages(self, lane: int) -> Pages:
        """The free pages of `lane`'s pools (its fullest device's)."""
        return Pages.of(self.executor.row_pages()[3][lane].min(axis=0))

    def _make_room(self, lane: int, pages: Pages) -> None:
        """Drops idle contexts of `lane` (`drop_order`) until `pages` are free
        (TooLargeForPoolError if they cannot be)."""
        while not pages <= (free := self._free_pages(lane)):
            idle = self.ledger.idle_contexts(self.lanes, lane)
            if not idle:
                raise TooLargeForPoolError(
                    f"session: its {pages} exceed the {free} free (no idle context left to "
                    "drop): retry when requests have ended, or a larger pool",
                    pages_needed=pages.total,
                    num_pages=self.pool_pages.total,
                    field="session",
                )
            self._drop(min(idle, key=drop_order), reason="evicted")

    def _named_context(self, context_id) -> Context:
        held = self.ledger.contexts.get(context_id) if isinstance(context_id, int) else None
        if held is None or held.dropping:
            raise UnknownContextError(
                f"context={context_id!r}: the engine holds no such context (never added, "
                "deleted, or dropped for its pages: add it again)"
            )
        return held

    def _check_queue_room(self) -> None:
        """QueueFullError when the waiting queue is at its bound (`max_waiting`)."""
        if len(self.ledger.waiting) >= self.limits.max_waiting:
            raise QueueFullError(
                f"the engine's queue holds max_waiting={self.limits.max_waiting} requests: "
                "retry later"
            )

    def _queue(self, request: Request) -> None:
        self._check_queue_room()
        self._next_id += 1
        self.ledger.waiting.append(request)

    def _free_context_row(self) -> int:
        """A context row for a new context (`Ledger.row_for_new_context`), the idle context
        that held it dropped now."""
        row, evicted = self.ledger.row_for_new_context(self.lanes)
        if evicted is not None:
            self._drop(evicted, reason="evicted")
        return row

    def cancel(self, request_id: int) -> bool:
        """Ends a request wherever it is now (queued, prefilling, ready, swapped out or
        running), its pages returned; False if unknown."""
        everywhere = [
            *self.ledger.waiting,
            *self.ledger.ready,
            *self.ledger.prefill_rows,
            *self.ledger.slots,
        ]
        request = next((r for r in everywhere if r is not None and r.id == request_id), None)
        if request is None or request.makes_context is not None:
            return False
        self._remove(request)
        self._forget(request)
        return True

    def _remove(self, request: Request) -> None:
        """Takes the request out of wherever it is, its pages returned."""
        if request in self.ledger.waiting:
            self.ledger.waiting.remove(request)
        elif request in self.ledger.ready:
            self.ledger.ready.remove(request)
            if request.row is not None:
                self._release(prefills=[request.row])
        elif request in self.ledger.prefill_rows:
            self._release(prefills=[request.row])
        elif request in self.ledger.slots:
            self._release(slots=[self.ledger.slots.index(request)])

    def _forget(self, request: Request) -> None:
        """A request has ended: its context no longer counts it as a reader (and is dropped if
        it was deleted and this was its last)."""
        held = request.context
        if held is not None and held.id in self.ledger.contexts:
            held.readers.discard(request.id)
            if held.dropping and not held.readers:
                self._drop(held)

    def _drop(self, held: Context, reason: str | None = None) -> None:
        """The context gone, its row's pages returned (or its prefill ended) and, with a
        `reason` ("evicted", "too_large"), a ContextEvent; requests still waiting for it end
        "too_large" (it never became ready)."""
        if held.request is not None:
            self._remove(held.request)
            held.request = None
        elif held.ready:
            self.executor.release(self.lanes.kv_rows_mask(contexts=[held.row]))
        self.ledger.context_rows[held.row] = None
        del self.ledger.contexts[held.id]
        self._dropped_hits += held.hits
        if reason == "evicted":
            self.contexts_evicted += 1
        if reason is not None:
            self._pending.append(ContextEvent(held.id, reason, held.tokens))
        for request in [r for r in self.ledger.waiting if r.context is held]:
            self.ledger.waiting.remove(request)
            self._pending.append(TokenEvent(request.id, -1, True, "too_large"))

    def _refused(self, request: Request) -> None:
        """The scheduler refused the request (more pages than the pool, alone): it ends
        `too_large` (a context it made, too)."""
        if request.makes_context is not None:
            self._drop(request.makes_context, reason="too_large")
            return
        self._remove(request)
        self._pending.append(TokenEvent(request.id, -1, True, "too_large"))
        self._forget(request)

    def has_work(self) -> bool:
        held = any(r is not None for r in self.ledger.slots + self.ledger.prefill_rows)
        return held or bool(self.ledger.waiting) or bool(self.ledger.ready) or bool(self._pending)

    def stats(self) -> dict:
        """Requests running and waiting (queued, prefilling or prefilled), pages in use and the
        pool's size (every device's), the bytes of a local ring beside the pool (WG-KV's: every
        row's, reserved at creation; 0 without one), the KV bytes held in all (pages in use and
        ring; host values) and the preemptions so far; the cached contexts held (being made
        or ready), the pages of those ready, the requests that named one and the contexts
        dropped for their pages so far."""
        queued = [*self.ledger.waiting, *(r for r in self.ledger.prefill_rows if r is not None)]
        waiting = sum(r.makes_context is None and r.state is None for r in queued)
        pools = self.lanes.count * self.lanes.devices
        usage = self.executor.usage()
        held = [c for c in self.ledger.contexts.values() if not c.dropping]
        return {
            "running": sum(r is not None for r in self.ledger.slots),
            "waiting": waiting + len(self.ledger.ready),
            "pages_in_use": usage["pages_in_use"],
            "num_pages": self.cache.num_pages * pools,
            "int8_pages_in_use": usage["int8_pages_in_use"],
            "int8_num_pages": self.pool_pages.int8 * pools,
            "ring_bytes": usage["ring_bytes"],
            "kv_bytes_in_use": usage["kv_bytes_in_use"],
            "preemptions": self.preemptions,
            "contexts": len(held),
            "context_pages": sum(c.pages.model for c in held if c.ready),
            "context_int8_pages": sum(c.pages.int8 for c in held if c.ready),
            "context_hits": sum(c.hits for c in self.ledger.contexts.values()) + self._dropped_hits,
            "contexts_evicted": self.contexts_evicted,
        }

    def stream(self) -> Iterator[TokenEvent | ContextEvent]:
        """Steps until every request has finished (and every context is ready), yielding each
        event as it is produced."""
        while self.has_work():
            yield from self.step()

    def run(self) -> dict[int, list[int]]:
        """Steps until every request has finished; each request's tokens."""
        tokens: dict[int, list[int]] = collections.defaultdict(list)
        for event in self.stream():
            if isinstance(event, TokenEvent) and event.token >= 0:
                tokens[event.request_id].append(event.token)
        return dict(tokens)

    def warm_up(self, prompt_lengths: Sequence[int] | None = None) -> float:
        """Compiles the programs a step runs before any request arrives, so that none compiles
        while requests wait (a first call of a shape can take seconds; on a GPU many steps).
        For each width of the prefill program (1, 2, 4, ... rows read at once, up to each
        lane's prefill rows) and each length in `prompt_lengths` (default: a chunk of each
        bucket, 16, 32, ... up to the prefill chunk and below max_context), that many prompts
        of that length are read side by side, compressed and decoded a token. The engine must
        be idle; it is idle afterwards, with its pool as before (its request ids and counters
        go on from the warm-up's), also when `submit` refuses a prompt (that error is raised).
        What compiles later: a compression that reads the prompt's tokens (KVzip's) at other
        prompt buckets, questions over cached contexts and swaps. Returns the seconds spent
        compiling."""
        if self.has_work():
            raise RuntimeError("warm_up needs an idle engine: requests are queued or running")
        chunk = self.limits.chunk
        if prompt_lengths is None:  # (a chunk bucket longer than max_context is never read)
            buckets = [16 << i for i in range(max(next_power_of_two(chunk) // 16, 1).bit_length())]
            prompt_lengths = sorted({min(b, chunk, self.limits.max_context - 1) for b in buckets})
        for length in prompt_lengths:
            check_count("prompt_lengths", length, 1)
            if length >= self.limits.max_context:
                raise ValueError(
                    f"prompt_lengths holds {length}: a prompt and its token must fit "
                    f"max_context={self.limits.max_context}"
                )
        widths = [1 << i for i in range(self.lanes.prefills.bit_length())]
        widths = sorted({*widths, self.lanes.prefills})
        vocab = self.model.config.vocab_size
        with counting_compiles() as compiled:
            for length in prompt_lengths:
                prompt = [1 + i % (vocab - 1) for i in range(length)]
                new_tokens = min(2, self.limits.max_context - length)
                for width in widths:
                    try:
                        for _ in range(width):  # the scheduler fills a lane's rows first
                            self.submit(prompt, max_new_tokens=new_tokens, stop_tokens=())
                    finally:
                        self.run()  # (a refused prompt: those submitted run out; then it raises)
        return compiled.seconds

    # --- the step: plan, execute ------------------------------------------------------------

    def step(self) -> list[TokenEvent | ContextEvent]:
        """One step: the scheduler's plan of each lane (`jaxkv.engine.scheduler.plan_step`)
        from what the engine holds now, executed in its order (idle contexts dropped,
        refusals, preemptions, admissions, a decode step of every running request, a chunk of
        every prefill row it reads); the tokens produced, and what became of cached contexts
        (`ContextEvent`)."""
        plan, started, refused = self.ledger.plan(
            self.lanes, self.executor.row_pages(), self.intake
        )
        for row in plan.drop_contexts:
            self._drop(self.ledger.context_rows[row], reason="evicted")
        for request in refused:
            self._refused(request)
        for order in plan.refuse:
            self._refused(next(r for r in self.ledger.ready if r.order == order))
        for slot in plan.preempt:
            self._swap_out(self.ledger.slots[slot], slot=slot)
        for row in plan.swap_out:
            self._swap_out(self.ledger.prefill_rows[row], row=row)
        aborted = [self.ledger.prefill_rows[row] for row in plan.abort]
        self._release(prefills=plan.abort)
        for request in reversed(aborted):
            request.read = 0
            self.ledger.waiting.appendleft(request)
        for request in [self.ledger.slots[slot] for slot in plan.too_large]:
            self._refused(request)
        events, self._pending = self._pending, []
        for order, slot in plan.admit:
            self._admit(next(r for r in self.ledger.ready if r.order == order), slot)
        if plan.decode:
            with compiling_as("the engine's decode step"):
                self._decode(plan.decode, events)
        if plan.prefill or started:
            for row, request in started:
                self.ledger.waiting.remove(request)
                self._start_prefill(request, row)
            with compiling_as("the engine's prefill chunk"):
                self._read_chunks(sorted(plan.prefill + tuple(row for row, _ in started)), events)
        events += self._pending
        self._pending = []
        return events

    def _start_prefill(self, request: Request, row: int) -> None:
        """The request into prefill `row` (a request on a context: the row attached to it)."""
        if request.order < 0:
            request.order = self._started
            self._started += 1
        request.row, request.read = row, 0
        self.ledger.prefill_rows[row] = request
        if request.context is not None:
            lanes = self.lanes
            with compiling_as("the engine's context attachment"):
                self.executor.attach(
                    lanes.prefill_lane(row),
                    lanes.context_kv_row(request.context.row),
                    lanes.prefill_kv_row(row),
                )

    def _read_chunks(self, rows: list[int], events: list) -> None:
        """One chunk of each prefill row in `rows` (`_read_group`); then the compression and
        first token of each row whose prompt is read. Where the policy evicts chunks, rows
        reading a question over a cached context run apart, without chunk eviction (which
        would evict the context's shared pages), and never pad the others' program; so do they
        with int8 storage, where a prompt is read in the kv dtype alone and a question over its
        context's int8 tier."""
        if self.policy.chunk_eviction is None and self.cache.int8_window is None:
            self._read_group(rows, events, questions=False, may_pad=lambda row: True)
            return
        questions = [row for row in rows if self.ledger.prefill_rows[row].context is not None]
        prompts = [row for row in rows if row not in questions]
        if prompts:  # (with int8 storage, padded by rows whose tokens are all in the kv dtype)
            may_pad = self.ledger.holds_no_question
            if self.cache.int8_window is not None:
                may_pad = self.ledger.holds_an_unread_prompt_or_none
            self._read_group(prompts, events, questions=False, may_pad=may_pad)
        if questions:  # with int8 storage a prompt mid-read must not spill: no padding
            may_pad = self.ledger.holds_no_prompt if self.cache.int8_window else lambda row: True
            self._read_group(questions, events, questions=True, may_pad=may_pad)

    def _read_group(self, rows: list[int], events: list, *, questions: bool, may_pad) -> None:
        """One chunk of each prefill row in `rows` that `chunk_batch` reads, in one program,
        padded with other rows that `may_pad`."""
        batch = chunk_batch(self.ledger.prefill_rows, self.lanes, rows, may_pad)
        if batch is None:
            return
        self.executor.read_chunks(
            [self.lanes.prefill_kv_row(row) for row in batch.rows],
            batch.tokens,
            batch.starts,
            batch.counts,
            batch.lengths,
            batch.offsets,
            batch.budget_tokens,
            batch.thresholds,
            questions=questions,
        )
        for row, count in zip(batch.rows, batch.counts, strict=True):
            request = self.ledger.prefill_rows[row]
            if count:
                request.read += int(count)
                if request.read == request.length:
                    self._finish_prefill(request, events)

    def _finish_prefill(self, request: Request, events: list) -> None:
        """The policy's compression of the request's prefilled row (none for a question over a
        cached context) and its first token; it then waits for a slot, in its row (or ends, if
        that token ends it). A request that makes a context moves into its context row."""
        if request.makes_context is not None:
            self._finish_context(request, events)
            return
        compress = request.context is None
        compression = self.policy.prompt_compression
        reads_prompt = compress and compression is not None and compression.needs_prompt_tokens
        row = Rows.start(
            prompt_lengths=[request.offset + request.length],
            budget_tokens=request.budget_tokens,
            budget_ratio=request.budget_ratio,
            thresholds=request.thresholds,
            keys=row_keys(request.key, [0]),
            sampling=request.sampler.rows(1),
        )
        last_hidden, compressed = self.executor.finish_row(
            self.lanes.prefill_lane(request.row),
            self.lanes.prefill_kv_row(request.row),
            request.prompts.tokens[0] if reads_prompt else np.zeros((1,), np.int32),
            request.offset + request.length,
            request.budget_tokens[0],
            request.prompt_share[0],
            request.thresholds[0],
            request.prefill_key,
            compress=compress,
        )
        token, request.state = self.executor.first_token(last_hidden, row)
        if request.ends_with(token):
            self.ledger.record_held_pages(
                self.lanes, self.executor.row_pages()[0]
            )  # what it ends with
        if self._emit(request, token, events, compressed=compressed):
            self._release(prefills=[request.row])
        else:
            self.ledger.ready.append(request)
            self.ledger.ready.sort(key=lambda r: r.order)

    def _finish_context(self, request: Request, events: list) -> None:
        """A context's prefilled row compressed and moved into its context row: it is ready."""
        lanes, held = self.lanes, request.makes_context
        compression = self.policy.prompt_compression
        reads_prompt = compression is not None and compression.needs_prompt_tokens
        lane, kv_row = lanes.prefill_lane(request.row), lanes.prefill_kv_row(request.row)
        held.last_hidden, compressed = self.executor.finish_row(
            lane,
            kv_row,
            request.prompts.tokens[0] if reads_prompt else np.zeros((1,), np.int32),
            request.length,
            request.budget_tokens[0],
            request.prompt_share[0],
            request.thresholds[0],
            request.prefill_key,
        )
        with compiling_as("the engine's admission"):
            self.executor.move(lane, kv_row, lanes.context_kv_row(held.row))
        self.ledger.prefill_rows[request.row] = None
        request.row, held.request, held.ready = None, None, True
        pages = self.executor.row_pages()[0]
        held.pages = Pages.of(pages[lane, :, :, lanes.context_kv_row(held.row)].sum(axis=0))
        events.append(
            ContextEvent(
                held.id,
                "ready",
                held.tokens,
                kv_bytes=self.executor.kv_bytes(held.pages),
                full_kv_bytes=self.full_kv_bytes(held.tokens),
                compressed=compressed,
            )
        )
        if held.dropping and not held.readers:
            self._drop(held)

    def _admit(self, request: Request, slot: int) -> None:
        """Moves a ready request into `slot`: its row's pages (no copy) or its swapped-out
        state back into the pool, its row state into the slots'."""
        lanes = self.lanes
        self.ledger.ready.remove(request)
        source = None if request.row is None else lanes.prefill_kv_row(request.row)
        with compiling_as("the engine's admission"):
            self.executor.admit(
                lanes.slot_lane(slot),
                lanes.slot_kv_row(slot),
                request.state,
                source=source,
                swapped=request.swapped,
            )
        if request.row is not None:
            self.ledger.prefill_rows[request.row] = None
        request.row, request.swapped = None, None
        self.ledger.slots[slot] = request

    def _swap_out(self, request: Request, *, slot: int | None = None, row: int | None = None):
        """The request in `slot` (running) or prefill `row` (ready) swapped out to the host, its
        pages freed: it waits for a slot again, its state whole."""
        lanes = self.lanes
        lane = lanes.slot_lane(slot) if slot is not None else lanes.prefill_lane(row)
        kv_row = lanes.slot_kv_row(slot) if slot is not None else lanes.prefill_kv_row(row)
        with compiling_as("the engine's preemption"):
            request.swapped, request.swapped_pages, state = self.executor.swap_out(
                lane, kv_row, slot=slot is not None
            )
        if slot is not None:
            request.state = state
            self.ledger.slots[slot] = None
            self.ledger.ready.append(request)
            self.ledger.ready.sort(key=lambda r: r.order)
        else:
            self.ledger.prefill_rows[row] = None
        request.row = None
        request.preemptions += 1
        self.preemptions += 1

    def _emit(
        self,
        request: Request,
        token: int,
        events: list,
        *,
        slot: int | None = None,
        compressed: bool | None = None,
    ) -> bool:
        """Records the request's new token; True when it finished (its `slot`, if it holds one,
        released)."""
        reason = request.end_reason(token)
        request.generated.append(token)
        event = TokenEvent(request.id, token, reason is not None, reason, compressed)
        if reason is not None:
            event = dataclasses.replace(event, **self._bytes_held(request))
        events.append(event)
        if reason is not None and slot is not None:
            self._release(slots=[slot])
        if reason is not None:
            self._forget(request)
        return reason is not None

    def _bytes_held(self, request: Request) -> dict:
        """The finished request's `kv_bytes` (its pages after its last step) and `full_kv_bytes`
        (the full cache's pages for its prompt and generated tokens, the last unwritten)."""
        written = request.offset + request.length + len(request.generated) - 1
        return {
            "kv_bytes": self.executor.kv_bytes(request.held_pages),
            "full_kv_bytes": self.full_kv_bytes(written),
        }

    def full_kv_bytes(self, tokens: int) -> int:
        """Bytes the full cache holds for `tokens` tokens of every head (the pool's pages, in
        the kv dtype)."""
        return self.executor.kv_bytes(Pages(self.intake.full_pages(tokens)))

    def _release(self, slots: Sequence[int] = (), prefills: Sequence[int] = ()) -> None:
        """These slots' and prefill rows' pages back to the pool, the rows empty."""
        if not slots and not prefills:
            return
        self.executor.release(self.lanes.kv_rows_mask(slots, prefills))
        for slot in slots:
            self.ledger.slots[slot] = None
        for row in prefills:
            self.ledger.prefill_rows[row].row = None
            self.ledger.prefill_rows[row] = None

    def _decode(self, slots: Sequence[int], events: list[TokenEvent]) -> None:
        tokens = np.zeros((self.limits.max_slots,), np.int32)
        active = np.zeros((self.limits.max_slots,), bool)
        for slot in slots:
            tokens[slot], active[slot] = self.ledger.slots[slot].generated[-1], True
        new_tokens = self.executor.decode(tokens, active)
        if any(self.ledger.slots[slot].ends_with(int(new_tokens[slot])) for slot in slots):
            self.ledger.record_held_pages(
                self.lanes, self.executor.row_pages()[0]
            )  # what they end with
        for slot in slots:
            self._emit(self.ledger.slots[slot], int(new_tokens[slot]), events, slot=slot)
