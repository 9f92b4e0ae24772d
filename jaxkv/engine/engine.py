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
import numpy as np

from jaxkv import sharding
from jaxkv.attention import Backend, resolve_backend
from jaxkv.cache import CacheConfig
from jaxkv.cache.config import check_count
from jaxkv.compile_log import compiling_as
from jaxkv.engine.executor import Executor
from jaxkv.engine.lanes import Lanes
from jaxkv.engine.pages import heads, pages_needed_alone, prefill_peak_pages
from jaxkv.engine.requests import QueueFullError, Request, TokenEvent, TooLargeForPoolError
from jaxkv.engine.scheduler import Plan, Prefilling, Ready, Running, View, Waiting, plan_step
from jaxkv.generation.request import (
    DEFAULT_PREFILL_CHUNK,
    checked_key,
    checked_prompts,
    checked_stop_tokens,
    prompt_lists,
)
from jaxkv.models.decoder import Model
from jaxkv.pallas_kernels.common import next_power_of_two
from jaxkv.policies import FullCache, Policy, from_spec
from jaxkv.policies.base import PolicyParams, with_budget
from jaxkv.sampling import Sampler
from jaxkv.step.rows import Rows, row_keys


class Engine:
    """Continuous batching over one paged pool (module docstring).

    Args:
      model: the model.
      policy: the cache policy every request uses (or its spec, "kvzip:0.3"); default full.
      cache: the pool: `CacheConfig(num_pages=...)` (required: the engine's memory; on a mesh,
        each device's), its page size and kv dtype; int8 storage is not supported here.
      max_slots: requests decoded at once.
      max_prefills: requests whose prompts are read at once (prefill rows).
      max_batched_tokens: the most tokens one step runs on a lane, a decode row's token and a
        prefill chunk's tokens counted (default: room for every slot and a full chunk of every
        prefill row); at least the lane's slots + 16.
      max_context: the longest prompt + generation a request may have (default: the model's
        max_position_embeddings, at most 8192); sizes the page tables.
      max_waiting: the bound of the waiting queue (`submit` raises QueueFullError past it).
      mesh: a (data, model) mesh (`jaxkv.sharding.make_inference_mesh`) as `generate` takes:
        slots and prefill rows split over `data` (each data shard a lane with a pool per
        device; max_slots and max_prefills multiples of it), KV heads with their query heads
        over `model`. None: one device.
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
        mesh: jax.sharding.Mesh | None = None,
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
        self.max_slots = check_count("max_slots", max_slots, 1)
        self.max_prefills = check_count("max_prefills", max_prefills, 1)
        placement = sharding.as_inference_mesh(mesh)
        if placement is not None:
            for name, count in (("max_slots", max_slots), ("max_prefills", max_prefills)):
                if count % placement.data:
                    raise ValueError(
                        f"{name}={count} must be a multiple of the mesh's data axis "
                        f"({placement.data}): each data shard holds an equal share"
                    )
            placement.check(model.config, self.max_slots)
            model = placement.place(model, placement.model_specs(model))
            policy_params = placement.place_policy_params(self.policy, policy_params)
        self.placement = placement
        self.lanes = Lanes(
            placement,
            slots=self.max_slots // (1 if placement is None else placement.data),
            prefills=self.max_prefills // (1 if placement is None else placement.data),
        )
        self.model, self.cache = model, cache
        self.device_config = (
            model.config if placement is None else placement.local_config(model.config)
        )
        self.prefill_chunk = (
            None if prefill_chunk is None else check_count("prefill_chunk", prefill_chunk, 1)
        )
        chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else self.prefill_chunk
        if max_batched_tokens is None:
            max_batched_tokens = self.lanes.slots + self.lanes.prefills * chunk
        self.max_batched_tokens = check_count(
            "max_batched_tokens", max_batched_tokens, self.lanes.slots + 16
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
        self.executor = Executor(
            model,
            self.policy,
            cache=cache,
            lanes=self.lanes,
            placement=placement,
            max_context=self.max_context,
            policy_params=policy_params,
            backend=resolve_backend(backend),
        )
        self._slots: list[Request | None] = [None] * self.max_slots
        self._prefill_rows: list[Request | None] = [None] * self.max_prefills
        self._ready: list[Request] = []  # prefilled, waiting for a slot, oldest first
        self._waiting: collections.deque[Request] = collections.deque()
        self._next_id = 0
        self._started = 0
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
        budget: float | int | None = None,
    ) -> int:
        """Queues one prompt (token ids); returns its request id. Checked here, before anything
        runs: the ids, max_new_tokens >= 1, prompt + max_new_tokens <= max_context, the
        policy's budget, its chunk against max_batched_tokens, the pages the request may hold
        alone against the pool (`TooLargeForPoolError`), the key (required when sampling), the
        stop tokens; QueueFullError past `max_waiting`. budget: the request's own budget for
        the engine's policy (a ratio of the prompt or a token count, as `budget=` of
        `policies.get`; default: the policy's): budgets travel as arrays, so it compiles
        nothing new."""
        rows = prompt_lists(prompt_ids)
        if len(rows) != 1:
            raise ValueError(f"prompt_ids holds {len(rows)} prompts: submit one at a time")
        policy = self.policy if budget is None else with_budget(self.policy, budget)
        prompts = checked_prompts(self.model, policy, rows, self.prefill_chunk)
        length = int(prompts.lengths[0])
        max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
        if length + max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt of {length} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"engine's max_context={self.max_context}"
            )
        if prompts.chunk + self.lanes.slots > self.max_batched_tokens:
            raise ValueError(
                f"the prompt is read in chunks of {prompts.chunk} tokens with policy "
                f"{self.policy.name!r}: give max_batched_tokens >= "
                f"{prompts.chunk + self.lanes.slots} (the chunk and a token of each of a "
                f"lane's {self.lanes.slots} slots), not {self.max_batched_tokens}"
            )
        budget_tokens = policy.budget_tokens(prompts.lengths)
        self._check_fits_alone(policy, length, max_new_tokens)
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
        request = Request(
            id=self._next_id,
            prompts=prompts,
            budget_tokens=budget_tokens,
            budget_ratio=policy.budget_ratio(1),
            thresholds=policy.thresholds(1),
            peak_pages=prefill_peak_pages(
                policy, self.device_config, length, prompts.chunk, self.cache.page_size
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

    def _check_fits_alone(self, policy: Policy, length: int, max_new_tokens: int) -> None:
        """TooLargeForPoolError when the request's plan needs more pages than the pool has
        (the policy's own budget checks run first, named)."""

        def needed(new_tokens: int) -> int:
            return pages_needed_alone(
                policy,
                self.model.config,
                length,
                new_tokens,
                self.cache.page_size,
                self.prefill_chunk,
                self.device_config,
            )

        pool = self.cache.num_pages
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
            f"with policy {policy.name!r}, more than the pool's num_pages={pool} hold: "
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
                    self._release(prefills=[request.row])
                return True
        for row, request in enumerate(self._prefill_rows):
            if request is not None and request.id == request_id:
                self._release(prefills=[row])
                return True
        for slot, request in enumerate(self._slots):
            if request is not None and request.id == request_id:
                self._release(slots=[slot])
                return True
        return False

    def has_work(self) -> bool:
        held = any(r is not None for r in self._slots + self._prefill_rows)
        return held or bool(self._waiting) or bool(self._ready)

    def stats(self) -> dict:
        """Requests running and waiting (queued, prefilling or prefilled), pages in use and the
        pool's size (every device's), the bytes of a local ring beside the pool (WG-KV's: every
        row's, reserved at creation; 0 without one), the KV bytes held in all (pages in use and
        ring; host values) and the preemptions so far."""
        in_rows = sum(r is not None and r.state is None for r in self._prefill_rows)
        pools = self.lanes.count * self.lanes.devices
        usage = self.executor.usage()
        return {
            "running": sum(r is not None for r in self._slots),
            "waiting": len(self._waiting) + in_rows + len(self._ready),
            "pages_in_use": usage["pages_in_use"],
            "num_pages": self.cache.num_pages * pools,
            "ring_bytes": usage["ring_bytes"],
            "kv_bytes_in_use": usage["kv_bytes_in_use"],
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
        """One step: the scheduler's plan of each lane (`jaxkv.engine.scheduler.plan_step`)
        from what the engine holds now, executed in its order (refusals, preemptions,
        admissions, a decode step of every running request, a chunk of every prefill row it
        reads); the tokens produced."""
        plan, started, refused = self._plan()
        events: list[TokenEvent] = []
        for request in refused:
            self._waiting.remove(request)
            events.append(TokenEvent(request.id, -1, True, "too_large"))
        for order in plan.refuse:
            request = next(r for r in self._ready if r.order == order)
            self._ready.remove(request)
            if request.row is not None:
                self._release(prefills=[request.row])
            events.append(TokenEvent(request.id, -1, True, "too_large"))
        for slot in plan.preempt:
            self._swap_out(self._slots[slot], slot=slot)
        for row in plan.swap_out:
            self._swap_out(self._prefill_rows[row], row=row)
        aborted = [self._prefill_rows[row] for row in plan.abort]
        self._release(prefills=plan.abort)
        for request in reversed(aborted):
            request.read = 0
            self._waiting.appendleft(request)
        ended = [self._slots[slot] for slot in plan.too_large]
        self._release(slots=plan.too_large)
        events += [TokenEvent(request.id, -1, True, "too_large") for request in ended]
        for order, slot in plan.admit:
            self._admit(next(r for r in self._ready if r.order == order), slot)
        if plan.decode:
            with compiling_as("the engine's decode step"):
                self._decode(plan.decode, events)
        if plan.prefill or started:
            for row, request in started:
                self._waiting.remove(request)
                self._start_prefill(request, row)
            with compiling_as("the engine's prefill chunk"):
                self._read_chunks(sorted(plan.prefill + tuple(row for row, _ in started)), events)
        return events

    def _plan(self) -> tuple[Plan, list[tuple[int, Request]], list[Request]]:
        """Each lane's plan, the lanes with the most free pages first (so a new request goes to
        the emptiest), drawing on the queue and the swapped-out requests in turn; merged into
        one plan of global slots and rows, with the queued requests that start (row, request)
        and those refused."""
        held, growth, free = self.executor.row_pages()
        self._record_held_pages(held)
        held, growth, free = held.max(axis=1), growth.max(axis=1), free.min(axis=1)
        queue = list(self._waiting)
        swapped = [r for r in self._ready if r.row is None]
        plans, started, refused = [], [], []
        for lane in sorted(range(self.lanes.count), key=lambda lane: -free[lane]):
            view, head = self._view(lane, held[lane], growth[lane], int(free[lane]), queue, swapped)
            plan = plan_step(view)
            gone = [head[i] for i in plan.refuse_waiting]
            starting = [r for r in head if r not in gone][: len(plan.start)]
            refused += gone
            started += list(zip(plan.start, starting, strict=True))
            queue = [r for r in queue if r not in gone and r not in starting]
            claimed = {order for order, _ in plan.admit} | set(plan.refuse)
            swapped = [r for r in swapped if r.order not in claimed]
            plans.append(plan)
        merged = Plan(
            **{
                field.name: tuple(x for plan in plans for x in getattr(plan, field.name))
                for field in dataclasses.fields(Plan)
                if field.name != "refuse_waiting"
            }
        )
        return merged, started, refused

    def _record_held_pages(self, held: np.ndarray) -> None:
        """Each request in a slot or a prefill row: the pages it holds now, every device's
        (held: [lanes, devices, rows]), for the bytes its last token reports."""
        lanes = self.lanes
        for slot, request in enumerate(self._slots):
            if request is not None:
                lane, row = lanes.slot_lane(slot), lanes.slot_kv_row(slot)
                request.held_pages = int(held[lane, :, row].sum())
        for index, request in enumerate(self._prefill_rows):
            if request is not None:
                lane, row = lanes.prefill_lane(index), lanes.prefill_kv_row(index)
                request.held_pages = int(held[lane, :, row].sum())

    def _view(self, lane, held, growth, free, queue, swapped) -> tuple[View, list[Request]]:
        """What the scheduler sees of `lane` (its kv rows' pages `held`, `growth`; its free
        pages), with the unclaimed swapped-out requests and the queue's head."""
        lanes = self.lanes
        running = tuple(
            Running(
                slot,
                r.order,
                int(held[lanes.slot_kv_row(slot)]),
                int(growth[lanes.slot_kv_row(slot)]),
            )
            for slot in lanes.lane_slots(lane)
            if (r := self._slots[slot]) is not None
        )
        ready = [
            Ready(
                r.order,
                r.row,
                int(held[lanes.prefill_kv_row(r.row)]),
                int(growth[lanes.prefill_kv_row(r.row)]),
            )
            for r in self._ready
            if r.row is not None and lanes.prefill_lane(r.row) == lane
        ]
        ready += [Ready(r.order, None, *r.swapped_pages) for r in swapped]
        prefilling = []
        for row in lanes.lane_prefills(lane):
            r = self._prefill_rows[row]
            if r is None or r.state is not None:
                continue
            row_held = int(held[lanes.prefill_kv_row(row)])
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
        free_rows = tuple(
            row for row in lanes.lane_prefills(lane) if self._prefill_rows[row] is None
        )
        head = queue[: len(free_rows)]
        view = View(
            running=running,
            ready=tuple(sorted(ready, key=lambda r: r.order)),
            prefilling=tuple(prefilling),
            waiting=tuple(Waiting(r.peak_pages, r.next_chunk) for r in head),
            free_slots=tuple(s for s in lanes.lane_slots(lane) if self._slots[s] is None),
            free_rows=free_rows,
            free_pages=free,
            num_pages=self.cache.num_pages,
            max_batched_tokens=self.max_batched_tokens,
        )
        return view, head

    def _chunk_pages(self, tokens: int) -> int:
        """The most pages of a device reading `tokens` more tokens may allocate: a page per head
        for each `page_size` of them, and one more where a head's last page is part full."""
        return heads(self.device_config) * (-(-tokens // self.cache.page_size) + 1)

    def _start_prefill(self, request: Request, row: int) -> None:
        if request.order < 0:
            request.order = self._started
            self._started += 1
        request.row, request.read = row, 0
        self._prefill_rows[row] = request

    def _read_chunks(self, rows: list[int], events: list[TokenEvent]) -> None:
        """One chunk of each prefill row in `rows`, in one program: each lane reads R rows
        (a power of two, at most its rows), its own padded with its other rows, which read
        nothing; then the compression and first token of each row whose prompt is read."""
        lanes = self.lanes
        per_lane = [
            [row for row in rows if lanes.prefill_lane(row) == lane] for lane in range(lanes.count)
        ]
        width = min(next_power_of_two(max(map(len, per_lane))), lanes.prefills)
        batch = []
        for lane, reading in enumerate(per_lane):
            others = sorted(
                (row for row in lanes.lane_prefills(lane) if row not in reading),
                key=lambda row: self._prefill_rows[row] is not None,  # empty rows first
            )
            batch += reading + others[: width - len(reading)]
        counts = [self._prefill_rows[row].next_chunk if row in rows else 0 for row in batch]
        chunk = max(16, next_power_of_two(max(counts)))
        tokens = np.zeros((len(batch), chunk), np.int32)
        starts, lengths = np.zeros(len(batch), np.int32), np.zeros(len(batch), np.int32)
        template = self._prefill_rows[rows[0]]
        budget = np.zeros((len(batch),) + template.budget_tokens.shape[1:], np.int32)
        thresholds = np.zeros((len(batch),) + template.thresholds.shape[1:], np.float32)
        for i, (row, count) in enumerate(zip(batch, counts, strict=True)):
            request = self._prefill_rows[row]
            if request is None:
                continue
            read = min(request.read, request.length)
            starts[i], lengths[i] = read, request.length
            tokens[i, :count] = request.prompts.tokens[0, read : read + count]
            budget[i], thresholds[i] = request.budget_tokens[0], request.thresholds[0]
        self.executor.read_chunks(
            [lanes.prefill_kv_row(row) for row in batch],
            tokens,
            starts,
            np.asarray(counts, np.int32),
            lengths,
            budget,
            thresholds,
        )
        for row, count in zip(batch, counts, strict=True):
            request = self._prefill_rows[row]
            if count:
                request.read += count
                if request.read == request.length:
                    self._finish_prefill(request, events)

    def _finish_prefill(self, request: Request, events: list[TokenEvent]) -> None:
        """The policy's compression of the request's prefilled row and its first token; it
        then waits for a slot, in its row (or ends, if that token ends it)."""
        compression = self.policy.prompt_compression
        reads_prompt = compression is not None and compression.needs_prompt_tokens
        row = Rows.start(
            prompt_lengths=[request.length],
            budget_tokens=request.budget_tokens,
            budget_ratio=request.budget_ratio,
            thresholds=request.thresholds,
            keys=row_keys(request.key, [0]),
            sampling=request.sampler.rows(1),
        )
        token, request.state, compressed = self.executor.finish_row(
            self.lanes.prefill_lane(request.row),
            self.lanes.prefill_kv_row(request.row),
            request.prompts.tokens[0] if reads_prompt else np.zeros((1,), np.int32),
            request.length,
            request.budget_tokens[0],
            request.thresholds[0],
            request.prefill_key,
            row,
        )
        if request.ends_with(token):
            self._record_held_pages(self.executor.row_pages()[0])  # what it ends with
        if self._emit(request, token, events, compressed=compressed):
            self._release(prefills=[request.row])
        else:
            self._ready.append(request)
            self._ready.sort(key=lambda r: r.order)

    def _admit(self, request: Request, slot: int) -> None:
        """Moves a ready request into `slot`: its row's pages (no copy) or its swapped-out
        state back into the pool, its row state into the slots'."""
        lanes = self.lanes
        self._ready.remove(request)
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
            self._prefill_rows[request.row] = None
        request.row, request.swapped = None, None
        self._slots[slot] = request

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
            self._slots[slot] = None
            self._ready.append(request)
            self._ready.sort(key=lambda r: r.order)
        else:
            self._prefill_rows[row] = None
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
        return reason is not None

    def _bytes_held(self, request: Request) -> dict:
        """The finished request's `kv_bytes` (its pages after its last step) and `full_kv_bytes`
        (the full cache's pages for its prompt and generated tokens, the last unwritten)."""
        cfg, page_size = self.model.config, self.cache.page_size
        page_bytes = self.executor.page_bytes
        written = request.length + len(request.generated) - 1
        full_pages = cfg.num_layers * cfg.num_kv_heads * -(-written // page_size)
        return {
            "kv_bytes": request.held_pages * page_bytes,
            "full_kv_bytes": full_pages * page_bytes,
        }

    def _release(self, slots: Sequence[int] = (), prefills: Sequence[int] = ()) -> None:
        """These slots' and prefill rows' pages back to the pool, the rows empty."""
        if not slots and not prefills:
            return
        self.executor.release(self.lanes.kv_rows_mask(slots, prefills))
        for slot in slots:
            self._slots[slot] = None
        for row in prefills:
            self._prefill_rows[row].row = None
            self._prefill_rows[row] = None

    def _decode(self, slots: Sequence[int], events: list[TokenEvent]) -> None:
        tokens = np.zeros((self.max_slots,), np.int32)
        active = np.zeros((self.max_slots,), bool)
        for slot in slots:
            tokens[slot], active[slot] = self._slots[slot].generated[-1], True
        new_tokens = self.executor.decode(tokens, active)
        if any(self._slots[slot].ends_with(int(new_tokens[slot])) for slot in slots):
            self._record_held_pages(self.executor.row_pages()[0])  # what they end with
        for slot in slots:
            self._emit(self._slots[slot], int(new_tokens[slot]), events, slot=slot)
