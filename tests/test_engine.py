"""The continuous-batching engine: requests that come and go over one pool give `generate`'s
tokens, a smaller cache admits more of them, the pool never overflows (preemption instead), and
a stream of requests compiles a bounded number of times."""

import dataclasses
import re

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig, Sampler, bundled, prose
from jaxkv.compile_log import counting_compiles
from jaxkv.engine import (
    Engine,
    QueueFullError,
    TooLargeForPoolError,
    engine,
    intake,
    ledger,
    pages_needed_alone,
    programs,
    scheduler,
)
from jaxkv.generation.mesh import Program
from jaxkv.models import load_hf_checkpoint

TEXT = " ".join(prose.paragraphs()[:8]).encode()
PROMPTS = [list(TEXT[i * 70 : i * 70 + n]) for i, n in enumerate((300, 320, 480, 250, 400))]
SAMPLED = dict(sampler=Sampler(temperature=1.0, top_p=0.9), key=jax.random.PRNGKey(5))


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL, dtype="float32")  # exact across batch shapes


def reference(model, policy, prompt, tokens, **options):
    """`generate`'s tokens for one prompt (options: sampling, policy_params, prefill_chunk)."""
    out = jaxkv.generate(model, [prompt], max_new_tokens=tokens, policy=policy, **options)
    return out.tokens[0, : out.num_tokens[0]].tolist()


def run_staggered(eng: Engine, arrivals: dict[int, list]) -> tuple[dict, dict, int]:
    """Submits arrivals[step] = [(prompt index, max_new_tokens, sampling)] at each step; runs
    to the end. (tokens per request id, request id -> prompt index, peak running)."""
    ids, tokens, step, peak = {}, {}, 0, 0
    while eng.has_work() or step <= max(arrivals):
        for index, count, sampling in arrivals.get(step, []):
            ids[eng.submit(PROMPTS[index], max_new_tokens=count, **sampling)] = index
        for event in eng.step():
            tokens.setdefault(event.request_id, []).append(event.token)
        stats = eng.stats()
        assert stats["pages_in_use"] <= stats["num_pages"]
        peak = max(peak, stats["running"])
        step += 1
    return tokens, ids, peak


@pytest.mark.parametrize("policy", ["full", "snapkv:0.3", "h2o:0.3", "chunk:0.3:chunk_length=16"])
def test_staggered_requests_give_generate_s_tokens(model, policy):
    arrivals = {
        0: [(0, 14, {}), (1, 9, {})],
        3: [(2, 12, {}), (3, 16, SAMPLED)],
        7: [(4, 11, {})],
    }
    eng = Engine(model, policy, cache=CacheConfig(num_pages=1024), max_slots=3, max_context=1024)
    tokens, ids, peak = run_staggered(eng, arrivals)
    assert peak == 3
    requests = [request for step in sorted(arrivals) for request in arrivals[step]]
    for request_id, (index, count, sampling) in zip(sorted(ids), requests, strict=True):
        expected = reference(model, policy, PROMPTS[index], count, **sampling)
        assert tokens[request_id] == expected, f"prompt {index}"
    assert eng.stats() == {
        "running": 0,
        "waiting": 0,
        "pages_in_use": 0,
        "num_pages": 1024,
        "int8_pages_in_use": 0,
        "int8_num_pages": 0,
        "ring_bytes": 0,
        "kv_bytes_in_use": 0,
        "preemptions": 0,
        "contexts": 0,
        "context_pages": 0,
        "context_int8_pages": 0,
        "context_hits": 0,
        "contexts_evicted": 0,
    }


