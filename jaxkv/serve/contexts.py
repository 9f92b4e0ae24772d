"""The server's cached contexts: a document compressed once in the engine's pool
(`Engine.add_context`) that any number of requests read, as `jaxkv.ask` reads questions over
one compressed context.

Two ways in:
- explicit: `POST /v1/contexts` with a `prompt` (text, tokenized as `/v1/completions`
  tokenizes a prompt) or `messages` (rendered with the chat template, no generation prompt)
  compresses it and answers its id; a request names it in `context` (the `openai` client's
  `extra_body`): a completion's prompt is read after the context's tokens (no BOS); a chat's
  `messages` continue the context's messages (the conversation rendered whole must begin with
  the context's tokens); `DELETE /v1/contexts/{id}` drops it.
- automatic, for chat: with `max_contexts` > 0, every message before the last user turn is the
  context and the rest the question (kvpress's split of context and question), when that
  prefix renders to at least `auto_min_tokens` tokens that begin the whole conversation's and
  the policy evicts nothing during the request's decode; the same prefix (and budget) reuses
  its context.
The engine drops an idle context when requests need its pages or a new context its row,
automatic ones first, then the least recently used: a request naming it then gets a 404 (add it
again); an automatic one is made again.

With a directory (`jaxkv serve --contexts-dir`), the server saves its ready contexts there when
it stops (each a folder named by its id: the context copied out of the pool as a `Session` in
`save_session`'s format, and `context.json`: its ids, messages, budget, hits) and loads them when
it starts, before it serves: the same ids answer as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from jaxkv.engine import (
    ContextEvent,
    ContextsFullError,
    Engine,
    QueueFullError,
    TooLargeForPoolError,
)
from jaxkv.generation.saved import load_session, save_session
from jaxkv.models import Tokenizer, encode_chat
from jaxkv.serve.protocol import APIError
from jaxkv.serve.worker import EngineStoppedError, EngineWorker

log = logging.getLogger(__name__)

SAVED = "context.json"  # beside the saved session, in each context's folder


@dataclasses.dataclass
class ServedContext:
    """A cached context as the server knows it.

    Attributes:
      id: its id ("ctx-...").
      engine_id: the engine's id of it (None until the engine has queued it).
      ids: its token ids.
      messages: the chat messages it renders (None: a prompt's text).
      budget: the budget it was compressed with (None: the policy's).
      auto: whether a chat made it (the automatic split).
      ready: the engine's "ready" event of it, once it came (kv bytes, compression).
      hits: requests that have read it.
    """

    id: str
    engine_id: int | None
    ids: list[int]
    messages: list[dict] | None
    budget: object
    auto: bool
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    ready: asyncio.Future | None = None
    hits: int = 0

    def card(self) -> dict:
        """Its JSON object (`/v1/contexts`)."""
        card = {
            "id": self.id,
            "object": "context",
            "created": self.created,
            "tokens": len(self.ids),
            "source": "messages" if self.messages is not None else "prompt",
            "automatic": self.auto,
            "hits": self.hits,
        }
        if self.ready is not None and self.ready.done() and not self.ready.exception():
            event: ContextEvent = self.ready.result()
            card |= {
                "kv_bytes": event.kv_bytes,
                "kv_bytes_full_cache": event.full_kv_bytes,
                "compressed": event.compressed,
            }
        return card


class Contexts:
    """The server's cached contexts over the engine's (module docstring). Its methods run in
    the event loop; the engine's events come from its thread through `call_soon_threadsafe`."""

    def __init__(self, tokenizer: Tokenizer, max_contexts: int, auto_min_tokens: int):
        self.tokenizer, self.max_contexts, self.auto_min_tokens = (
            tokenizer,
            max_contexts,
            auto_min_tokens,
        )
        self.worker: EngineWorker | None = None
        self._by_id: dict[str, ServedContext] = {}
        self._automatic: dict[tuple, asyncio.Future] = {}  # (budget, ids) -> its ServedContext

    def listed(self) -> list[dict]:
        return [context.card() for context in self._by_id.values()]

    def named(self, context_id) -> ServedContext:
        """The context of this id, or a 404 naming `context`."""
        context = self._by_id.get(context_id) if isinstance(context_id, str) else None
        if context is None:
            raise APIError(
                404,
                f"context={context_id!r}: no such context (never made, deleted, or dropped for "
                "its pages: make it again with POST /v1/contexts)",
                "context",
                code="context_not_found",
            )
        return context

    async def create(
        self, ids: list[int], messages: list[dict] | None, budget, *, auto: bool = False
    ) -> ServedContext:
        """A new context of `ids` in the engine (queued: requests may name it at once; its
        `ready` future resolves when it is compressed). APIErrors for what the engine refuses."""
        if not self.max_contexts:
            raise APIError(
                400, "this server caches no contexts: start it with --max-contexts >= 1", None
            )
        loop = asyncio.get_running_loop()
        field = "messages" if messages is not None else "prompt"
        context = ServedContext(
            id=f"ctx-{uuid.uuid4().hex}",
            engine_id=None,
            ids=list(ids),
            messages=messages,
            budget=budget,
            auto=auto,
            ready=loop.create_future(),
        )
        # Its events go to this object: one may come before this coroutine resumes.
        future = self.worker.add_context(
            lambda event: loop.call_soon_threadsafe(self._on_event, context, event),
            ids,
            budget=budget,
            evict_first=auto,  # a chat's earlier turns go before the contexts clients made
        )
        try:
            context.engine_id = await asyncio.wrap_future(future)
        except ContextsFullError as error:
            raise APIError(429, str(error), None, code="contexts_full") from None
        except QueueFullError as error:
            raise APIError(503, str(error), None, "server_overloaded") from None
        except TooLargeForPoolError as error:
            raise APIError(400, str(error), field, code="context_length_exceeded") from None
        except EngineStoppedError as error:
            raise APIError(503, f"the engine has stopped: {error}") from None
        except ValueError as error:
            param = "budget" if "budget" in str(error) else field
            raise APIError(400, str(error), param) from None
        if not (context.ready.done() and context.ready.exception()):  # not refused already
            self._by_id[context.id] = context
        return context

    async def delete(self, context_id: str) -> dict:
        context = self.named(context_id)
        self.forget(context)
        await asyncio.wrap_future(self.worker.drop_context(context.engine_id))
        return {"id": context.id, "object": "context", "deleted": True}

    def _on_event(self, context: ServedContext, event: ContextEvent) -> None:
        if event.state == "ready":
            if not context.ready.done():
                context.ready.set_result(event)
            return
        if not context.ready.done():
            field = "messages" if context.messages is not None else "prompt"
            _fail(
                context.ready,
                APIError(
                    400,
                    f"the context's {len(context.ids)} tokens came out larger than the pool "
                    "holds (more than its plan): give a shorter one",
                    field,
                    code="context_length_exceeded",
                )
                if event.state == "too_large"
                else APIError(503, f"the engine has stopped: {self.worker.failure}"),
            )
        self.forget(context)

    def forget(self, context: ServedContext) -> None:
        """The server no longer knows the context (deleted, dropped, or refused); one still
        being made fails its `ready` with a 404 (its creator waits on it)."""
        self._by_id.pop(context.id, None)
        if not context.ready.done():
            message = f"context={context.id!r} was deleted while it was being made"
            _fail(context.ready, APIError(404, message, "context", code="context_not_found"))
        key = (repr(context.budget), tuple(context.ids))
        made = self._automatic.get(key)
        if context.auto and made is not None and _holds(made, context):
            del self._automatic[key]

    async def automatic(self, ids: list[int], messages: list[dict], budget) -> ServedContext:
        """The automatic context of a chat's prefix `ids`: the one made before for the same
        prefix and budget, else a new one (concurrent requests with a new prefix make one)."""
        key = (repr(budget), tuple(ids))
        made = self._automatic.get(key)
        if made is None:
            made = asyncio.get_running_loop().create_future()
            self._automatic[key] = made
            try:
                made.set_result(await self.create(ids, messages, budget, auto=True))
            except APIError as error:
                del self._automatic[key]
                _fail(made, error)
                raise
            except BaseException:  # this request cancelled meanwhile: the others are told
                del self._automatic[key]
                message = "the request making this chat's context ended before it: ask again"
                _fail(made, APIError(503, message, None, "server_overloaded"))
                raise
        return await made

    def chat_split(self, messages: list[dict], max_new_tokens_evict: bool):
        """(the prefix messages, their ids, the whole conversation's ids) of the automatic split
        (every message before the last user turn), or None where it does not apply (no
        earlier message, a prefix under `auto_min_tokens`, a template that renders the prefix
        otherwise inside the conversation, or decode eviction within the request)."""
        users = [i for i, message in enumerate(messages) if message["role"] == "user"]
        if not self.max_contexts or max_new_tokens_evict or not users or users[-1] == 0:
            return None
        prefix = messages[: users[-1]]
        prefix_ids = encode_chat(self.tokenizer, prefix, add_generation_prompt=False)
        whole = encode_chat(self.tokenizer, messages)
        if len(prefix_ids) < self.auto_min_tokens or whole[: len(prefix_ids)] != prefix_ids:
            return None
        return prefix, prefix_ids, whole

    def question_ids(self, context: ServedContext, prompt: str | None, messages) -> list[int]:
        """The ids a request reads after `context`: a completion's prompt (no BOS), or the rest
        of the chat that continues the context's messages (a 400 naming the field otherwise)."""
        if prompt is not None:
            return self.tokenizer.encode(prompt, add_bos=False)
        if context.messages is None:
            raise APIError(
                400,
                f"context={context.id!r} was made from a prompt: read it with /v1/completions, "
                "or make a context from messages for chats",
                "context",
            )
        whole = encode_chat(self.tokenizer, [*context.messages, *messages])
        if whole[: len(context.ids)] != context.ids:
            raise APIError(
                400,
                "messages: the chat template renders the context's messages followed by these "
                "otherwise than the context's tokens: give the messages that follow them",
                "messages",
            )
        return whole[len(context.ids) :]

    def save_all(self, engine: Engine, directory: Path) -> None:
        """Each ready context into `directory` (module docstring), the folders of contexts the
        server no longer holds removed; run once the engine's thread has stopped. Written
        beside the old ones first, which go only then: a context that cannot be copied out
        (said in the log) costs itself, not the others."""
        directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".saving-", dir=directory))
        for context in self._by_id.values():
            if not (context.ready.done() and not context.ready.exception()):
                continue
            folder = staging / context.id
            try:
                save_session(engine.context_session(context.engine_id), folder / "session")
            except (OSError, ValueError) as error:
                log.warning("context %s not saved: %s", context.id, error)
                shutil.rmtree(folder, ignore_errors=True)
                continue
            record = {
                "ids": context.ids,
                "messages": context.messages,
                "budget": context.budget,
                "auto": context.auto,
                "created": context.created,
                "hits": context.hits,
            }
            (folder / SAVED).write_text(json.dumps(record) + "\n")
        for folder in directory.glob("ctx-*"):
            shutil.rmtree(folder)
        for folder in staging.iterdir():
            folder.rename(directory / folder.name)
        staging.rmdir()
        log.info("saved %d contexts to %s", len(list(directory.glob("ctx-*"))), directory)

    def load_all(self, engine: Engine, directory: Path) -> None:
        """The contexts saved in `directory` into the engine, ready, under their ids; run before
        the engine's thread starts. One that does not load (another model or policy, a full
        pool) is skipped, said in the log."""
        loop = asyncio.get_running_loop()
        for folder in sorted(directory.glob("ctx-*")) if directory.is_dir() else []:
            try:
                record = json.loads((folder / SAVED).read_text())
                session = load_session(folder / "session", engine.model, engine.policy)
                engine_id = engine.add_session(session, evict_first=record["auto"])
            except (OSError, ValueError) as error:
                log.warning("context %s not loaded: %s", folder.name, error)
                continue
            context = ServedContext(
                id=folder.name,
                engine_id=engine_id,
                ids=record["ids"],
                messages=record["messages"],
                budget=record["budget"],
                auto=record["auto"],
                created=record["created"],
                ready=loop.create_future(),
                hits=record["hits"],
            )
            context.ready.set_result(
                ContextEvent(
                    engine_id,
                    "ready",
                    len(context.ids),
                    kv_bytes=session.memory_bytes(),
                    full_kv_bytes=engine.full_kv_bytes(len(context.ids)),
                    compressed=bool(session.compressed()[0]),
                )
            )
            self._by_id[context.id] = context
            if context.auto:
                self._automatic[(repr(context.budget), tuple(context.ids))] = _done(context)
        log.info("loaded %d contexts from %s", len(self._by_id), directory)


def _fail(future: asyncio.Future, error: APIError) -> None:
    """`future` failed with `error`, retrieved (nobody may await it: no warning)."""
    future.set_exception(error)
    future.exception()


def _holds(made: asyncio.Future, context: ServedContext) -> bool:
    """Whether the automatic split's future `made` resolved to `context`."""
    return made.done() and made.exception() is None and made.result() is context


def _done(context: ServedContext) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(context)
    return future
