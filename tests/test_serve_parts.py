"""The server's parts without a model or an HTTP server: cached contexts against an engine
worker stand-in whose events may come before the handler resumes, and saved when one cannot
be; the end of a token stream, the worker's failure, the request fields' ranges, a contexts
folder on a mesh."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import types

import pydantic
import pytest

from jaxkv import bundled, policies
from jaxkv.engine import ContextEvent, TokenEvent
from jaxkv.generation.decoding import SharedDecodeError, check_shared_decode
from jaxkv.models import load_tokenizer
from jaxkv.serve import RequestDefaults, create_app
from jaxkv.serve import contexts as serve_contexts
from jaxkv.serve.app import Server
from jaxkv.serve.contexts import Contexts
from jaxkv.serve.protocol import APIError, ChatRequest, CompletionRequest
from jaxkv.serve.responses import Ending, StopText, token_deltas
from jaxkv.serve.worker import EngineStoppedError, EngineWorker


class InstantWorker:
    """`EngineWorker.add_context` / `drop_context` answered at once; `add_context` tells the
    context's `events` (by its id) before its future resolves, as an engine thread may while
    the event loop is busy."""

    def __init__(self, *events: str):
        self.events, self.failure, self.dropped, self.next_id = events, None, [], 7
        self.evict_first = []  # each context's, as added

    def add_context(self, on_event, ids, budget=None, evict_first=False):
        self.evict_first.append(evict_first)
        engine_id, self.next_id = self.next_id, self.next_id + 1
        for state in self.events:
            on_event(ContextEvent(engine_id, state, len(ids), kv_bytes=10, full_kv_bytes=20))
        return _resolved(engine_id)

    def drop_context(self, engine_id):
        self.dropped.append(engine_id)
        return _resolved(True)


def _resolved(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def contexts_over(worker) -> Contexts:
    contexts = Contexts(load_tokenizer(bundled.REFERENCE_MODEL), max_contexts=2, auto_min_tokens=1)
    contexts.worker = worker
    return contexts


def test_a_context_s_ready_event_that_comes_before_its_id_is_not_lost():
    async def scenario():
        contexts = contexts_over(InstantWorker("ready"))
        context = await contexts.create([1, 2, 3], None, None)
        event = await asyncio.wait_for(context.ready, 5)
        return contexts, context, event

    contexts, context, event = asyncio.run(scenario())
    assert event.state == "ready" and context.engine_id == 7
    assert [card["id"] for card in contexts.listed()] == [context.id]
    assert contexts.listed()[0]["kv_bytes"] == 10


def test_a_context_refused_before_its_id_comes_is_not_listed_and_its_creator_told():
    async def scenario():
        contexts = contexts_over(InstantWorker("too_large"))
        context = await contexts.create([1, 2, 3], None, None)
        with pytest.raises(APIError) as refused:
            await asyncio.wait_for(context.ready, 5)
        return contexts, refused.value

    contexts, error = asyncio.run(scenario())
    assert error.status == 400 and error.code == "context_length_exceeded"
    assert contexts.listed() == []


def test_a_context_deleted_while_being_made_answers_its_creator_404():
    async def scenario():
        worker = InstantWorker()  # no event: the context is still being made
        contexts = contexts_over(worker)
        context = await contexts.create([1, 2, 3], None, None)
        waiting = asyncio.ensure_future(asyncio.wait_for(context.ready, 5))
        await contexts.delete(context.id)
        with pytest.raises(APIError) as deleted:
            await waiting
        return worker, deleted.value

    worker, error = asyncio.run(scenario())
    assert error.status == 404 and error.code == "context_not_found" and worker.dropped == [7]


def test_an_automatic_context_whose_maker_is_cancelled_tells_the_requests_waiting_on_it():
    class SlowWorker(InstantWorker):
        def add_context(self, on_event, ids, budget=None, evict_first=False):
            return concurrent.futures.Future()  # never answered

    async def scenario():
        contexts = contexts_over(SlowWorker())
        maker = asyncio.ensure_future(contexts.automatic([1, 2], [], None))
        await asyncio.sleep(0)
        follower = asyncio.ensure_future(contexts.automatic([1, 2], [], None))
        await asyncio.sleep(0)
        maker.cancel()
        with pytest.raises(APIError) as told:
            await asyncio.wait_for(follower, 5)
        return contexts, told.value

    contexts, error = asyncio.run(scenario())
    assert error.status == 503 and "ask again" in error.message
    assert contexts._automatic == {}  # the next chat with that prefix makes it anew


def test_automatic_contexts_go_first_and_forgetting_an_old_one_keeps_the_newer():
    worker = InstantWorker("ready")

    async def scenario():
        contexts = contexts_over(worker)
        await contexts.create([3], None, None)  # a client's: dropped after the automatic ones
        old = await contexts.automatic([1, 2], [], None)
        contexts.forget(old)
        new = await contexts.automatic([1, 2], [], None)
        contexts.forget(old)  # a second request that read the old one, told 404, forgets it
        return new, await contexts.automatic([1, 2], [], None)

    new, again = asyncio.run(scenario())
    assert again is new
    assert worker.evict_first == [False, True, True]


def test_a_stop_string_the_last_allowed_token_completes_finishes_with_stop():
    tokenizer = load_tokenizer(bundled.REFERENCE_MODEL)
    a, b = tokenizer.encode("ab", add_bos=False)

    async def scenario(stop):
        events: asyncio.Queue = asyncio.Queue()
        events.put_nowait(TokenEvent(0, a, False, None))
        events.put_nowait(TokenEvent(0, b, True, "length"))
        ending = Ending(None, "prompt", "max_tokens")
        return [
            (delta, reason)
            async for delta, reason, _ in token_deltas(
                None, 0, events, StopText(tokenizer, stop), ending
            )
        ]

    assert asyncio.run(scenario("ab")) == [("", None), ("", "stop")]
    assert asyncio.run(scenario("x")) == [("a", None), ("b", "length")]


def test_a_failing_engine_thread_tells_every_queued_command_with_a_future():
    worker = EngineWorker.__new__(EngineWorker)  # its state alone, no thread
    worker._failing, worker._commands = threading.Lock(), queue.Queue()
    worker._listeners, worker._context_listeners = {}, {}
    submitted = concurrent.futures.Future()
    for command in [("stop",), ("cancel", 3), ("submit", submitted, None, (), {})]:
        worker._commands.put(command)
    worker._fail("boom")
    with pytest.raises(EngineStoppedError, match="boom"):
        submitted.result(timeout=1)


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_beyond_a_64_bit_key_is_refused_by_name(seed):
    with pytest.raises(pydantic.ValidationError, match="seed"):
        CompletionRequest(prompt="x", seed=seed)
    assert CompletionRequest(prompt="x", seed=2**63 - 1).seed == 2**63 - 1


def test_contexts_that_cannot_be_saved_cost_themselves_not_the_others(tmp_path, monkeypatch):
    class Engine:
        def context_session(self, engine_id):
            if engine_id == 7:
                raise ValueError("evicted in the last step")
            return engine_id

    def save_session(session, path):
        path.mkdir(parents=True)
        (path / "session.txt").write_text(str(session))

    monkeypatch.setattr(serve_contexts, "save_session", save_session)
    (tmp_path / "ctx-old").mkdir()  # a context the server no longer holds

    async def scenario():
        contexts = contexts_over(InstantWorker("ready"))
        lost, kept = [await contexts.create([1, 2, n], None, None) for n in (3, 4)]
        await asyncio.gather(lost.ready, kept.ready)
        contexts.save_all(Engine(), tmp_path)
        return kept

    kept = asyncio.run(scenario())
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept.id]
    assert (tmp_path / kept.id / "session" / "session.txt").read_text() == "8"


def test_a_contexts_folder_is_refused_for_an_engine_on_a_mesh(tmp_path):
    with pytest.raises(ValueError, match="contexts_dir=.*: contexts on a mesh are not copied"):
        create_app(
            types.SimpleNamespace(placement="a mesh"), None, "m", "full", contexts_dir=tmp_path
        )


def test_too_many_tokens_on_a_context_under_a_decode_evicting_policy_names_the_limit():
    with pytest.raises(SharedDecodeError) as engine_error:  # what the engine's submit raises
        check_shared_decode(policies.get("h2o", budget=0.3), 10_000)

    class RefusingWorker:
        def submit(self, on_event, *args, **kwargs):
            future = concurrent.futures.Future()
            future.set_exception(engine_error.value)
            return future

    server = Server(
        types.SimpleNamespace(policy=None), None, "m", "h2o", RequestDefaults(), [], None
    )
    server.worker = RefusingWorker()
    body = ChatRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=64)
    with pytest.raises(APIError) as refused:
        asyncio.run(server.submit(body, [1, 2], True, asyncio.Queue()))
    assert refused.value.status == 400 and refused.value.param == "max_completion_tokens"
