"""The engine with int8 storage (Conf-KV's tier, `CacheConfig(storage="int8")`): each request's
tokens but each head's newest window move to an int8 pool beside the model-dtype one once its
prompt is compressed, as `generate` stores them; requests give `generate`'s tokens, questions on
a cached context `ask`'s, preempted ones come back whole, and both pools are planned for."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import CacheConfig, bundled, prose
from jaxkv.cache import KVState, write_tokens
from jaxkv.cache.int8 import create_tier, start_held
from jaxkv.cache.rows import attach_row, own_pages, put_rows, release_rows, take_rows
from jaxkv.engine import Engine, TooLargeForPoolError
from jaxkv.engine.pages import Pages
from jaxkv.engine.scheduler import Running, View, Waiting, plan_step
from jaxkv.models import load_hf_checkpoint

WINDOW = 32
TEXT = " ".join(prose.paragraphs()[:8]).encode()
PROMPTS = [list(TEXT[i * 70 : i * 70 + n]) for i, n in enumerate((200, 150, 260))]
CONTEXT = list(TEXT[:400])
QUESTIONS = [list(q.encode()) for q in ("\nIn short, ", "\nThe answer is that the ")]


def int8(**more) -> CacheConfig:
    return CacheConfig(storage="int8", full_precision_window=WINDOW, **more)


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL, dtype="float32")  # exact across batches


def generated(model, policy, prompt, count) -> list[int]:
    out = jaxkv.generate(model, [prompt], max_new_tokens=count, policy=policy, cache=int8())
    return out.tokens[0, : out.num_tokens[0]].tolist()


@pytest.mark.parametrize("policy", ["full", "snapkv:0.5", "h2o:0.5", "kvzip:0.5"])
def test_staggered_int8_requests_give_generate_s_tokens(model, policy):
    eng = Engine(
        model, policy, cache=int8(num_pages=512), max_slots=2, max_context=512, prefill_chunk=128
    )
    ids = {eng.submit(PROMPTS[0], max_new_tokens=20): 0}
    tokens, step = {}, 0
    while eng.has_work():
        if step == 3:
            ids.update({eng.submit(PROMPTS[i], max_new_tokens=12): i for i in (1, 2)})
        for event in eng.step():
            tokens.setdefault(event.request_id, []).append(event.token)
        stats = eng.stats()
        assert stats["int8_pages_in_use"] <= stats["int8_num_pages"] == 512
        step += 1
    for request, index in ids.items():
        count = 20 if index == 0 else 12
        assert tokens[request] == generated(model, policy, PROMPTS[index], count), index
    stats = eng.stats()
    assert stats["pages_in_use"] == stats["int8_pages_in_use"] == 0


def test_an_int8_request_holds_its_window_in_the_kv_dtype_and_the_rest_in_int8(model):
    eng = Engine(model, "full", cache=int8(num_pages=512), max_slots=1, max_context=512)
    eng.submit(PROMPTS[0], max_new_tokens=40, stop_tokens=())
    generated = 0
    while eng.stats()["running"] == 0:
        generated += len(eng.step())
    kv = take_rows(eng.executor.kv, jnp.array([0]))
    full = np.asarray(kv.full_precision_lengths())
    assert np.all(full <= WINDOW) and np.all(full > 0)
    written = len(PROMPTS[0]) + generated - 1  # the last token sampled is not written yet
    assert np.all(np.asarray(kv.lengths) == written)  # both tiers
    np.testing.assert_array_equal(np.asarray(kv.pool.int8.lengths), written - full)
    model_pages, int8_pages = eng.stats()["pages_in_use"], eng.stats()["int8_pages_in_use"]
    heads = model.config.num_layers * model.config.num_kv_heads
    assert model_pages <= heads * -(-WINDOW // 16) and int8_pages >= heads * 10
    eng.run()


def test_a_full_int8_pool_preempts_and_every_request_still_completes_exactly(model):
    """The int8 pool is what runs dry here: the newest request is swapped out with both its
    tiers and comes back whole."""
    short = [prompt[:40] for prompt in PROMPTS]  # 1 int8 page a head after the prompt, 7 at the end
    eng = Engine(
        model, "full", cache=int8(num_pages=512, int8_pages=120), max_slots=3, max_context=512
    )
    ids = {eng.submit(short[i], max_new_tokens=100, stop_tokens=()): i for i in range(3)}
    tokens = eng.run()
    assert eng.preemptions > 0
    for request, index in ids.items():
        out = jaxkv.generate(
            model, [short[index]], max_new_tokens=100, cache=int8(), stop_tokens=()
        )
        assert tokens[request] == out.tokens[0].tolist()
    assert eng.stats()["int8_pages_in_use"] == 0


@pytest.mark.parametrize("policy", ["full", "kvzip:0.5"])
def test_questions_on_an_int8_context_answer_as_ask_and_it_holds_fewer_bytes(model, policy):
    asked = jaxkv.ask(model, CONTEXT, QUESTIONS, policy, max_new_tokens=8, cache=int8()).answers
    ready_bytes = {}
    for cache in (int8(num_pages=1024), CacheConfig(num_pages=1024)):
        eng = Engine(model, policy, cache=cache, max_slots=2, max_contexts=1, max_context=512)
        context = eng.add_context(CONTEXT)
        ids = [eng.submit(q, max_new_tokens=8, context=context) for q in QUESTIONS]
        tokens, events = {}, []
        while eng.has_work():
            for event in eng.step():
                if isinstance(event, jaxkv.engine.ContextEvent):
                    events.append(event)
                elif event.token >= 0:
                    tokens.setdefault(event.request_id, []).append(event.token)
        ready_bytes[cache.storage.value] = events[0].kv_bytes
        if cache.storage.value == "int8":
            for i, request in enumerate(ids):
                assert tokens[request] == asked.tokens[i, : int(asked.num_tokens[i])].tolist()
            session = eng.context_session(context)  # copied out with its int8 tier
            assert session.kv.pool.int8 is not None
            again = jaxkv.ask(model, session, QUESTIONS, max_new_tokens=8).answers
            np.testing.assert_array_equal(again.tokens, asked.tokens)
            assert eng.add_session(session) != context
    assert ready_bytes["int8"] < 0.7 * ready_bytes["model"]


def test_int8_storage_is_refused_for_policies_it_cannot_run_before_anything_compiles(model):
    with pytest.raises(ValueError, match="selects pages, which int8 storage does not do"):
        Engine(model, "quest:64", cache=int8(num_pages=64), max_slots=1)
    with pytest.raises(ValueError, match="keeps a local ring, which int8 storage"):
        Engine(model, "local_attention", cache=int8(num_pages=64), max_slots=1)
    with pytest.raises(ValueError, match="int8_pages sizes an int8 tier"):
        CacheConfig(num_pages=64, int8_pages=8)
    eng = Engine(model, "full", cache=int8(num_pages=512, int8_pages=16), max_slots=1)
    with pytest.raises(TooLargeForPoolError, match=r"int8 pages .* int8_pages=16"):
        eng.submit(PROMPTS[0], max_new_tokens=4)


def test_the_scheduler_waits_for_the_int8_pool_too():
    """Page counts of two pools: an amount fits when each count does."""
    running = (Running(slot=0, order=0, held_pages=Pages(10, 40), growth_pages=Pages(2, 2)),)

    def view(free: Pages) -> View:
        return View(
            running=running,
            ready=(),
            prefilling=(),
            waiting=(Waiting(peak_pages=Pages(30, 20), chunk_tokens=64),),
            free_slots=(),
            free_rows=(1,),
            free_pages=free,
            num_pages=Pages(200, 100),
            max_batched_tokens=1000,
        )

    assert plan_step(view(Pages(100, 22))).start == (1,)
    assert plan_step(view(Pages(100, 21))).start == ()  # the int8 pool is short by one
    assert plan_step(view(Pages(31, 100))).start == ()  # the model-dtype pool is
    with pytest.raises(TypeError, match="page counts add to Pages or 0"):
        Pages(1, 1) + 1


def test_an_attached_int8_row_copies_the_window_shares_the_int8_pages_and_releases_once():
    layers, rows, heads, dim, page = 2, 3, 2, 4, 4
    kv = KVState.create(
        num_layers=layers,
        batch=rows,
        num_kv_heads=heads,
        head_dim=dim,
        max_tokens=64,
        page_size=page,
        num_pages=64,
        dtype=jnp.float32,
    )
    kv = kv.replace(pool=kv.pool.replace(int8=create_tier(kv, 6, 64, kv.page_table.shape[-1])))
    rng = np.random.default_rng(0)
    pool, tables, lengths = kv.pool, kv.page_table, kv.lengths
    for layer in range(layers):  # 19 tokens in each head of row 0
        mask = np.zeros((rows, heads, 19), bool)
        mask[0] = True
        k, v = (jnp.asarray(rng.normal(size=(rows, heads, 19, dim)), jnp.float32) for _ in "kv")
        positions = jnp.broadcast_to(jnp.arange(19), (rows, 19))
        pool, table, length = write_tokens(
            pool, tables[layer], lengths[layer], k, v, positions, jnp.asarray(mask)
        )
        tables, lengths = tables.at[layer].set(table), lengths.at[layer].set(length)
    kv = kv.replace(pool=pool, page_table=tables, lengths=lengths)
    started = start_held(take_rows(kv, jnp.array([0])))  # 13 tokens a head to int8, 6 stay

    kv = put_rows(kv, jnp.array([0]), started)
    assert np.all(np.asarray(kv.pool.int8.lengths[:, 0]) == 13)
    assert np.all(np.asarray(kv.full_precision_lengths()[:, 0]) == 6)
    before = (int(kv.pages_in_use()), int(kv.pool.int8.pages_in_use()))
    attached = attach_row(kv, jnp.int32(0), jnp.int32(1))
    attached.check()
    # Each head copies its window's 2 pages and its int8 tier's partial last page (13 = 3 full
    # pages shared + 1 partial).
    assert int(attached.pages_in_use()) == before[0] + layers * heads * 2
    assert int(attached.pool.int8.pages_in_use()) == before[1] + layers * heads
    np.testing.assert_array_equal(
        np.asarray(attached.positions())[:, 1], np.asarray(attached.positions())[:, 0]
    )
    tier_table = np.asarray(attached.pool.int8.page_table)
    np.testing.assert_array_equal(tier_table[:, 1, :, :3], tier_table[:, 0, :, :3])
    np.testing.assert_array_equal(
        np.asarray(attached.pool.int8.k_channel_scales[:, 1]),
        np.asarray(attached.pool.int8.k_channel_scales[:, 0]),
    )
    own = np.asarray(own_pages(attached))  # [pools, rows]
    assert own.shape == (2, rows) and own[1, 1] == layers * heads
    released = release_rows(attached, jnp.array([True, True, False]))
    assert int(released.pages_in_use()) == int(released.pool.int8.pages_in_use()) == 0
    free = np.sort(np.asarray(released.pool.int8.pool.allocator.free_stack))
    np.testing.assert_array_equal(free, np.arange(64))  # each int8 page freed once
