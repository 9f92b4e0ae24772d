"""The engine's scheduler: a pure host function from what the engine holds (`View`: page
counts, slots, the queue) to what its next step does (`Plan`). It runs no model and touches no
device array, so its rules are tested with numbers alone (tests/test_scheduler.py).

A step's plan, in the order the engine executes it:
1. the prefilled request (its prompt prefilled and compressed, its first token sampled) moves
   into a free slot when its pages and its first decode step's fit beside the running rows'
   next step; one that could not fit the pool even alone is refused (`too_large`);
2. while the running rows' next step needs more pages than are free, the newest is preempted
   (its pages freed, back to the queue); the only one running is never preempted (nothing would
   free a page for its return): it ends `too_large`;
3. the running rows decode one token;
4. the next prefill chunk runs (the queue's first request starts when none is in flight and no
   prefilled request waits for a slot).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Running:
    """A request in a slot: its admission order and its pages (held, and what its next decode
    step may allocate: a page per head whose last page is full)."""

    slot: int
    order: int
    held_pages: int
    growth_pages: int


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A prefilled request waiting for a slot: the pages it holds and its first decode step's."""

    held_pages: int
    growth_pages: int


@dataclasses.dataclass(frozen=True)
class View:
    """What the scheduler sees of the engine at the start of a step (host numbers).

    Attributes:
      running: the requests in slots.
      free_slots: the slots no request holds.
      prefilled: the prefilled request waiting for a slot, if any.
      prefilling: whether a request's prefill is in flight.
      waiting: requests in the queue.
      free_pages, num_pages: the pool's free pages and size.
    """

    running: tuple[Running, ...]
    free_slots: tuple[int, ...]
    prefilled: Prefilled | None
    prefilling: bool
    waiting: int
    free_pages: int
    num_pages: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a step does (`jaxkv.engine.Engine.step` executes it in this order).

    Attributes:
      admit: the slot the prefilled request moves into, or None.
      refuse: the prefilled request needs more pages than the pool has: it ends `too_large`.
      preempt: slots whose requests go back to the queue, newest first.
      too_large: the slot of the only request running when its next step does not fit.
      decode: the slots that decode a token.
      prefill: whether the next prefill chunk runs.
    """

    admit: int | None
    refuse: bool
    preempt: tuple[int, ...]
    too_large: tuple[int, ...]
    decode: tuple[int, ...]
    prefill: bool


def plan_step(view: View) -> Plan:
    """The plan of the engine's next step (module docstring)."""
    free = view.free_pages
    refuse = view.prefilled is not None and _pages(view.prefilled) > view.num_pages
    running = list(view.running)
    admit = None
    if view.prefilled is not None and not refuse and view.free_slots:
        candidate = Running(
            slot=view.free_slots[0],
            order=max((r.order for r in running), default=-1) + 1,
            held_pages=view.prefilled.held_pages,
            growth_pages=view.prefilled.growth_pages,
        )
        fits_with = running + [candidate]
        # Admitted only when nothing is preempted for it (it would be the newest, preempted
        # first): its pages and every running row's next step fit.
        if sum(r.growth_pages for r in fits_with) + candidate.held_pages <= free:
            admit, running = candidate.slot, fits_with
            free -= candidate.held_pages
    preempt, too_large = [], []
    while running and sum(r.growth_pages for r in running) > free:
        newest = max(running, key=lambda r: r.order)
        running.remove(newest)
        if running:
            preempt.append(newest.slot)
            free += newest.held_pages
        else:
            too_large.append(newest.slot)
    waits_for_slot = view.prefilled is not None and admit is None and not refuse
    return Plan(
        admit=admit,
        refuse=refuse,
        preempt=tuple(preempt),
        too_large=tuple(too_large),
        decode=tuple(sorted(r.slot for r in running)),
        prefill=(view.prefilling or view.waiting > 0) and not waits_for_slot,
    )


def _pages(request: Prefilled) -> int:
    return request.held_pages + request.growth_pages
