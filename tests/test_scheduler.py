"""The engine's scheduling rules with page counts alone (`jaxkv.engine.scheduler`): no model
runs, every plan is checked whole."""

import dataclasses

from jaxkv.engine.scheduler import (
    IdleContext,
    Plan,
    Prefilling,
    Ready,
    Running,
    View,
    Waiting,
    plan_step,
)


def view(
    running=(),
    ready=(),
    prefilling=(),
    waiting=(),
    free_slots=(),
    free_rows=(),
    free=100,
    budget=1000,
):
    return View(
        running=tuple(running),
        ready=tuple(ready),
        prefilling=tuple(prefilling),
        waiting=tuple(waiting),
        free_slots=tuple(free_slots),
        free_rows=tuple(free_rows),
        free_pages=free,
        num_pages=200,
        max_batched_tokens=budget,
    )


def test_an_idle_engine_plans_nothing_and_a_queue_starts_prefills_in_free_rows():
    assert plan_step(view()) == Plan()
    queue = [Waiting(peak_pages=30, chunk_tokens=64)] * 3
    # Three requests, two free rows: two start, each reading its first chunk in this step.
    assert plan_step(view(waiting=queue[:2], free_rows=(3, 1))) == Plan(start=(1, 3))


def test_a_step_batches_prefill_chunks_under_the_token_budget_decode_rows_first():
    running = [Running(slot=0, order=0, held_pages=10, growth_pages=2)]
    prefilling = [
        Prefilling(row=2, order=2, held_pages=5, reserved_pages=20, chunk_tokens=64, chunk_pages=8),
        Prefilling(row=0, order=1, held_pages=5, reserved_pages=20, chunk_tokens=64, chunk_pages=8),
    ]
    queue = [Waiting(peak_pages=10, chunk_tokens=64)]
    # 1 decode token + 3 chunks of 64 = 193 tokens: all of them run.
    everything = view(running, prefilling=prefilling, waiting=queue, free_rows=(1,), budget=193)
    assert plan_step(everything) == Plan(decode=(0,), prefill=(0, 2), start=(1,))
    # 192 tokens: the oldest prefills read, the new request waits.
    tight = view(running, prefilling=prefilling, waiting=queue, free_rows=(1,), budget=192)
    assert plan_step(tight) == Plan(decode=(0,), prefill=(0, 2))
    # 128: only the oldest prefill (order 1, row 0) has room beside the decode token.
    assert plan_step(view(running, prefilling=prefilling, budget=128)) == Plan(
        decode=(0,), prefill=(0,)
    )


def test_a_chunk_runs_when_its_pages_are_free_after_the_decode_step_s():
    running = [Running(slot=0, order=0, held_pages=10, growth_pages=4)]
    prefilling = [
        Prefilling(row=0, order=1, held_pages=5, reserved_pages=20, chunk_tokens=64, chunk_pages=8)
    ]
    assert plan_step(view(running, prefilling=prefilling, free=12)).prefill == (0,)
    assert plan_step(view(running, prefilling=prefilling, free=11)) == Plan(decode=(0,))


def test_a_request_starts_only_when_its_peak_fits_beside_the_prefills_in_flight():
    prefilling = [
        Prefilling(row=0, order=1, held_pages=5, reserved_pages=30, chunk_tokens=64, chunk_pages=8)
    ]
    ready = [Ready(order=0, row=1, held_pages=20, growth_pages=6)]  # no free slot: it waits
    queue = [Waiting(peak_pages=40, chunk_tokens=64)]
    # 30 reserved in flight + 6 for the ready one's first step + 40 = 76 <= 76 free.
    fits = view(ready=ready, prefilling=prefilling, waiting=queue, free_rows=(2,), free=76)
    assert plan_step(fits) == Plan(prefill=(0,), start=(2,))
    short = view(ready=ready, prefilling=prefilling, waiting=queue, free_rows=(2,), free=75)
    assert plan_step(short) == Plan(prefill=(0,))


def test_ready_requests_move_into_slots_oldest_first_while_their_pages_fit():
    running = [Running(slot=0, order=0, held_pages=40, growth_pages=6)]
    ready = [
        Ready(order=4, row=1, held_pages=30, growth_pages=4),  # in the pool already
        Ready(order=2, row=None, held_pages=50, growth_pages=4),  # swapped out: brings 50
    ]
    # The oldest (order 2) brings 50 pages: 6 + 4 + 50 = 60 of 64 free; then order 4 needs
    # 6 + 4 + 4 = 14 of the 14 left.
    both = view(running, ready=ready, free_slots=(2, 1), free=64)
    assert plan_step(both) == Plan(admit=((2, 2), (4, 1)), decode=(0, 1, 2))
    # One page short for the oldest: it waits, and so does the one behind it.
    assert plan_step(view(running, ready=ready, free_slots=(2, 1), free=59)) == Plan(decode=(0,))
    # No free slot: they wait.
    assert plan_step(view(running, ready=ready, free=200)) == Plan(decode=(0,))