@pytest.mark.parametrize(
    "policy", ["full", "snapkv:0.3", "h2o:0.3", "kvzip:0.3", "chunkkv:0.3:chunk_length=8"]
)
def test_the_plan_at_submit_bounds_the_pages_a_request_holds(model, policy):
    """`pages_needed_alone` is what `submit` refuses by: a request never holds more (the full
    cache holds exactly that), whether its policy compresses the prompt, evicts during decode
    or splits its budget across heads (KVzip) or keeps whole chunks (ChunkKV)."""
    eng = Engine(model, policy, cache=CacheConfig(num_pages=1024), max_slots=3, max_context=1024)
    planned = pages_needed_alone(eng.policy, model.config, len(PROMPTS[2]), 40, 16).model
    eng.submit(PROMPTS[2], max_new_tokens=40, stop_tokens=())
    peak = 0
    while eng.has_work():
        eng.step()
        peak = max(peak, eng.stats()["pages_in_use"])
    assert 0 < peak <= planned
    if policy == "full":
        assert peak == planned == 12 * -(-(480 + 39) // 16)


def test_a_smaller_cache_admits_more_requests_into_the_same_pool(model):
    # 12 heads x ~25 pages: the pool holds two full-cache requests at once.
    arrivals = {0: [(i % 5, 30, {}) for i in range(6)]}
    peaks = {}
    for policy in ("full", "snapkv:0.3"):
        eng = Engine(model, policy, cache=CacheConfig(num_pages=640), max_slots=6, max_context=1024)
        tokens, _, peaks[policy] = run_staggered(eng, arrivals)
        assert sorted(map(len, tokens.values())) == [30] * 6
    assert peaks["snapkv:0.3"] >= 2 * peaks["full"]


@pytest.mark.parametrize("policy", ["full", "snapkv:0.5"])
def test_a_full_pool_preempts_and_every_request_still_completes_exactly(model, policy):
    """Requests admitted with room for their next page only; as they grow the pool runs dry, the
    newest is swapped out to the host (its pages freed) and comes back whole: tokens equal
    `generate`'s, a compressed prompt's too (it is not compressed again)."""
    short = [prompt[:40] for prompt in PROMPTS]
    eng = Engine(model, policy, cache=CacheConfig(num_pages=300), max_slots=3, max_context=1024)
    ids = {eng.submit(short[index], max_new_tokens=120): index for index in range(3)}
    tokens = eng.run()
    assert eng.preemptions > 0
    for request, index in ids.items():
        assert tokens[request] == reference(model, policy, short[index], 120)


def test_several_prompts_are_read_in_one_step_in_generate_s_chunks(model, monkeypatch):
    """Four requests' prompts are read side by side, a chunk of each per step in one program
    (kvzip's compression then reads each prompt again): tokens equal `generate`'s with the
    same chunk."""
    calls = []
    prefill_rows = programs.prefill_rows

    def recorded(placement, **arguments):
        calls.append(arguments["tokens"].shape)
        return prefill_rows(placement, **arguments)

    monkeypatch.setattr(programs, "prefill_rows", recorded)
    eng = Engine(
        model,
        "kvzip:0.3",
        cache=CacheConfig(num_pages=1200),  # every prompt whole at once (1044 pages)
        max_slots=2,
        max_context=1024,
        prefill_chunk=128,
    )
    ids = {eng.submit(PROMPTS[index], max_new_tokens=6): index for index in range(4)}
    tokens = eng.run()
    # 300, 320, 480 and 250 tokens: 3, 3, 4 and 2 chunks of 128, the first three steps read all
    # four, then the 480-token prompt's last chunk alone (its tail of 96 tokens in a 128).
    assert calls == [(4, 128)] * 3 + [(1, 128)]
    for request, index in ids.items():
        expected = reference(model, "kvzip:0.3", PROMPTS[index], 6, prefill_chunk=128)
        assert tokens[request] == expected


def test_a_prefill_given_up_restarts_and_a_swapped_out_ready_request_comes_back_whole(
    model, monkeypatch
):
    """The two ways the scheduler takes pages back from a request that is not running, forced
    once each: a prefill in flight goes back to the queue (read again from its start), a ready
    request waiting for the one slot is swapped out to the host (and back). Tokens equal
    `generate`'s."""
    forced = []

    def plan_with_forced(view):
        plan = scheduler.plan_step(view)
        admitted = {order for order, _ in plan.admit}
        waiting_ready = [r.row for r in view.ready if r.row is not None and r.order not in admitted]
        started = [p.row for p in view.prefilling if p.held_pages.total > 0]
        if "swap_out" not in forced and waiting_ready:
            forced.append("swap_out")
            return dataclasses.replace(plan, swap_out=(waiting_ready[0],))
        if "abort" not in forced and started:
            forced.append("abort")
            reading = tuple(row for row in plan.prefill if row != started[0])
            return dataclasses.replace(plan, abort=(started[0],), prefill=reading)
        return plan

    monkeypatch.setattr(ledger, "plan_step", plan_with_forced)
    eng = Engine(
        model,
        "snapkv:0.3",
        cache=CacheConfig(num_pages=1024),
        max_slots=1,
        max_context=1024,
        prefill_chunk=64,
    )
    ids = {eng.submit(PROMPTS[index], max_new_tokens=8): index for index in (3, 0, 1)}
    tokens = eng.run()
    assert forced == ["abort", "swap_out"] and eng.preemptions == 1
    assert eng.stats()["pages_in_use"] == 0
    for request, index in ids.items():
        expected = reference(model, "snapkv:0.3", PROMPTS[index], 8, prefill_chunk=64)
        assert tokens[request] == expected


def test_the_only_running_request_is_never_preempted(model, monkeypatch):
    """A request alone that needs a page the pool does not have ends with reason too_large (as
    one whose plan at submit came out too small would): preempting it would free nothing for
    its return."""
    monkeypatch.setattr(intake, "pages_needed_alone", lambda *args: 0)  # its plan: fits
    # 12 heads x 25 pages: 400 tokens a head, the prompt's 200 and 200 more.
    eng = Engine(model, "full", cache=CacheConfig(num_pages=300), max_slots=3, max_context=1024)
    request = eng.submit(PROMPTS[0][:200], max_new_tokens=500, stop_tokens=())
    events = []
    for _ in range(500):  # the request's steps, bounded
        events += eng.step()
        if not eng.has_work():
            break
    assert not eng.has_work() and eng.preemptions == 0
    expected = reference(model, "full", PROMPTS[0][:200], 201, stop_tokens=())
    assert [event.token for event in events[:-1]] == expected
    assert events[-1] == engine.TokenEvent(request, -1, True, "too_large")
    assert eng.stats()["pages_in_use"] == 0


def test_cancelling_returns_the_pages_at_once(model):
    eng = Engine(model, "full", cache=CacheConfig(num_pages=512), max_slots=1, max_context=1024)
    first = eng.submit(PROMPTS[0], max_new_tokens=50)
    while eng.stats()["running"] == 0:
        eng.step()
    alone = eng.stats()["pages_in_use"]
    assert alone > 0
    waiting = eng.submit(PROMPTS[1], max_new_tokens=5)
    eng.step()  # the second one is prefilled beside the first one's decode; no slot for it
    both = eng.stats()["pages_in_use"]
    assert eng.cancel(first)
    # What is left is the second one's prompt, in its prefill row of the same pool.
    assert 0 < eng.stats()["pages_in_use"] <= both - alone
    assert not eng.cancel(first)
    assert eng.cancel(waiting) and not eng.has_work()
    assert eng.stats()["pages_in_use"] == 0
    third = eng.submit(PROMPTS[3], max_new_tokens=3)
    tokens = eng.run()
    assert list(tokens) == [third] and len(tokens[third]) == 3


def test_a_stream_of_requests_compiles_a_bounded_number_of_times(model):
    eng = Engine(
        model, "snapkv:0.3", cache=CacheConfig(num_pages=1024), max_slots=3, max_context=1024
    )
    run_staggered(eng, {0: [(0, 4, {})]})  # compiled once
    once = (
        programs.decode_slots.jitted,
        programs.row_pages.jitted,
        programs.insert_rows.jitted,
        programs.release.jitted,
        programs.first_token,
        programs.move.jitted,
        programs.finish_row.jitted,
    )
    prefill = programs.prefill_rows.jitted
    before = [program._cache_size() for program in (*once, prefill)]
    rng = np.random.default_rng(0)
    sampled = {"sampler": Sampler(temperature=0.7, top_k=5), "key": jax.random.PRNGKey(1)}
    arrivals = {
        step: [(int(rng.integers(5)), int(rng.integers(2, 9)), sampled if step % 4 else {})]
        for step in range(0, 24, 2)
    }
    run_staggered(eng, arrivals)
    after = [program._cache_size() for program in (*once, prefill)]
    compiled = [a - b for a, b in zip(after, before, strict=True)]
    assert compiled[:-1] == [0] * len(once)  # sampler settings are row values too
    # A prefill chunk per bucket of rows read at once (1, 2, 4) and of chunk tokens (prompts of
    # 250 to 480 tokens are read whole, in chunks of 256 or 512): the first one's was compiled.
    assert compiled[-1] <= 3 * 2 - 1


def test_a_warmed_up_engine_compiles_nothing_while_requests_arrive(model):
    eng = Engine(
        model, "snapkv:0.3", cache=CacheConfig(num_pages=1024), max_slots=3, max_context=1024
    )
    with pytest.raises(ValueError, match="prompt_lengths holds 1024"):
        eng.warm_up(prompt_lengths=[1024])
    assert eng.warm_up(prompt_lengths=[250, 480]) > 0  # chunk buckets 256 and 512
    assert not eng.has_work() and eng.stats()["pages_in_use"] == 0
    jitted = [p.jitted for p in vars(programs).values() if isinstance(p, Program)]
    before = [p._cache_size() for p in (*jitted, programs.first_token)]
    arrivals = {0: [(3, 6, {})], 1: [(0, 5, {})], 3: [(2, 4, {}), (4, 7, {})], 4: [(1, 3, {})]}
    with counting_compiles() as compiled:  # one, two and three prompts read at once
        tokens, ids, _ = run_staggered(eng, arrivals)
    assert compiled.seconds == 0.0
    assert [p._cache_size() for p in (*jitted, programs.first_token)] == before
    counts = {index: count for step in arrivals.values() for index, count, _ in step}
    for rid, index in ids.items():
        assert tokens[rid] == reference(model, "snapkv:0.3", PROMPTS[index], counts[index])
    eng.submit(PROMPTS[0], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="warm_up needs an idle engine"):
        eng.warm_up()
    # A prompt the pool can never hold ends the warm-up with submit's error, the engine idle.
    small = Engine(model, "snapkv:0.3", cache=CacheConfig(num_pages=200), max_slots=2)
    with pytest.raises(TooLargeForPoolError, match="num_pages=200 hold"):
        small.warm_up(prompt_lengths=[16, 480])
    assert not small.has_work() and small.stats()["pages_in_use"] == 0


def test_bad_requests_are_refused_at_submit_and_the_engine_keeps_serving(model):
    with pytest.raises(ValueError, match="num_pages set"):
        Engine(model, cache=CacheConfig(), max_slots=2)
    with pytest.raises(ValueError, match="max_context=9000 exceeds"):
        Engine(model, cache=CacheConfig(num_pages=64), max_slots=2, max_context=9000)
    tiny_budget = Engine(model, "snapkv:8", cache=CacheConfig(num_pages=200), max_slots=2)
    with pytest.raises(ValueError, match="budget of 8 tokens is smaller"):
        tiny_budget.submit(PROMPTS[0], max_new_tokens=2)  # the policy's own checks
    eng = Engine(model, "snapkv:0.3", cache=CacheConfig(num_pages=200), max_slots=2, max_waiting=2)
    with pytest.raises(ValueError, match="exceeds the engine's max_context=8192"):
        eng.submit([1] * 8190, max_new_tokens=8)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be >= 1"):
        eng.submit(PROMPTS[0], max_new_tokens=0)
    with pytest.raises(ValueError, match="PRNG key is required"):
        eng.submit(PROMPTS[0][:250], max_new_tokens=2, sampler=Sampler(temperature=1.0))
    fits = eng.submit(PROMPTS[0][:250], max_new_tokens=2)
    also_fits = eng.submit(PROMPTS[1][:250], max_new_tokens=2)
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        eng.submit(PROMPTS[0][:250], max_new_tokens=2)
    events = list(eng.stream())
    for request in (fits, also_fits):
        assert [e.finished for e in events if e.request_id == request] == [False, True]


def test_a_request_the_pool_could_never_hold_is_refused_before_it_runs(model):
    """The plan at submit (`pages_needed_alone`) against the pool: the error names the pages and
    what to shrink, the prompt, or max_new_tokens when a smaller one fits (the largest is said,
    and it fits); nothing is queued."""
    eng = Engine(model, "snapkv:0.3", cache=CacheConfig(num_pages=200), max_slots=2)
    # 480 tokens: 12 heads hold 31 pages each while the prompt is read, before it is compressed.
    with pytest.raises(TooLargeForPoolError, match="num_pages=200 hold: give a shorter prompt"):
        eng.submit(PROMPTS[2], max_new_tokens=2)
    with pytest.raises(TooLargeForPoolError, match="num_pages=200 hold: give max_new_tokens <= "):
        eng.submit(PROMPTS[0][:250], max_new_tokens=200)
    with pytest.raises(TooLargeForPoolError) as refused:
        eng.submit(PROMPTS[0][:250], max_new_tokens=200)
    error = refused.value
    assert (error.field, error.num_pages) == ("max_new_tokens", 200) and error.pages_needed > 200
    largest = int(re.search(r"max_new_tokens <= (\d+)", str(error)).group(1))
    with pytest.raises(TooLargeForPoolError):
        eng.submit(PROMPTS[0][:250], max_new_tokens=largest + 1)
    assert not eng.has_work()
    eng.submit(PROMPTS[0][:250], max_new_tokens=largest)
    assert eng.has_work()


def test_a_local_ring_is_counted_beside_the_pages(model_f32):
    """WG-KV's ring lives beside the pool, one per slot: the stats say its bytes and count them
    in the KV bytes held."""
    policy = jaxkv.policies.get("wgkv")
    params = policy.params.load(policy.params.shipped_path(bundled.REFERENCE), model_f32.config)
    eng = Engine(
        model_f32, policy, cache=CacheConfig(num_pages=64), max_slots=2, policy_params=params
    )
    stats = eng.stats()
    assert stats["ring_bytes"] == eng.executor.kv.ring.nbytes > 0
    assert stats["kv_bytes_in_use"] == stats["ring_bytes"] and stats["pages_in_use"] == 0


@pytest.fixture(scope="module")
def model_f32():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL, dtype="float32")


