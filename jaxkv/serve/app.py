"""The FastAPI application over an engine: its lifespan (warm-up, the engine's thread), its
error handlers (OpenAI's shape) and its routes, each a function over the app's `Server`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import uuid
from pathlib import Path

import jax
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from jaxkv.engine import (
    Engine,
    QueueFullError,
    TokenEvent,
    TooLargeForPoolError,
    UnknownContextError,
)
from jaxkv.generation.decoding import SharedDecodeError, check_shared_decode
from jaxkv.models import Tokenizer, encode_chat
from jaxkv.policies import Budget
from jaxkv.serve.contexts import Contexts, ServedContext
from jaxkv.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ContextRequest,
    RequestDefaults,
    SamplingFields,
    error_response,
    new_tokens,
    request_sampler,
)
from jaxkv.serve.responses import (
    Ending,
    StopText,
    completion_body,
    server_sent_events,
    token_deltas,
    usage_of,
)
from jaxkv.serve.worker import RATE_WINDOW_SECONDS, EngineStoppedError, EngineWorker

log = logging.getLogger(__name__)

# How often a request whose whole answer is being made checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.25
# (name, type, help, the worker's stats key) of each /metrics sample; counters, and only they,
# end in _total (Prometheus' naming).
METRICS = (
    ("jaxkv_requests_running", "gauge", "Requests decoding in the engine's slots.", "running"),
    ("jaxkv_requests_waiting", "gauge", "Requests queued or being prefilled.", "waiting"),
    ("jaxkv_pages_in_use", "gauge", "Pages of the KV pool that requests hold.", "pages_in_use"),
    ("jaxkv_pool_pages", "gauge", "Pages of the KV pool.", "num_pages"),
    (
        "jaxkv_int8_pages_in_use",
        "gauge",
        "Pages of the int8 tier's pool that requests hold (--storage int8; else 0).",
        "int8_pages_in_use",
    ),
    ("jaxkv_int8_pool_pages", "gauge", "Pages of the int8 tier's pool.", "int8_num_pages"),
    (
        "jaxkv_ring_bytes",
        "gauge",
        "Bytes of the local ring beside the pool (WG-KV's, every slot's; 0 without one).",
        "ring_bytes",
    ),
    (
        "jaxkv_kv_bytes_in_use",
        "gauge",
        "KV bytes held: the pages in use and the local ring.",
        "kv_bytes_in_use",
    ),
    ("jaxkv_preemptions_total", "counter", "Requests preempted for pages.", "preemptions"),
    ("jaxkv_contexts", "gauge", "Cached contexts held (being made or ready).", "contexts"),
    ("jaxkv_context_pages", "gauge", "Pages of the pool the ready contexts hold.", "context_pages"),
    (
        "jaxkv_context_int8_pages",
        "gauge",
        "Pages of the int8 tier's pool the ready contexts hold.",
        "context_int8_pages",
    ),
    (
        "jaxkv_context_hits_total",
        "counter",
        "Requests that read a cached context.",
        "context_hits",
    ),
    (
        "jaxkv_contexts_evicted_total",
        "counter",
        "Idle cached contexts dropped for pages requests needed.",
        "contexts_evicted",
    ),
    ("jaxkv_generation_tokens_total", "counter", "Tokens generated.", "tokens_generated"),
    (
        "jaxkv_generation_tokens_per_second",
        "gauge",
        f"Tokens generated per second over the last {RATE_WINDOW_SECONDS:g} seconds.",
        "tokens_per_second",
    ),
)


def metrics_text(stats: dict) -> str:
    """Prometheus' text format: a HELP and a TYPE line before each sample."""
    lines = []
    for name, kind, description, key in METRICS:
        value = stats[key]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines += [f"# HELP {name} {description}", f"# TYPE {name} {kind}", f"{name} {shown}"]
    return "\n".join(lines) + "\n"


def warm_up(engine: Engine) -> None:
    """Compiles an idle engine's step programs before the server takes requests
    (`Engine.warm_up`: every width of the prefill program at every chunk bucket, a decode step);
    a prompt length the engine refuses (a pool too small for it) ends the warm-up, said in the
    log: what was not compiled compiles when a request first needs it."""
    log.info("warming up: compiling the engine's programs")
    try:
        seconds = engine.warm_up()
    except ValueError as error:
        log.warning("warm-up ended early: %s", error)
        return
    log.info("warm: %.1f s of compiling", seconds)


