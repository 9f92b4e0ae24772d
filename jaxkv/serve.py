"""An OpenAI-compatible HTTP server: a thin layer over `jaxkv.Engine` (the `serve` extra).

    jaxkv serve --model smollm2-135m-instruct --policy kvzip:0.3 --num-pages 4096 --port 8000

Endpoints: `/v1/completions` and `/v1/chat/completions` (the model's chat template; `stream:
true` as server-sent events; `max_tokens` or `max_completion_tokens`, `temperature`, `top_p`,
`top_k` (an extension), `stop`, `seed`; a field left out gets the server's default,
`RequestDefaults`), `/v1/models`, `/health`, `/metrics` (Prometheus text: requests running and
waiting, pages in use, KV bytes, tokens generated and per second). Before it serves, one short
request runs through the engine (`warm_up`: its programs compile then, not in the first request).
One thread owns the engine and steps it while there is work; request handlers talk to it through
a queue, and each request's tokens come back to its handler as they are produced. Errors have
OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): 400 for a bad request (the
engine keeps serving the others), including one the pool could not hold (code
`context_length_exceeded`), 404 for an unknown route, 503 when the queue is full or the engine
has stopped. A client that disconnects mid-stream cancels its request, and its pages return to
the pool.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator

import jax
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from jaxkv.cache.config import check_count
from jaxkv.engine import Engine, QueueFullError, TokenEvent, TooLargeForPoolError
from jaxkv.models import Tokenizer, encode_chat
from jaxkv.prose import prose
from jaxkv.sampling import Sampler

log = logging.getLogger(__name__)

# Tokens-per-second is measured over this many recent seconds.
RATE_WINDOW_SECONDS = 10.0

# (name, type, help, the worker's stats key) of each /metrics sample; counters, and only they,
# end in _total (Prometheus' naming).
METRICS = (
    ("jaxkv_requests_running", "gauge", "Requests decoding in the engine's slots.", "running"),
    ("jaxkv_requests_waiting", "gauge", "Requests queued or being prefilled.", "waiting"),
    ("jaxkv_pages_in_use", "gauge", "Pages of the KV pool that requests hold.", "pages_in_use"),
    ("jaxkv_pool_pages", "gauge", "Pages of the KV pool.", "num_pages"),
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
    ("jaxkv_generation_tokens_total", "counter", "Tokens generated.", "tokens_generated"),
    (
        "jaxkv_generation_tokens_per_second",
        "gauge",
        f"Tokens generated per second over the last {RATE_WINDOW_SECONDS:g} seconds.",
        "tokens_per_second",
    ),
)

# Prompt lengths the warm-up tries, shortest first: the first the engine takes runs.
WARM_UP_LENGTHS = (128, 256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for a field it leaves out (`jaxkv serve`'s --max-new-tokens,
    --temperature, --top-k, --top-p). Unless given, OpenAI's: 16 tokens at temperature 1."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        check_count("max_new_tokens", self.max_new_tokens, 1)
        # The sampler's checks, each value named; top-k and top-p apply to the requests that
        # sample even when the default is greedy (1 stands in for temperature 0 here).
        Sampler(temperature=self.temperature or 1.0, top_k=self.top_k, top_p=self.top_p)


class EngineStoppedError(RuntimeError):
    """The engine's thread stopped on an error: no request is served any more."""


