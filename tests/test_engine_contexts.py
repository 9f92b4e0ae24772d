"""Cached contexts in the engine: a context compressed once in the pool answers every request
on it as `jaxkv.ask` does, token for token; its pages are shared, never freed while a row reads
them, dropped (least recently used, idle) when requests need the pages; bad ids and policies
that would evict shared pages are refused before anything runs."""

import jax
import pytest

import jaxkv
from jaxkv import CacheConfig, bundled, policies, prose
from jaxkv.engine import (
    ContextEvent,
    ContextsFullError,
    Engine,
    QueueFullError,
    TokenEvent,
    UnknownContextError,
)
from jaxkv.engine.pages import Pages
from jaxkv.models import load_hf_checkpoint


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL, dtype="float32")  # exact across batches


TEXT = " ".join(prose.paragraphs()[:6])
CONTEXT = list(TEXT[:700].encode())
OTHER_CONTEXT = list(TEXT[700:1300].encode())
QUESTIONS = [list(q.encode()) for q in ("\nIn short, ", "\nThe answer is that the ", "\nSo ")]
PLAIN = list(TEXT[1300:1700].encode())
ANSWER_TOKENS = 10

# The full cache and the kinds of prefill the engine runs apart from `ask`'s: a replay that
# reads the prompt's tokens (KVzip), chunk eviction within the context's prefill (Fast KVzip),
# a write gate with a local ring (WG-KV). A scored compression (SnapKV, AdaKV, GVote) runs the
# same finishing step as KVzip's and is checked against each question alone per policy in
# tests/test_session.py.
SHARING_POLICIES = ["full", "kvzip", "fastkvzip", "wgkv"]


def build(name: str, model):
    policy = policies.get(name, **({} if name in ("full", "gvote", "wgkv") else {"budget": 0.3}))
    if policy.params is None:
        return policy, None
    return policy, policy.params.load(policy.params.shipped_path(bundled.REFERENCE), model.config)


def run(eng: Engine) -> tuple[dict[int, list[int]], list[ContextEvent], list[TokenEvent]]:
    """Steps to the end: (tokens per request, context events, last events of requests)."""
    tokens, contexts, last = {}, [], []
    while eng.has_work():
        for event in eng.step():
            if isinstance(event, ContextEvent):
                contexts.append(event)
                continue
            if event.token >= 0:
                tokens.setdefault(event.request_id, []).append(event.token)
            if event.finished:
                last.append(event)
        stats = eng.stats()
        assert stats["pages_in_use"] <= stats["num_pages"]
    return tokens, contexts, last