def test_a_ready_request_larger_than_the_pool_is_refused_and_frees_its_row():
    ready = [Ready(order=3, row=0, held_pages=150, growth_pages=60)]  # 210 > the pool's 200
    queue = [Waiting(peak_pages=120, chunk_tokens=64)]
    got = plan_step(view(ready=ready, waiting=queue, free_slots=(0,), free_rows=(1,), free=50))
    assert got == Plan(refuse=(3,), start=(1,))  # its 150 pages are free again for the next


def test_the_newest_holder_gives_its_pages_back_until_the_next_step_fits():
    running = [
        Running(slot=0, order=5, held_pages=30, growth_pages=3),
        Running(slot=1, order=7, held_pages=10, growth_pages=3),  # the newest running
        Running(slot=2, order=6, held_pages=20, growth_pages=3),
    ]
    # 9 pages of growth, 8 free: swapping out slot 1 frees 10, 6 growth then fit in 18.
    assert plan_step(view(running, free=8)) == Plan(preempt=(1,), decode=(0, 2))
    assert plan_step(view(running, free=9)) == Plan(decode=(0, 1, 2))
    # A newer prefill in flight goes first (back to the queue), then a newer ready one
    # (swapped out to the host).
    prefilling = [
        Prefilling(row=3, order=9, held_pages=2, reserved_pages=9, chunk_tokens=64, chunk_pages=8)
    ]
    ready = [Ready(order=8, row=0, held_pages=2, growth_pages=1)]
    got = plan_step(view(running, ready=ready, prefilling=prefilling, free=5))
    assert got == Plan(abort=(3,), swap_out=(0,), decode=(0, 1, 2))


def test_the_only_request_running_is_never_preempted():
    running = [
        Running(slot=0, order=0, held_pages=1, growth_pages=50),
        Running(slot=3, order=1, held_pages=1, growth_pages=50),
        Running(slot=1, order=2, held_pages=1, growth_pages=50),
    ]
    # Even alone the oldest's step needs 50 pages of 10 (+2 freed): it ends too_large.
    assert plan_step(view(running, free=10)) == Plan(preempt=(1, 3), too_large=(0,))
    alone = [Running(slot=4, order=9, held_pages=5, growth_pages=3)]
    assert plan_step(view(alone, free=2)) == Plan(too_large=(4,))
    # A prefill in flight gives its pages back first, even an older one: the lone running
    # request then fits.
    prefilling = [
        Prefilling(row=0, order=1, held_pages=4, reserved_pages=9, chunk_tokens=64, chunk_pages=8)
    ]
    assert plan_step(view(alone, prefilling=prefilling, free=2)) == Plan(abort=(0,), decode=(4,))


def test_a_queued_request_whose_prefill_exceeds_the_pool_is_refused_not_waited_for():
    queue = [Waiting(peak_pages=201, chunk_tokens=64), Waiting(peak_pages=50, chunk_tokens=64)]
    got = plan_step(view(waiting=queue, free_rows=(0, 1), free=200))
    assert got == Plan(refuse_waiting=(0,), start=(0,))


def test_a_request_reading_a_cached_context_passes_one_whose_pages_do_not_fit():
    """Behind a request waiting for pages (an idle context to drop), a plain request waits and
    one reading a cached context starts: it is what keeps the contexts read."""
    queue = (Waiting(150, 64), Waiting(20, 16), Waiting(20, 16, reads_context=True))
    got = plan_step(view(waiting=queue, free_rows=(0, 1, 2), free=100))
    assert got == Plan(start=(0,), passed=(0, 1))
    fits = plan_step(view(waiting=queue, free_rows=(0, 1, 2), free=200))
    assert fits == Plan(start=(0, 1, 2))  # in order when they fit


def test_idle_contexts_are_dropped_oldest_first_only_where_that_makes_the_room():
    idle = (IdleContext(row=5, pages=30, last_used=2), IdleContext(row=6, pages=30, last_used=1))
    queue = (Waiting(peak_pages=120, chunk_tokens=64),)
    # 100 free: dropping the least recently used (row 6) makes room for the 120 pages.
    got = plan_step(dataclasses.replace(view(waiting=queue, free_rows=(0,)), idle_contexts=idle))
    assert got == Plan(drop_contexts=(6,), start=(0,))
    # 170 pages: both idle contexts' 60 would not make the room: none is dropped, it waits.
    queue = (Waiting(peak_pages=170, chunk_tokens=64),)
    got = plan_step(dataclasses.replace(view(waiting=queue, free_rows=(0,)), idle_contexts=idle))
    assert got == Plan()


def test_idle_contexts_added_to_go_first_are_dropped_before_the_least_recently_used():
    idle = (
        IdleContext(row=5, pages=30, last_used=1),
        IdleContext(row=6, pages=30, last_used=9, evict_first=True),
    )
    queue = (Waiting(peak_pages=120, chunk_tokens=64),)
    got = plan_step(dataclasses.replace(view(waiting=queue, free_rows=(0,)), idle_contexts=idle))
    assert got == Plan(drop_contexts=(6,), start=(0,))