@dataclasses.dataclass
class Server:
    """What the routes read: the engine (its worker once the app has started), the tokenizer,
    the names it answers to and the defaults of a request's fields."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    policy_spec: str
    defaults: RequestDefaults
    stop_ids: list[int]
    contexts: Contexts
    worker: EngineWorker | None = None

    def check_names(self, body) -> None:
        """The request's `policy` and `model`, if given, must be the server's."""
        if getattr(body, "policy", None) not in (None, self.policy_spec):
            raise APIError(
                400,
                f"policy={body.policy!r}: this server's pool runs policy {self.policy_spec!r} "
                "for every request; start another server for another policy",
                "policy",
            )
        if body.model is not None and body.model != self.model_name:
            message = f"model={body.model!r}: this server serves {self.model_name!r}"
            raise APIError(404, message, "model")

    def decode_evicts(self, body: SamplingFields) -> bool:
        """Whether the policy would evict during this request's decode (so no cached context,
        whose pages it would free, may serve it)."""
        try:
            check_shared_decode(self.engine.policy, new_tokens(body, self.defaults)[0])
        except SharedDecodeError:
            return True
        return False

    async def submit(
        self,
        body: SamplingFields,
        prompt_ids: list[int],
        chat: bool,
        events,
        context: ServedContext | None = None,
    ):
        """The request submitted to the engine (its tokens to `events`), read after `context`
        if given: its id, and the fields its prompt and its limit came from; APIErrors for
        what the engine refuses."""
        self.check_names(body)
        self.check_budget(body.budget)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: only with stream=true", "stream_options")
        max_new_tokens, limit_field = new_tokens(body, self.defaults)
        prompt_field = "messages" if chat else "prompt"
        seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(4), "little")
        loop = asyncio.get_running_loop()
        future = self.worker.submit(
            lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
            prompt_ids,
            max_new_tokens=max_new_tokens,
            sampler=request_sampler(body, self.defaults),
            key=jax.random.PRNGKey(seed),
            stop_tokens=self.stop_ids,
            budget=body.budget,
            context=None if context is None else context.engine_id,
        )
        try:
            request_id = await asyncio.wrap_future(future)
        except UnknownContextError as error:
            raise APIError(404, str(error), "context", code="context_not_found") from None
        except QueueFullError as error:
            raise APIError(503, str(error), None, "server_overloaded") from None
        except TooLargeForPoolError as error:
            param = prompt_field if error.field == "prompt_ids" else limit_field
            raise APIError(400, str(error), param, code="context_length_exceeded") from None
        except SharedDecodeError as error:  # on a cached context: too many tokens to decode
            raise APIError(400, str(error), limit_field) from None
        except ValueError as error:
            param = "budget" if "budget" in str(error) else None
            param = prompt_field if "prompt" in str(error) else param
            raise APIError(400, str(error), param) from None
        except EngineStoppedError as error:
            raise APIError(503, f"the engine has stopped: {error}") from None
        return request_id, prompt_field, limit_field

    async def complete(
        self,
        body: SamplingFields,
        prompt_ids: list[int],
        chat: bool,
        context: ServedContext | None = None,
        disconnected=None,
    ):
        """A completion of `prompt_ids` (read after `context`, if given): streamed as
        server-sent events, or whole. `disconnected`: an async check that the client has gone,
        polled while a whole answer is made (a gone client's request is cancelled; a stream's
        ends when its response can no longer be sent)."""
        events: asyncio.Queue = asyncio.Queue()
        request_id, prompt_field, limit_field = await self.submit(
            body, prompt_ids, chat, events, context
        )
        if context is not None:
            context.hits += 1
        name = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        ending = Ending(self.worker, prompt_field, limit_field)
        text = StopText(self.tokenizer, body.stop)
        stream = token_deltas(self.worker, request_id, events, text, ending)

        def usage(count: int, last: TokenEvent | None) -> dict:
            if context is None:
                return usage_of(len(prompt_ids), count, last)
            cached = len(context.ids)
            return usage_of(cached + len(prompt_ids), count, last, context.id, cached)

        if body.stream:
            wants_usage = body.stream_options is not None and body.stream_options.include_usage
            sse = server_sent_events(
                stream, name, self.model_name, chat, usage if wants_usage else None
            )
            return StreamingResponse(sse, media_type="text/event-stream")
        collecting = asyncio.ensure_future(_collected(stream))
        while disconnected is not None and not collecting.done():
            await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_SECONDS)
            if not collecting.done() and await disconnected():
                collecting.cancel()  # closes the token stream, which cancels the request
                with contextlib.suppress(asyncio.CancelledError):
                    await collecting
                raise APIError(400, "the client went away before the answer was made")
        pieces, reason, count, last = await collecting
        text = "".join(pieces)
        return completion_body(name, self.model_name, chat, text, reason, usage(count, last))

    def check_budget(self, budget) -> None:
        """A request's own budget: of the server's policy's kind, at most its budget (an
        APIError naming `budget` otherwise; the engine checks the value itself)."""
        if budget is None:
            return
        policy = self.engine.policy
        served = getattr(policy, "budget", None) or getattr(policy, "ratio", None)
        if served is None:
            message = f"budget={budget!r}: policy {self.policy_spec!r} takes no budget"
            raise APIError(400, message, "budget")
        served = Budget.parse(served)
        try:
            asked = Budget.parse(budget)
        except ValueError as error:
            raise APIError(400, str(error), "budget") from None
        same_kind = (asked.ratio is None) == (served.ratio is None)
        larger = same_kind and (asked.ratio or asked.tokens) > (served.ratio or served.tokens)
        if not same_kind or larger:
            shown = served.ratio if served.ratio is not None else served.tokens
            raise APIError(
                400,
                f"budget={budget!r}: a request may ask for a smaller budget of this server's "
                f"policy {self.policy_spec!r} ({shown}, a {_kind(served)}), not a "
                f"{'larger one' if same_kind else _kind(asked)}",
                "budget",
            )


async def _collected(stream) -> tuple[list[str], str, int, TokenEvent | None]:
    """(text pieces, finish reason, tokens generated, the last event) of a whole answer."""
    pieces, reason, count, last = [], "length", 0, None
    async for delta, finish, event in stream:
        pieces.append(delta)
        count += event.token >= 0
        reason, last = finish or reason, event
    return pieces, reason, count, last


def _kind(budget: Budget) -> str:
    return "ratio of the prompt" if budget.ratio is not None else "token count"


def _server(request: Request) -> Server:
    return request.app.state.server


routes = APIRouter()


@routes.get("/health")
async def health(request: Request):
    worker = _server(request).worker
    if not worker.alive:
        failure = worker.failure or "the engine's thread has stopped"
        return JSONResponse({"status": "error", "error": failure}, status_code=503)
    return {"status": "ok"}


@routes.get("/v1/models")
async def models(request: Request):
    server = _server(request)
    card = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "jaxkv"}
    return {"object": "list", "data": [card | {"policy": server.policy_spec}]}


@routes.get("/metrics")
async def metrics(request: Request):
    text = metrics_text(_server(request).worker.stats())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


@routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    if not body.prompt:
        raise APIError(400, "prompt is empty", "prompt")
    server = _server(request)
    if body.context is not None:
        context = server.contexts.named(body.context)
        ids = server.contexts.question_ids(context, body.prompt, None)
        return await server.complete(
            body, ids, chat=False, context=context, disconnected=request.is_disconnected
        )
    ids = server.tokenizer.encode(body.prompt)
    return await server.complete(body, ids, chat=False, disconnected=request.is_disconnected)


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    server = _server(request)
    messages = [message.model_dump() for message in body.messages]
    context, split = None, None
    try:  # the chat template's errors
        if body.context is not None:
            context = server.contexts.named(body.context)
            ids = server.contexts.question_ids(context, None, messages)
        else:
            split = server.contexts.chat_split(messages, server.decode_evicts(body))
            ids = encode_chat(server.tokenizer, messages) if split is None else None
    except ValueError as error:
        raise APIError(400, str(error), "messages") from None
    if split is None:
        return await server.complete(
            body, ids, chat=True, context=context, disconnected=request.is_disconnected
        )
    server.check_names(body)
    server.check_budget(body.budget)
    prefix, prefix_ids, whole = split
    for attempt in (1, 2):  # the context may be dropped for its pages in between: made again
        try:
            context = await server.contexts.automatic(prefix_ids, prefix, body.budget)
        except APIError as error:
            if error.code != "contexts_full":
                raise
            # Every context row is read: the chat runs whole, as without the split.
            return await server.complete(
                body, whole, chat=True, disconnected=request.is_disconnected
            )
        try:
            return await server.complete(
                body.model_copy(update={"budget": None}),
                whole[len(prefix_ids) :],
                chat=True,
                context=context,
                disconnected=request.is_disconnected,
            )
        except APIError as error:
            if error.code != "context_not_found" or attempt == 2:
                raise
            server.contexts.forget(context)


@routes.post("/v1/contexts")
async def create_context(body: ContextRequest, request: Request):
    server = _server(request)
    server.check_names(body)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give a context as prompt (text) or as messages, one of them", "prompt")
    server.check_budget(body.budget)
    if body.prompt is not None:
        if not body.prompt:
            raise APIError(400, "prompt is empty", "prompt")
        ids, messages = server.tokenizer.encode(body.prompt), None
    else:
        messages = [message.model_dump() for message in body.messages]
        try:
            ids = encode_chat(server.tokenizer, messages, add_generation_prompt=False)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from None
    context = await server.contexts.create(ids, messages, body.budget)
    await context.ready
    return context.card()


@routes.get("/v1/contexts")
async def list_contexts(request: Request):
    return {"object": "list", "data": _server(request).contexts.listed()}


@routes.get("/v1/contexts/{context_id}")
async def get_context(context_id: str, request: Request):
    return _server(request).contexts.named(context_id).card()


@routes.delete("/v1/contexts/{context_id}")
async def delete_context(context_id: str, request: Request):
    return await _server(request).contexts.delete(context_id)


async def _api_error(request: Request, error: APIError):
    return error_response(error)


async def _invalid(request: Request, error: RequestValidationError):
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":  # its location is a character offset
        detail = first.get("ctx", {}).get("error", "")
        return error_response(APIError(400, f"the body is not valid JSON: {detail}"))
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
    return error_response(APIError(400, message, ".".join(location) or None))


async def _http_error(request: Request, error: HTTPException):
    route = f"{request.method} {request.url.path}"
    message = f"Invalid URL ({route})" if error.status_code == 404 else f"{route}: {error.detail}"
    return error_response(APIError(error.status_code, message), headers=error.headers)


def create_app(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    policy_spec: str,
    *,
    defaults: RequestDefaults | None = None,
    warm_up_first: bool = True,
    auto_context_tokens: int = 256,
    contexts_dir: str | os.PathLike | None = None,
) -> FastAPI:
    """The FastAPI application over `engine` (started with the app, stopped with it): fields a
    request leaves out from `defaults`; `warm_up_first` runs `warm_up` before it serves; a
    chat's messages before its last user turn are a cached context of their own when they
    render to at least `auto_context_tokens` tokens and the engine holds contexts
    (`jaxkv.serve.contexts`); with `contexts_dir`, the contexts saved there are loaded before it
    serves and its contexts saved there when it stops."""
    if contexts_dir is not None and engine.placement is not None:
        raise ValueError(
            f"contexts_dir={os.fspath(contexts_dir)!r}: contexts on a mesh are not copied out to "
            "be saved; serve on one device, or without a contexts folder"
        )
    stop_ids = [t for t in [tokenizer.eos_id, *engine.model.config.eos_token_ids] if t is not None]
    server = Server(
        engine,
        tokenizer,
        model_name,
        policy_spec,
        RequestDefaults() if defaults is None else defaults,
        stop_ids,
        Contexts(tokenizer, engine.limits.max_contexts, auto_context_tokens),
    )

    async def lifespan(app):
        if warm_up_first:
            await asyncio.to_thread(warm_up, engine)
        if contexts_dir is not None:
            server.contexts.load_all(engine, Path(contexts_dir))
        server.worker = server.contexts.worker = EngineWorker(engine)
        yield
        failure = server.worker.failure
        await asyncio.to_thread(server.worker.stop)  # the event loop serves on meanwhile
        server.worker = None
        if contexts_dir is not None and failure is None:  # a failed engine's state is not kept
            server.contexts.save_all(engine, Path(contexts_dir))

    app = FastAPI(title="jaxkv", lifespan=lifespan)
    app.state.server = server
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http_error)
    app.include_router(routes)
    return app