@pytest.mark.parametrize("name", SHARING_POLICIES)
def test_requests_on_a_cached_context_answer_as_ask(model, name):
    policy, params = build(name, model)
    asked = jaxkv.ask(
        model, CONTEXT, QUESTIONS, policy, max_new_tokens=ANSWER_TOKENS, policy_params=params
    ).answers
    eng = Engine(
        model,
        policy,
        cache=CacheConfig(num_pages=2048),
        max_slots=2,
        max_prefills=2,
        max_contexts=2,
        policy_params=params,
    )
    context = eng.add_context(CONTEXT)
    ids = [eng.submit(q, max_new_tokens=ANSWER_TOKENS, context=context) for q in QUESTIONS]
    plain = eng.submit(PLAIN, max_new_tokens=ANSWER_TOKENS)  # a prompt beside the questions
    tokens, contexts, last = run(eng)
    for i, request in enumerate(ids):
        expected = asked.tokens[i, : int(asked.num_tokens[i])].tolist()
        assert tokens[request] == expected, f"question {i}"
    alone = jaxkv.generate(
        model, [PLAIN], max_new_tokens=ANSWER_TOKENS, policy=policy, policy_params=params
    )
    assert tokens[plain] == alone.tokens[0, : int(alone.num_tokens[0])].tolist()
    (ready,) = contexts
    key = jax.random.split(jax.random.PRNGKey(0))[0]  # `ask`'s and the engine's prefill key
    session = jaxkv.prefill(model, CONTEXT, policy, policy_params=params, key=key)
    assert (ready.context_id, ready.state, ready.tokens) == (context, "ready", len(CONTEXT))
    assert ready.kv_bytes == session.memory_bytes() - session.kv.ring_bytes
    assert ready.compressed == bool(session.compressed()[0])
    stats = eng.stats()
    assert stats["contexts"] == 1 and stats["context_hits"] == len(QUESTIONS)
    assert eng.executor.kv_bytes(Pages(stats["pages_in_use"])) == ready.kv_bytes  # only it left
    # A request's bytes: the context's pages it named and its own; the full cache's for all
    # its tokens (the last one unwritten).
    by_id = {event.request_id: event for event in last}
    heads = ready.full_kv_bytes // -(-len(CONTEXT) // 16)  # bytes of a page of every head
    for request, question in zip(ids, QUESTIONS, strict=True):
        assert by_id[request].kv_bytes >= ready.kv_bytes
        written = len(CONTEXT) + len(question) + len(tokens[request]) - 1
        assert by_id[request].full_kv_bytes == heads * -(-written // 16)
    assert eng.drop_context(context)
    assert eng.stats()["pages_in_use"] == 0 and eng.stats()["contexts"] == 0
    with pytest.raises(UnknownContextError, match=f"context={context}"):
        eng.submit(QUESTIONS[0], max_new_tokens=2, context=context)


def test_the_questions_share_the_context_s_pages_while_they_run(model):
    eng = Engine(
        model, "snapkv:0.3", cache=CacheConfig(num_pages=2048), max_slots=3, max_contexts=1
    )
    context = eng.add_context(CONTEXT)
    run(eng)
    alone = eng.stats()["pages_in_use"]
    for q in QUESTIONS:
        eng.submit(q, max_new_tokens=ANSWER_TOKENS, context=context)
    peak = 0
    while eng.has_work():
        eng.step()
        peak = max(peak, eng.stats()["pages_in_use"])
    # Three rows over one copy: each holds its own pages only for its question, its answer
    # and the copies of the context's partial pages, never a second copy of the context.
    heads = model.config.num_layers * model.config.num_kv_heads
    own = -(-(max(map(len, QUESTIONS)) + ANSWER_TOKENS) // 16) + 1
    assert alone < peak <= alone + len(QUESTIONS) * heads * own
    assert eng.stats()["pages_in_use"] == alone


def test_an_idle_context_is_dropped_for_pages_requests_need_and_can_be_added_again(model):
    cache = CacheConfig(num_pages=1400)  # both contexts (984 pages) or the long prompt and one
    eng = Engine(model, cache=cache, max_slots=2, max_contexts=2)
    first = eng.add_context(CONTEXT)
    second = eng.add_context(OTHER_CONTEXT)
    answer = eng.submit(QUESTIONS[0], max_new_tokens=4, context=second)
    _, contexts, _ = run(eng)
    assert [e.state for e in contexts] == ["ready", "ready"]
    held = eng.stats()["pages_in_use"]
    assert eng.stats()["context_pages"] == held
    # A prompt that needs more pages than are free: the least recently used idle context
    # (`first`: `second` was read since) goes, not the running request.
    long_prompt = list((TEXT * 2)[:1100].encode())
    request = eng.submit(long_prompt, max_new_tokens=4)
    tokens, contexts, _ = run(eng)
    assert [(e.context_id, e.state) for e in contexts] == [(first, "evicted")]
    expected = jaxkv.generate(model, [long_prompt], max_new_tokens=4)
    assert tokens[request] == expected.tokens[0, : int(expected.num_tokens[0])].tolist()
    assert eng.stats()["contexts_evicted"] == 1 and eng.stats()["contexts"] == 1
    with pytest.raises(UnknownContextError, match="add it again"):
        eng.submit(QUESTIONS[0], max_new_tokens=2, context=first)
    again = eng.add_context(CONTEXT)
    retry = eng.submit(QUESTIONS[0], max_new_tokens=4, context=again)
    tokens, _, _ = run(eng)
    asked = jaxkv.ask(model, CONTEXT, QUESTIONS[:1], max_new_tokens=4).answers
    assert tokens[retry] == asked.tokens[0, : int(asked.num_tokens[0])].tolist()
    assert answer < request < retry


def test_a_context_read_by_a_request_is_never_dropped(model):
    eng = Engine(model, cache=CacheConfig(num_pages=2048), max_slots=1, max_contexts=1)
    context = eng.add_context(CONTEXT)
    reader = eng.submit(QUESTIONS[1], max_new_tokens=30, context=context)
    assert eng.drop_context(context)  # deleted: it takes no new request, its reader runs on
    with pytest.raises(UnknownContextError):
        eng.submit(QUESTIONS[0], max_new_tokens=2, context=context)
    with pytest.raises(ContextsFullError, match="max_contexts=1"):
        eng.add_context(OTHER_CONTEXT)  # its row is still read
    tokens, contexts, _ = run(eng)
    assert [e.state for e in contexts] == ["ready"]  # a deletion is not an event
    asked = jaxkv.ask(model, CONTEXT, QUESTIONS[1:2], max_new_tokens=30).answers
    assert tokens[reader] == asked.tokens[0, : int(asked.num_tokens[0])].tolist()
    assert eng.stats()["pages_in_use"] == 0 and eng.stats()["contexts"] == 0


def test_a_full_queue_refuses_a_new_context_before_an_idle_one_is_dropped_for_it(model):
    eng = Engine(
        model, cache=CacheConfig(num_pages=2048), max_slots=1, max_contexts=1, max_waiting=1
    )
    idle = eng.add_context(CONTEXT)
    run(eng)
    eng.submit(PLAIN, max_new_tokens=2)  # the queue's one place
    with pytest.raises(QueueFullError):
        eng.add_context(OTHER_CONTEXT)
    assert eng.contexts()[idle]["ready"]  # still held: nothing was dropped for a refused call


def test_a_context_added_to_go_first_gives_its_row_before_an_older_one(model):
    eng = Engine(model, cache=CacheConfig(num_pages=2048), max_slots=1, max_contexts=2)
    older = eng.add_context(CONTEXT)
    automatic = eng.add_context(OTHER_CONTEXT, evict_first=True)
    run(eng)
    newest = eng.add_context(PLAIN)  # no free row: an idle one is dropped for it
    assert set(eng.contexts()) == {older, newest} and automatic not in eng.contexts()


def test_bad_context_requests_are_refused_before_anything_runs(model):
    with pytest.raises(ValueError, match="max_contexts >= 1"):
        Engine(model, cache=CacheConfig(num_pages=64), max_slots=1).add_context(CONTEXT)
    with pytest.raises(ValueError, match="max_contexts=-1"):
        Engine(model, cache=CacheConfig(num_pages=64), max_slots=1, max_contexts=-1)
    h2o = Engine(model, "h2o:0.3", cache=CacheConfig(num_pages=2048), max_slots=1, max_contexts=1)
    with pytest.raises(ValueError, match="evicts during decode"):  # shared pages it would free
        h2o.submit(QUESTIONS[0], max_new_tokens=200, context=h2o.add_context(CONTEXT))
    eng = Engine(model, cache=CacheConfig(num_pages=2048), max_slots=1, max_contexts=1)
    context = eng.add_context(CONTEXT)
    with pytest.raises(UnknownContextError, match="context=7"):
        eng.submit(QUESTIONS[0], max_new_tokens=1, context=7)
    with pytest.raises(ValueError, match="give the budget to add_context"):
        eng.submit(QUESTIONS[0], max_new_tokens=1, context=context, budget=0.2)
    with pytest.raises(ValueError, match="exceeds the engine's max_context"):
        eng.submit(QUESTIONS[0], max_new_tokens=8000, context=context)
    assert not eng.drop_context(7)
    assert eng.stats()["waiting"] == 0  # the context's prefill is not a request


def test_a_context_copied_out_saved_and_loaded_serves_as_the_one_made_in_the_engine(
    model, tmp_path
):
    options = dict(cache=CacheConfig(num_pages=2048), max_slots=2, max_contexts=1)
    eng = Engine(model, "snapkv:0.3", **options)
    made = eng.add_context(CONTEXT)
    (ready,) = [e for e in eng.stream() if isinstance(e, ContextEvent)]
    session = eng.context_session(made)
    assert session.memory_bytes() == ready.kv_bytes == eng.stats()["kv_bytes_in_use"]
    asked = jaxkv.ask(model, CONTEXT, QUESTIONS, "snapkv:0.3", max_new_tokens=ANSWER_TOKENS)
    from_engine = jaxkv.ask(model, session, QUESTIONS, max_new_tokens=ANSWER_TOKENS)
    assert from_engine.answers.tokens.tolist() == asked.answers.tokens.tolist()

    path = jaxkv.save_session(session, tmp_path / "context")
    other = Engine(model, "snapkv:0.3", **options)
    loaded = other.add_session(jaxkv.load_session(path, model, "snapkv:0.3"))
    assert other.contexts()[loaded]["ready"] and other.stats()["context_pages"] > 0
    ids = [other.submit(q, max_new_tokens=ANSWER_TOKENS, context=loaded) for q in QUESTIONS]
    tokens, contexts, _ = run(other)
    assert contexts == []  # ready when added
    for i, request in enumerate(ids):
        expected = asked.answers.tokens[i, : int(asked.answers.num_tokens[i])].tolist()
        assert tokens[request] == expected, f"question {i}"
    assert other.stats()["kv_bytes_in_use"] == ready.kv_bytes  # the context alone is left

    with pytest.raises(ValueError, match="policy 'full'"):
        other.add_session(jaxkv.prefill(model, CONTEXT, "full"))
    with pytest.raises(ValueError, match="one-row session"):
        other.add_session(session.fork(QUESTIONS[:2]))
    with pytest.raises(ValueError, match="page size"):
        other.add_session(
            jaxkv.prefill(model, CONTEXT, "snapkv:0.3", cache=CacheConfig(page_size=32))
        )
    with pytest.raises(ValueError, match="not ready"):
        other.context_session(other.add_context(CONTEXT))  # dropped the loaded one (idle)


def test_a_context_that_waits_for_pages_read_by_questions_behind_it_does_not_block_them(model):
    # The pool holds one of the two contexts: `second` waits for `first` to be idle, and the
    # question on `first`, queued behind `second`, is what keeps it read: it passes.
    eng = Engine(model, cache=CacheConfig(num_pages=800), max_slots=1, max_contexts=2)
    first = eng.add_context(CONTEXT)
    run(eng)
    second = eng.add_context(OTHER_CONTEXT)
    question = eng.submit(QUESTIONS[0], max_new_tokens=4, context=first)
    tokens, contexts, _ = run(eng)
    assert [(e.context_id, e.state) for e in contexts] == [(first, "evicted"), (second, "ready")]
    asked = jaxkv.ask(model, CONTEXT, QUESTIONS[:1], max_new_tokens=4).answers
    assert tokens[question] == asked.tokens[0, : int(asked.num_tokens[0])].tolist()