class EngineWorker:
    """The engine in a thread of its own: `submit` and `cancel` from any thread, each request's
    `TokenEvent`s to the callback it was submitted with (called in the engine's thread)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._listeners: dict[int, callable] = {}
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.tokens_generated = 0
        # The engine's stats as of its last command or step, taken in its thread: the engine's
        # state is donated to its programs, so no other thread may read it.
        self._engine_stats = engine.stats()
        self.failure: str | None = None  # the error the engine's thread stopped on
        self._failing = threading.Lock()  # a submit is queued before a failure or refused after
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    def submit(self, on_event, /, *args, **kwargs) -> concurrent.futures.Future:
        """A future of the request id (or of the engine's ValueError, or EngineStoppedError) for
        `Engine.submit`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._failing:
            if self.failure is None:
                self._commands.put(("submit", future, on_event, args, kwargs))
            else:
                future.set_exception(EngineStoppedError(self.failure))
        return future

    def cancel(self, request_id: int) -> None:
        self._commands.put(("cancel", request_id))

    def stats(self) -> dict:
        now = time.monotonic()
        recent = sum(count for at, count in self._recent if now - at <= RATE_WINDOW_SECONDS)
        return {
            **self._engine_stats,
            "tokens_generated": self.tokens_generated,
            "tokens_per_second": recent / RATE_WINDOW_SECONDS,
        }

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=30)

    def _handle(self, command) -> None:
        if command[0] == "submit":
            _, future, on_event, args, kwargs = command
            try:
                request_id = self.engine.submit(*args, **kwargs)
            except ValueError as error:
                future.set_exception(error)
                return
            self._listeners[request_id] = on_event
            future.set_result(request_id)
        elif command[0] == "cancel":
            request_id = command[1]
            if self.engine.cancel(request_id) and request_id in self._listeners:
                self._listeners.pop(request_id)(TokenEvent(request_id, -1, True, "cancelled"))

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as error:
            log.exception("the engine's thread stopped")
            self._fail(f"{type(error).__name__}: {error}")

    def _fail(self, failure: str) -> None:
        """Refuses every submit from now on and ends every request with reason "error"."""
        with self._failing:
            self.failure = failure
            commands = []
            while not self._commands.empty():
                commands.append(self._commands.get_nowait())
        for command in commands:
            if command[0] == "submit":
                command[1].set_exception(EngineStoppedError(failure))
        for request_id, listener in self._listeners.items():
            listener(TokenEvent(request_id, -1, True, "error"))
        self._listeners.clear()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            busy = self.engine.has_work()
            try:
                self._handle(self._commands.get(block=not busy))
                self._engine_stats = self.engine.stats()
                continue  # take every waiting command before the next step
            except queue.Empty:
                pass
            events = self.engine.step()
            self._engine_stats = self.engine.stats()
            produced = sum(event.token >= 0 for event in events)
            self.tokens_generated += produced
            self._recent.append((time.monotonic(), produced))
            while self._recent and time.monotonic() - self._recent[0][0] > RATE_WINDOW_SECONDS:
                self._recent.popleft()
            for event in events:
                listener = self._listeners.get(event.request_id)
                if listener is not None:
                    listener(event)
                    if event.finished:
                        del self._listeners[event.request_id]


class _Sampling(BaseModel):
    """The fields both endpoints take; None (left out) gets the server's `RequestDefaults`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's current name
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)  # not OpenAI's: vLLM's extension
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    policy: str | None = None


class CompletionRequest(_Sampling):
    prompt: str


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """OpenAI's error object."""
        fields = {"message": self.message, "type": self.kind, "param": self.param}
        return {"error": {**fields, "code": self.code}}


