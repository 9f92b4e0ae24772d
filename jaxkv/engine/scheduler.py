"""The engine's scheduler: a pure host function from what the engine holds (`View`: page
counts, slots, prefill rows, the queue) to what its next step does (`Plan`). It runs no model
and touches no device array, so its rules are tested with numbers alone
(tests/test_scheduler.py).

Every page a request holds is the pool's, from its first prefill chunk to its release: the
prefill rows (where prompts are read and compressed) and the decode slots share it. A request
goes waiting -> prefilling (in a prefill row, a chunk per step) -> ready (prefilled, its first
token sampled; in its prefill row, or swapped out to the host after a preemption) -> running
(in a slot, a token per step). A step's plan:
1. ready requests move into free slots, oldest first, while the pages each brings in and
   every running row's next step fit (the first that does not fit waits, and those behind it);
   one whose pages and first step exceed the pool is refused (`refuse`), and so is a queued
   one whose prefill alone would (`refuse_waiting`; `submit` plans both, so neither happens
   unless a plan came out too small);
2. while the running rows' next step needs more pages than are free, the newest request that
   holds pages gives them back: a running one or a ready one is swapped out to the host
   (`preempt`, `swap_out`: its state comes back whole), a prefilling one goes back to the
   queue (`abort`: its prefill restarts); the only request left running is never preempted
   (nothing would free a page for its return): it ends `too_large`;
3. the running rows decode one token;
4. prefill chunks run, the oldest prefilling requests first, then new ones from the queue, while
   their tokens fit the step's budget (`max_batched_tokens`, the decode rows' tokens counted)
   and their pages fit: a chunk runs when the pages it may allocate are free after the decode
   step's; a request starts only when the most pages it may hold until its first decode step
   fit beside what the prefills in flight may still allocate (so they never wait on each
   other); in queue order, except that a request reading a cached context may start past one
   that does not fit.
Cached contexts (`Engine.add_context`) hold pages too: one that no request reads or waits for
is idle, and idle contexts are dropped (`drop_order`: `evict_first` ones, then the least
recently used) whenever steps 1, 2 or 4 need their pages, only where that makes the room,
before any request is preempted (`drop_contexts`).

Page counts are read through +, - and <= alone: ints for an engine of one pool, or
`jaxkv.engine.pages.Pages` for one with int8 storage (its model-dtype pool and its int8 tier's:
an amount fits when it fits in each).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Running:
    """A request in a slot: its order (when it started), its pages held, and what its next
    decode step may allocate (a page per head whose last page is full)."""

    slot: int
    order: int
    held_pages: int
    growth_pages: int


@dataclasses.dataclass(frozen=True)
class Ready:
    """A prefilled request waiting for a slot: in prefill row `row` of the pool, or swapped out
    to the host (`row` None: its `held_pages` come back into the pool when it moves in)."""

    order: int
    row: int | None
    held_pages: int
    growth_pages: int


@dataclasses.dataclass(frozen=True)
class Prefilling:
    """A request reading its prompt in prefill row `row`.

    Attributes:
      held_pages: pages it holds.
      reserved_pages: the most pages it may still allocate until its first decode step.
      chunk_tokens: tokens of its next chunk.
      chunk_pages: the most pages its next chunk may allocate.
    """

    row: int
    order: int
    held_pages: int
    reserved_pages: int
    chunk_tokens: int
    chunk_pages: int


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A request in the queue: the most pages it may hold from its first chunk to its first
    decode step, the tokens of its first chunk, and whether it reads a cached context (it may
    then start past a request whose pages do not fit: it is what makes contexts idle)."""

    peak_pages: int
    chunk_tokens: int
    reads_context: bool = False


@dataclasses.dataclass(frozen=True)
class IdleContext:
    """A cached context no request reads or waits for: its context row, when it was last used
    (a count that grows), the pages dropping it frees, and whether it goes before the others
    (`Engine.add_context`'s `evict_first`)."""

    row: int
    last_used: int
    pages: int
    evict_first: bool = False


def drop_order(context) -> tuple[bool, int]:
    """The key idle contexts (an `IdleContext` or the engine's `Context`) are dropped by,
    smallest first: those added to be dropped first, then the least recently used."""
    return not context.evict_first, context.last_used


