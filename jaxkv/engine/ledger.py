"""Where the engine's requests and cached contexts are now (its mutable host bookkeeping), and
what the scheduler sees of it: each lane's `View` and the plan of a step over every lane.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxkv.engine.contexts import Context, ContextsFullError
from jaxkv.engine.intake import Intake
from jaxkv.engine.lanes import Lanes
from jaxkv.engine.pages import Pages
from jaxkv.engine.requests import Request
from jaxkv.engine.scheduler import (
    IdleContext,
    Plan,
    Prefilling,
    Ready,
    Running,
    View,
    Waiting,
    drop_order,
    plan_step,
)


@dataclasses.dataclass(eq=False)
class Ledger:
    """The engine's requests and contexts, by where they are (mutable: the engine's own).

    slots: the request decoding in each slot, or None.
    prefill_rows: the request reading its prompt (or ready, in its row) in each prefill row.
    ready: prefilled requests waiting for a slot, oldest first (in their rows or swapped out).
    waiting: the queue, first come first.
    contexts: the cached contexts by id; context_rows: the one in each context row.
    """

    slots: list[Request | None]
    prefill_rows: list[Request | None]
    ready: list[Request]
    waiting: collections.deque[Request]
    contexts: dict[int, Context]
    context_rows: list[Context | None]

    @classmethod
    def empty(cls, slots: int, prefills: int, contexts: int) -> Ledger:
        return cls(
            [None] * slots, [None] * prefills, [], collections.deque(), {}, [None] * contexts
        )

    def record_held_pages(self, lanes: Lanes, held: np.ndarray) -> None:
        """Each request in a slot or a prefill row: the pages it holds now, every device's
        (held: [lanes, devices, pools, rows]), for the bytes its last token reports."""
        for slot, request in enumerate(self.slots):
            if request is not None:
                lane, row = lanes.slot_lane(slot), lanes.slot_kv_row(slot)
                request.held_pages = Pages.of(held[lane, :, :, row].sum(axis=0))
        for index, request in enumerate(self.prefill_rows):
            if request is not None:
                lane, row = lanes.prefill_lane(index), lanes.prefill_kv_row(index)
                request.held_pages = Pages.of(held[lane, :, :, row].sum(axis=0))

    def plan(
        self, lanes: Lanes, row_pages: tuple, intake: Intake
    ) -> tuple[Plan, list[tuple[int, Request]], list[Request]]:
        """Each lane's plan (`plan_step` of its `lane_view`), the lanes with the most free
        pages first (so a new request goes to the emptiest), drawing on the queue and the
        swapped-out requests in turn; merged into one plan of global slots and rows, with the
        queued requests that start (row, request) and those refused. row_pages: the
        executor's (held, own, growth, free) page counts."""
        held, own, growth, free = row_pages
        self.record_held_pages(lanes, held)
        own, growth, free = own.max(axis=1), growth.max(axis=1), free.min(axis=1)
        queue = list(self.waiting)
        swapped = [r for r in self.ready if r.row is None]
        plans, started, refused = [], [], []
        for lane in sorted(range(lanes.count), key=lambda lane: -free[lane][0]):
            startable = [r for r in queue if _may_start(r, lane)]
            view, head = self.lane_view(
                lanes,
                lane,
                (own[lane], growth[lane], Pages.of(free[lane])),
                startable,
                swapped,
                intake,
            )
            plan = plan_step(view)
            gone = [head[i] for i in plan.refuse_waiting]
            skipped = {*plan.refuse_waiting, *plan.passed}
            starting = [r for i, r in enumerate(head) if i not in skipped][: len(plan.start)]
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
                if field.name not in ("refuse_waiting", "passed")
            }
        )
        return merged, started, refused

    def lane_view(
        self, lanes: Lanes, lane: int, pages: tuple, queue, swapped, intake: Intake
    ) -> tuple[View, list[Request]]:
        """What the scheduler sees of `lane` (`pages`: the pages its kv rows alone hold and
        may add, [pools, rows] each, and its free pages), with the unclaimed swapped-out
        requests, the queue's head (of those that may start in it) and its idle contexts."""
        held, growth, free = pages

        def of(counts, kv_row: int) -> Pages:
            return Pages.of(counts[:, kv_row])

        running = tuple(
            Running(
                slot,
                r.order,
                of(held, lanes.slot_kv_row(slot)),
                of(growth, lanes.slot_kv_row(slot)),
            )
            for slot in lanes.lane_slots(lane)
            if (r := self.slots[slot]) is not None
        )
        ready = [
            Ready(
                r.order,
                r.row,
                of(held, lanes.prefill_kv_row(r.row)),
                of(growth, lanes.prefill_kv_row(r.row)),
            )
            for r in self.ready
            if r.row is not None and lanes.prefill_lane(r.row) == lane
        ]
        ready += [Ready(r.order, None, *r.swapped_pages) for r in swapped]
        prefilling = []
        for row in lanes.lane_prefills(lane):
            r = self.prefill_rows[row]
            if r is None or r.state is not None:
                continue
            row_held = of(held, lanes.prefill_kv_row(row))
            reserved = (r.peak_pages - row_held).floor()
            prefilling.append(
                Prefilling(
                    row=row,
                    order=r.order,
                    held_pages=row_held,
                    reserved_pages=reserved,
                    chunk_tokens=r.next_chunk,
                    chunk_pages=intake.read_pages(r).cap(reserved),
                )
            )
        free_rows = tuple(
            row for row in lanes.lane_prefills(lane) if self.prefill_rows[row] is None
        )
        head = queue if free_rows else []  # requests reading a context may pass the first
        idle = tuple(
            IdleContext(row, c.last_used, of(held, lanes.context_kv_row(row)), c.evict_first)
            for row in lanes.lane_contexts(lane)
            if (c := self.context_rows[row]) is not None and c.idle
        )
        view = View(
            running=running,
            ready=tuple(sorted(ready, key=lambda r: r.order)),
            prefilling=tuple(prefilling),
            waiting=tuple(Waiting(r.peak_pages, r.next_chunk, r.context is not None) for r in head),
            free_slots=tuple(s for s in lanes.lane_slots(lane) if self.slots[s] is None),
            free_rows=free_rows,
            free_pages=free,
            num_pages=intake.pool_pages,
            max_batched_tokens=intake.limits.max_batched_tokens,
            idle_contexts=idle,
        )
        return view, head

    def idle_contexts(self, lanes: Lanes, lane: int) -> list[Context]:
        """The contexts of `lane` no request reads or waits for (droppable for pages)."""
        return [
            c
            for c in self.context_rows
            if c is not None and c.idle and lanes.context_lane(c.row) == lane
        ]

    def row_for_new_context(self, lanes: Lanes) -> tuple[int, Context | None]:
        """A context row for a new context: a free one (in the lane holding the fewest
        contexts; None to drop), else that of the first idle context in `drop_order` (to drop);
        ContextsFullError when every row holds a context that requests read or wait for."""
        free = [row for row, held in enumerate(self.context_rows) if held is None]
        if free:
            lane_of = lanes.context_lane
            held = collections.Counter(lane_of(h.row) for h in self.context_rows if h is not None)
            return min(free, key=lambda row: (held[lane_of(row)], row)), None
        idle = [held for held in self.context_rows if held.idle]
        if not idle:
            raise ContextsFullError(
                f"every one of the engine's max_contexts={len(self.context_rows)} context rows "
                "holds a context that requests read or wait for: retry later, or drop one"
            )
        first = min(idle, key=drop_order)
        return first.row, first

    def holds_no_question(self, row: int) -> bool:
        request = self.prefill_rows[row]
        return request is None or request.context is None

    def holds_an_unread_prompt_or_none(self, row: int) -> bool:
        request = self.prefill_rows[row]
        return request is None or (request.context is None and request.state is None)

    def holds_no_prompt(self, row: int) -> bool:
        request = self.prefill_rows[row]
        return request is None or request.context is not None


def _may_start(request: Request, lane: int) -> bool:
    """Whether a queued request may start in `lane` now (its context's lane, once the context
    is ready)."""
    in_lane = request.lane is None or request.lane == lane
    return in_lane and (request.context is None or request.context.ready)