def _error(error: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _new_tokens(body: _Sampling, defaults: RequestDefaults) -> tuple[int, str]:
    """(max_new_tokens, the field that set it): max_completion_tokens or max_tokens, the same
    value if both are given, else the server's default."""
    given = {
        name: getattr(body, name)
        for name in ("max_completion_tokens", "max_tokens")
        if getattr(body, name) is not None
    }
    if len(set(given.values())) > 1:
        raise APIError(
            400,
            f"max_completion_tokens={body.max_completion_tokens} and max_tokens="
            f"{body.max_tokens} differ: give one (max_completion_tokens is OpenAI's current name)",
            "max_completion_tokens",
        )
    name = next(iter(given), "max_tokens")
    return given.get(name, defaults.max_new_tokens), name


def _sampler(body: _Sampling, defaults: RequestDefaults) -> Sampler:
    """The request's sampler, each field left out taken from the server's defaults."""

    def chosen(name: str):
        value = getattr(body, name)
        return getattr(defaults, name) if value is None else value

    if chosen("temperature") == 0:
        return Sampler()  # greedy
    top_p = chosen("top_p")
    return Sampler(
        temperature=chosen("temperature"),
        top_k=chosen("top_k"),
        top_p=None if top_p == 1.0 else top_p,
    )


def _metrics_text(stats: dict) -> str:
    """Prometheus' text format: a HELP and a TYPE line before each sample."""
    lines = []
    for name, kind, description, key in METRICS:
        value = stats[key]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines += [f"# HELP {name} {description}", f"# TYPE {name} {kind}", f"{name} {shown}"]
    return "\n".join(lines) + "\n"


def warm_up(engine: Engine, tokenizer: Tokenizer) -> None:
    """Runs one short request through an idle engine (prose, two new tokens), so that its
    decode step, admission and a prefill compile before the server takes requests: the first
    prompt length of `WARM_UP_LENGTHS` the engine takes; skipped, said in the log, if none."""
    ids = tokenizer.encode(prose(8 * WARM_UP_LENGTHS[-1]))
    refusals = []
    for length in WARM_UP_LENGTHS:
        try:
            engine.submit(ids[:length], max_new_tokens=2, stop_tokens=())
        except ValueError as error:
            refusals.append(f"{length} tokens: {error}")
            continue
        log.info("warming up: a request of %d prompt tokens compiles the engine", length)
        engine.run()
        return
    log.warning("no warm-up: the engine took none of its prompts (%s)", "; ".join(refusals))


class _StopText:
    """Text decoded so far, cut at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: str | list[str] | None):
        self.tokenizer = tokenizer
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.ids: list[int] = []
        self.sent = 0  # characters already streamed
        self.stopped = False

    def add(self, token: int) -> str:
        """The new text after `token` (held back while it may begin a stop string)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        cut = min((text.find(s) for s in self.stop if s and s in text), default=-1)
        if cut >= 0:
            self.stopped = True
            text = text[:cut]
        elif self.stop:
            held = max((_prefix_overlap(text, s) for s in self.stop if s), default=0)
            text = text[: len(text) - held]
        delta, self.sent = text[self.sent :], max(self.sent, len(text))
        return delta

    def rest(self) -> str:
        """What was held back once the request has ended without a stop string."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids)
        delta, self.sent = text[self.sent :], len(text)
        return delta


def _prefix_overlap(text: str, stop: str) -> int:
    """Characters at the end of `text` that begin `stop`."""
    longest = min(len(stop) - 1, len(text))
    return next((n for n in range(longest, 0, -1) if text.endswith(stop[:n])), 0)


def create_app(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    policy_spec: str,
    *,
    defaults: RequestDefaults | None = None,
    warm_up_first: bool = True,
) -> FastAPI:
    """The FastAPI application over `engine` (started with the app, stopped with it): fields a
    request leaves out from `defaults`; `warm_up_first` runs `warm_up` before it serves."""
    defaults = RequestDefaults() if defaults is None else defaults
    worker_box: dict[str, EngineWorker] = {}
    stop_ids = [t for t in [tokenizer.eos_id, *engine.model.config.eos_token_ids] if t is not None]

    async def lifespan(app):
        if warm_up_first:
            await asyncio.to_thread(warm_up, engine, tokenizer)
        worker_box["worker"] = EngineWorker(engine)
        yield
        worker_box.pop("worker").stop()

    app = FastAPI(title="jaxkv", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return _error(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":  # its location is a character offset
            detail = first.get("ctx", {}).get("error", "")
            return _error(APIError(400, f"the body is not valid JSON: {detail}"))
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        return _error(APIError(400, message, ".".join(location) or None))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        route = f"{request.method} {request.url.path}"
        message = (
            f"Invalid URL ({route})" if error.status_code == 404 else f"{route}: {error.detail}"
        )
        return _error(APIError(error.status_code, message), headers=error.headers)

    @app.get("/health")
    async def health():
        worker = worker_box["worker"]
        if not worker.alive:
            failure = worker.failure or "the engine's thread has stopped"
            return JSONResponse({"status": "error", "error": failure}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "jaxkv"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        text = _metrics_text(worker_box["worker"].stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def run(body: _Sampling, prompt_ids: list[int], chat: bool):
        if body.policy is not None and body.policy != policy_spec:
            raise APIError(
                400,
                f"policy={body.policy!r}: this server's pool runs policy {policy_spec!r} for "
                "every request; start another server for another policy",
                "policy",
            )
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model={body.model!r}: this server serves {model_name!r}", "model")
        max_new_tokens, limit_field = _new_tokens(body, defaults)
        prompt_field = "messages" if chat else "prompt"
        seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(4), "little")
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        worker = worker_box["worker"]
        future = worker.submit(
            lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
            prompt_ids,
            max_new_tokens=max_new_tokens,
            sampler=_sampler(body, defaults),
            key=jax.random.PRNGKey(seed),
            stop_tokens=stop_ids,
        )
        try:
            request_id = await asyncio.wrap_future(future)
        except QueueFullError as error:
            raise APIError(503, str(error), None, "server_overloaded") from None
        except TooLargeForPoolError as error:
            param = prompt_field if error.field == "prompt_ids" else limit_field
            raise APIError(400, str(error), param, code="context_length_exceeded") from None
        except ValueError as error:
            param = prompt_field if "prompt" in str(error) else None
            raise APIError(400, str(error), param) from None
        except EngineStoppedError as error:
            raise APIError(503, f"the engine has stopped: {error}") from None
        name = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        ending = _Ending(worker, prompt_field, limit_field)
        stream = _tokens(worker, request_id, events, _StopText(tokenizer, body.stop), ending)
        if body.stream:
            return StreamingResponse(
                _sse(stream, name, model_name, chat), media_type="text/event-stream"
            )
        text, reason, count = [], "length", 0
        async for delta, finish, token in stream:
            text.append(delta)
            count += token >= 0
            reason = finish or reason
        return _response(name, model_name, chat, "".join(text), reason, len(prompt_ids), count)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if not body.prompt:
            raise APIError(400, "prompt is empty", "prompt")
        return await run(body, tokenizer.encode(body.prompt), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        messages = [message.model_dump() for message in body.messages]
        try:
            prompt_ids = encode_chat(tokenizer, messages)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from None
        return await run(body, prompt_ids, chat=True)

    return app


@dataclasses.dataclass(frozen=True)
class _Ending:
    """How a request's end without an answer is told: the fields its error names."""

    worker: EngineWorker
    prompt_field: str  # "prompt" or "messages"
    limit_field: str  # "max_tokens" or "max_completion_tokens"

    def error(self, reason: str, generated: int) -> APIError:
        """The error for an engine reason that is not a finish_reason ("too_large", "error")."""
        if reason == "too_large":
            pool = self.worker.stats()["num_pages"]
            return APIError(
                400,
                f"the request needed more pages than the pool's {pool} hold, running alone, "
                f"after {generated} tokens (more than its plan at submit): give a shorter "
                f"{self.prompt_field} or a smaller {self.limit_field}",
                self.prompt_field,
                code="context_length_exceeded",
            )
        return APIError(500, f"the engine has stopped: {self.worker.failure}")


# The engine's reasons that are OpenAI finish_reasons ("cancelled": the client went away or a
# stop string appeared); any other ends the request with an error (`_Ending.error`).
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}