@dataclasses.dataclass(frozen=True)
class View:
    """What the scheduler sees of the engine at the start of a step (host numbers).

    Attributes:
      running, ready, prefilling: the requests in slots, waiting for one, reading prompts.
      waiting: the queue (of those that may start in this lane), in order.
      free_slots, free_rows: the slots and the prefill rows no request holds.
      free_pages, num_pages: the pool's free pages and size.
      max_batched_tokens: the tokens one step may run (decode rows count one each).
      idle_contexts: the cached contexts that may be dropped for their pages.
    """

    running: tuple[Running, ...]
    ready: tuple[Ready, ...]
    prefilling: tuple[Prefilling, ...]
    waiting: tuple[Waiting, ...]
    free_slots: tuple[int, ...]
    free_rows: tuple[int, ...]
    free_pages: int
    num_pages: int
    max_batched_tokens: int
    idle_contexts: tuple[IdleContext, ...] = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a step does (`jaxkv.engine.Engine.step` executes it in this order).

    Attributes:
      drop_contexts: context rows of idle contexts dropped, their pages freed, first.
      refuse: orders of ready requests whose pages and first step exceed the pool: they end
        `too_large`.
      refuse_waiting: indices in `View.waiting` of queued requests whose prefill's peak exceeds
        the pool: they end `too_large`.
      preempt: slots whose requests are swapped out to the host (back to ready).
      swap_out: prefill rows whose ready requests are swapped out to the host.
      abort: prefill rows whose prefilling requests go back to the front of the queue.
      too_large: the slot of the only request running when its next step does not fit.
      admit: (order, slot): ready requests moving into slots.
      decode: the slots that decode a token.
      prefill: the prefill rows that read their next chunk.
      start: the free prefill rows the queue's first len(start) requests start in (each
        reads its first chunk in this step), but for those in `passed`.
      passed: indices in `View.waiting` of queued requests that do not start while requests
        behind them do: requests that read a cached context pass one whose pages do not fit
        (else its wait for idle contexts could wait on them: they keep those contexts read).
    """

    drop_contexts: tuple[int, ...] = ()
    refuse: tuple[int, ...] = ()
    refuse_waiting: tuple[int, ...] = ()
    preempt: tuple[int, ...] = ()
    swap_out: tuple[int, ...] = ()
    abort: tuple[int, ...] = ()
    too_large: tuple[int, ...] = ()
    admit: tuple[tuple[int, int], ...] = ()
    decode: tuple[int, ...] = ()
    prefill: tuple[int, ...] = ()
    start: tuple[int, ...] = ()
    passed: tuple[int, ...] = ()


def plan_step(view: View) -> Plan:
    """The plan of the engine's next step (module docstring)."""
    free = view.free_pages
    running = list(view.running)
    ready = sorted(view.ready, key=lambda r: r.order)
    prefilling = list(view.prefilling)
    idle = sorted(view.idle_contexts, key=drop_order)
    dropped = []

    def room_for(pages: int) -> bool:
        """Whether `pages` are free, once idle contexts are dropped (`drop_order`) for them;
        none is dropped when dropping them all would not make the room."""
        nonlocal free
        if not pages <= sum((context.pages for context in idle), start=free):
            return False
        while not pages <= free:
            context = idle.pop(0)
            dropped.append(context.row)
            free += context.pages
        return pages <= free

    refuse = [r.order for r in ready if not r.held_pages + r.growth_pages <= view.num_pages]
    for r in ready:
        if r.order in refuse and r.row is not None:
            free += r.held_pages
    ready = [r for r in ready if r.order not in refuse]

    admit, slots = [], list(view.free_slots)
    for r in list(ready):
        brings = r.held_pages if r.row is None else 0
        if not slots or not room_for(_growth(running) + r.growth_pages + brings):
            break
        slot = slots.pop(0)
        admit.append((r.order, slot))
        running.append(Running(slot, r.order, r.held_pages, r.growth_pages))
        ready.remove(r)
        free -= brings

    preempt, swap_out, abort, too_large = [], [], [], []
    room_for(_growth(running))
    while running and not _growth(running) <= free:
        holders = [r for r in ready if r.row is not None] + prefilling
        if len(running) > 1:
            holders += running
        if not holders:
            too_large.append(running.pop().slot)
            break
        newest = max(holders, key=lambda r: r.order)
        free += newest.held_pages
        if isinstance(newest, Running):
            running.remove(newest)
            preempt.append(newest.slot)
        elif isinstance(newest, Ready):
            ready.remove(newest)
            swap_out.append(newest.row)
        else:
            prefilling.remove(newest)
            abort.append(newest.row)

    tokens = view.max_batched_tokens - len(running)
    pages = free - _growth(running)
    reading = []
    for p in sorted(prefilling, key=lambda p: p.order):
        if p.chunk_tokens <= tokens and p.chunk_pages <= pages:
            reading.append(p.row)
            tokens -= p.chunk_tokens
            pages -= p.chunk_pages
    reserved = sum(p.reserved_pages for p in prefilling)
    reserved += sum(r.growth_pages for r in ready if r.row is not None)
    rows = sorted(view.free_rows)  # an aborted row is free from the next step on
    refuse_waiting = [i for i, w in enumerate(view.waiting) if not w.peak_pages <= view.num_pages]
    start, started, passed, blocked = [], [], [], False
    for i, w in enumerate(view.waiting):
        if i in refuse_waiting:
            continue
        if not rows or w.chunk_tokens > tokens:
            break
        if blocked and not w.reads_context:
            passed.append(i)
            continue
        if not room_for(_growth(running) + reserved + w.peak_pages):
            blocked = True  # it waits; only requests that read a cached context pass it
            passed.append(i)
            continue
        start.append(rows.pop(0))
        started.append(i)
        tokens -= w.chunk_tokens
        reserved += w.peak_pages
    passed = [i for i in passed if started and i < started[-1]]
    return Plan(
        drop_contexts=tuple(dropped),
        refuse=tuple(refuse),
        refuse_waiting=tuple(refuse_waiting),
        preempt=tuple(preempt),
        swap_out=tuple(swap_out),
        abort=tuple(abort),
        too_large=tuple(too_large),
        admit=tuple(admit),
        decode=tuple(sorted(r.slot for r in running)),
        prefill=tuple(sorted(reading)),
        start=tuple(start),
        passed=tuple(passed),
    )


def _growth(running: list[Running]) -> int:
    return sum(r.growth_pages for r in running)