@pytest.mark.parametrize("name", ["wgkv", "fastkvzip", "expected_attention_stats"])
def test_learned_policies_with_a_ring_or_chunk_eviction_give_generate_s_tokens(model_f32, name):
    """WG-KV's local ring moves with its row; Fast KVzip evicts between its prefill chunks;
    ExpectedAttentionStats' compression reads its parameters. In float32: Fast KVzip's 4th
    token of PROMPTS[1] is a near tie (top two logits 0.048 apart), which bf16 rounding in the
    engine's batch geometry and in `generate`'s resolves apart."""
    model = model_f32
    policy = jaxkv.policies.get(name) if name == "wgkv" else jaxkv.policies.get(name, budget=0.3)
    params = policy.params.load(policy.params.shipped_path(bundled.REFERENCE), model.config)
    eng = Engine(
        model,
        policy,
        cache=CacheConfig(num_pages=1024),
        max_slots=2,
        max_context=1024,
        policy_params=params,
    )
    ids = {eng.submit(PROMPTS[i], max_new_tokens=10): i for i in (0, 1, 2)}
    tokens = eng.run()
    for request, index in ids.items():
        expected = reference(model, policy, PROMPTS[index], 10, policy_params=params)
        assert tokens[request] == expected


def test_a_request_s_own_budget_and_the_bytes_it_ends_with(model):
    """A request's own budget of the engine's policy gives `generate`'s tokens at that budget
    (no new program); its last event reports the bytes it held after its last step, as
    `generate` does, and the full cache's for its tokens."""
    eng = Engine(model, "h2o:0.5", cache=CacheConfig(num_pages=1024), max_slots=2, max_context=1024)
    with pytest.raises(ValueError, match="budget=True"):
        eng.submit(PROMPTS[0], max_new_tokens=4, budget=True)
    with pytest.raises(ValueError, match="policy 'full' takes no budget"):
        Engine(model, "full", cache=CacheConfig(num_pages=64), max_slots=1).submit(
            PROMPTS[0], max_new_tokens=4, budget=0.5
        )
    asks = {eng.submit(PROMPTS[0], max_new_tokens=40, budget=0.2): 0.2}
    asks[eng.submit(PROMPTS[1], max_new_tokens=40)] = 0.5
    events = list(eng.stream())
    for request, ratio in asks.items():
        index = 0 if ratio == 0.2 else 1
        out = jaxkv.generate(model, [PROMPTS[index]], max_new_tokens=40, policy=f"h2o:{ratio}")
        mine = [e for e in events if e.request_id == request]
        assert [e.token for e in mine] == out.tokens[0, : out.num_tokens[0]].tolist()
        assert all(e.kv_bytes is None for e in mine[:-1])
        assert mine[-1].kv_bytes == int(out.memory_bytes[-1])
        full = jaxkv.generate(model, [PROMPTS[index]], max_new_tokens=40, policy="full")
        assert mine[-1].full_kv_bytes == int(full.memory_bytes[-1]) > mine[-1].kv_bytes