async def _tokens(
    worker: EngineWorker,
    request_id: int,
    events: asyncio.Queue,
    text: _StopText,
    ending: _Ending,
) -> AsyncIterator[tuple[str, str | None, int]]:
    """(text delta, finish reason or None, token) per token until the request ends; raises
    APIError when it ends without an answer (`FINISH_REASONS`). Cancels the request when a stop
    string appears or the client goes away (which closes this generator: `finally`)."""
    finished, generated = False, 0
    try:
        while True:
            event: TokenEvent = await events.get()
            generated += event.token >= 0
            if event.token >= 0 and not event.finished:
                delta = text.add(event.token)
                if text.stopped:
                    yield delta, "stop", event.token
                    return
                yield delta, None, event.token
                continue
            finished = True
            if event.reason not in FINISH_REASONS:
                raise ending.error(event.reason, generated)
            delta = text.add(event.token) if event.reason == "length" else ""
            delta += text.rest()
            yield delta, FINISH_REASONS[event.reason], event.token
            return
    finally:
        if not finished:
            worker.cancel(request_id)


async def _sse(stream, name: str, model: str, chat: bool) -> AsyncIterator[str]:
    """The stream's chunks as server-sent events; an error mid-stream as OpenAI sends it (a
    `data: {"error": ...}` event, which its client raises as an APIError)."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield _event(name, kind, created, model, first)
    try:
        async for delta, finish, _ in stream:
            choice = {"index": 0, "finish_reason": finish}
            choice |= {"delta": {"content": delta}} if chat else {"text": delta, "logprobs": None}
            yield _event(name, kind, created, model, choice)
    except APIError as error:
        yield f"data: {json.dumps(error.body())}\n\n"
        return
    yield "data: [DONE]\n\n"


def _event(name, kind, created, model, choice) -> str:
    chunk = {"id": name, "object": kind, "created": created, "model": model, "choices": [choice]}
    return f"data: {json.dumps(chunk)}\n\n"


def _response(name, model, chat, text, reason, prompt_tokens, completion_tokens) -> dict:
    choice = {"index": 0, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice |= {"text": text, "logprobs": None}
    return {
        "id": name,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
