"""The engine's scheduling rules with page counts alone (`jaxkv.engine.scheduler`): no model
runs, every plan is checked whole."""

from jaxkv.engine.scheduler import Plan, Prefilled, Running, View, plan_step


def view(running=(), free_slots=(), prefilled=None, prefilling=False, waiting=0, free=100):
    return View(
        running=tuple(running),
        free_slots=tuple(free_slots),
        prefilled=prefilled,
        prefilling=prefilling,
        waiting=waiting,
        free_pages=free,
        num_pages=200,
    )


def plan(admit=None, refuse=False, preempt=(), too_large=(), decode=(), prefill=False):
    return Plan(admit, refuse, tuple(preempt), tuple(too_large), tuple(decode), prefill)


def test_an_idle_engine_plans_nothing_and_a_queue_starts_a_prefill():
    assert plan_step(view()) == plan()
    assert plan_step(view(waiting=3)) == plan(prefill=True)
    assert plan_step(view(prefilling=True)) == plan(prefill=True)


def test_a_prefilled_request_is_admitted_when_its_pages_and_every_next_step_fit():
    running = [Running(slot=0, order=0, held_pages=40, growth_pages=6)]
    prefilled = Prefilled(held_pages=50, growth_pages=4)
    # 50 held + 6 + 4 growth = 60 <= 60 free: admitted into the first free slot, both decode.
    fits = view(running, free_slots=(2, 1), prefilled=prefilled, waiting=1, free=60)
    assert plan_step(fits) == plan(admit=2, decode=(0, 2), prefill=True)
    # One page short: it waits (nobody is preempted for it), and no other prefill starts.
    short = view(running, free_slots=(1,), prefilled=prefilled, waiting=1, free=59)
    assert plan_step(short) == plan(decode=(0,))
    # No free slot: it waits too.
    assert plan_step(view(running, prefilled=prefilled, free=100)) == plan(decode=(0,))


def test_a_prefilled_request_larger_than_the_pool_is_refused():
    prefilled = Prefilled(held_pages=199, growth_pages=2)  # 201 > the pool's 200
    got = plan_step(view(free_slots=(0,), prefilled=prefilled, waiting=2, free=200))
    assert got == plan(refuse=True, prefill=True)


def test_the_newest_is_preempted_until_the_next_step_fits_and_frees_its_pages():
    running = [
        Running(slot=0, order=5, held_pages=30, growth_pages=3),
        Running(slot=1, order=7, held_pages=10, growth_pages=3),  # the newest
        Running(slot=2, order=6, held_pages=20, growth_pages=3),
    ]
    # 9 pages of growth, 8 free: preempting slot 1 frees 10, 6 growth then fit in 18.
    assert plan_step(view(running, free=8)) == plan(preempt=(1,), decode=(0, 2))
    # 2 free: slot 1 (-> 12 free, 6 needed) is enough again.
    assert plan_step(view(running, free=2)) == plan(preempt=(1,), decode=(0, 2))
    # Every step fits: nobody is preempted.
    assert plan_step(view(running, free=9)) == plan(decode=(0, 1, 2))


def test_preemption_goes_on_newest_first_and_never_takes_the_only_request():
    running = [
        Running(slot=0, order=0, held_pages=1, growth_pages=50),
        Running(slot=3, order=1, held_pages=1, growth_pages=50),
        Running(slot=1, order=2, held_pages=1, growth_pages=50),
    ]
    # Even alone the oldest's step needs 50 pages of 10 (+2 freed): it ends too_large.
    assert plan_step(view(running, free=10)) == plan(preempt=(1, 3), too_large=(0,))
    alone = [Running(slot=4, order=9, held_pages=5, growth_pages=3)]
    assert plan_step(view(alone, free=2)) == plan(too_large=(4,))


def test_an_admission_then_counts_in_the_decode_and_its_preemptions():
    running = [Running(slot=0, order=3, held_pages=10, growth_pages=2)]
    prefilled = Prefilled(held_pages=4, growth_pages=2)
    got = plan_step(view(running, free_slots=(1,), prefilled=prefilled, free=8))
    assert got == plan(admit=1, decode=(0, 1))
    # The running row's growth alone does not fit: no admission, and no preemption of the
    # only row either: it ends too_large, the prefilled request waits.
    got = plan_step(view(running, free_slots=(1,), prefilled=prefilled, free=1))
    assert got == plan(too_large=(0,))
