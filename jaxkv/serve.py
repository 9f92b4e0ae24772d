"""An OpenAI-compatible HTTP server: a thin layer over `jaxkv.Engine` (the `serve` extra).

    jaxkv serve --model smollm2-135m-instruct --policy kvzip:0.3 --num-pages 4096 --port 8000

Endpoints: `/v1/completions` and `/v1/chat/completions` (the model's chat template; `stream:
true` as server-sent events; `max_tokens`, `temperature`, `top_p`, `stop`, `seed`), `/v1/models`,
`/health`, `/metrics` (Prometheus text: requests running and waiting, pages in use, tokens
generated and per second). One thread owns the engine and steps it while there is work; request
handlers talk to it through a queue, and each request's tokens come back to its handler as they
are produced. Errors have OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`):
400 for a bad request (the engine keeps serving the others), 503 when the queue is full. A
client that disconnects mid-stream cancels its request, and its pages return to the pool.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
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

from jaxkv.engine import Engine, QueueFullError, TokenEvent
from jaxkv.models import Tokenizer, encode_chat
from jaxkv.sampling import Sampler

# Tokens-per-second is measured over this many recent seconds.
RATE_WINDOW_SECONDS = 10.0


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
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
        self._thread.start()

    def submit(self, on_event, /, *args, **kwargs) -> concurrent.futures.Future:
        """A future of the request id (or of the engine's ValueError) for `Engine.submit`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("submit", future, on_event, args, kwargs))
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
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
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

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def _error(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


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


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, policy_spec: str) -> FastAPI:
    """The FastAPI application over `engine` (started with the app, stopped with it)."""
    worker_box: dict[str, EngineWorker] = {}
    stop_ids = [t for t in [tokenizer.eos_id, *engine.model.config.eos_token_ids] if t is not None]

    async def lifespan(app):
        worker_box["worker"] = EngineWorker(engine)
        yield
        worker_box.pop("worker").stop()

    app = FastAPI(title="jaxkv", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return _error(error.status, error.message, error.param, error.kind)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        return _error(400, message, ".".join(location) or None, "invalid_request_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "jaxkv"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        stats = worker_box["worker"].stats()
        lines = [
            f"jaxkv_requests_running {stats['running']}",
            f"jaxkv_requests_waiting {stats['waiting']}",
            f"jaxkv_pages_in_use {stats['pages_in_use']}",
            f"jaxkv_pages_total {stats['num_pages']}",
            f"jaxkv_preemptions_total {stats['preemptions']}",
            f"jaxkv_generation_tokens_total {stats['tokens_generated']}",
            f"jaxkv_generation_tokens_per_second {stats['tokens_per_second']:.3f}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def run(body: _Sampling, prompt_ids: list[int], http: Request, chat: bool):
        if body.policy is not None and body.policy != policy_spec:
            raise APIError(
                400,
                f"policy={body.policy!r}: this server's pool runs policy {policy_spec!r} for "
                "every request; start another server for another policy",
                "policy",
            )
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model={body.model!r}: this server serves {model_name!r}", "model")
        sampler = Sampler()  # temperature 0: greedy
        if body.temperature > 0:
            top_p = None if body.top_p == 1.0 else body.top_p
            sampler = Sampler(temperature=body.temperature, top_p=top_p)
        seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(4), "little")
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        worker = worker_box["worker"]
        future = worker.submit(
            lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
            prompt_ids,
            max_new_tokens=body.max_tokens,
            sampler=sampler,
            key=jax.random.PRNGKey(seed),
            stop_tokens=stop_ids,
        )
        try:
            request_id = await asyncio.wrap_future(future)
        except QueueFullError as error:
            raise APIError(503, str(error), None, "server_overloaded") from None
        except ValueError as error:
            raise APIError(400, str(error), "prompt" if "prompt" in str(error) else None) from None
        name = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = _tokens(worker, request_id, events, _StopText(tokenizer, body.stop), http)
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
    async def completions(body: CompletionRequest, http: Request):
        if not body.prompt:
            raise APIError(400, "prompt is empty", "prompt")
        return await run(body, tokenizer.encode(body.prompt), http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: Request):
        messages = [message.model_dump() for message in body.messages]
        try:
            prompt_ids = encode_chat(tokenizer, messages)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from None
        return await run(body, prompt_ids, http, chat=True)

    return app


async def _tokens(
    worker: EngineWorker, request_id: int, events: asyncio.Queue, text: _StopText, http: Request
) -> AsyncIterator[tuple[str, str | None, int]]:
    """(text delta, finish reason or None, token) per token until the request ends; cancels it
    when the client goes away or a stop string appears."""
    del http  # a client that goes away closes this generator: `finally` cancels the request
    finished = False
    try:
        while True:
            event: TokenEvent = await events.get()
            if event.token >= 0 and not event.finished:
                delta = text.add(event.token)
                if text.stopped:
                    yield delta, "stop", event.token
                    return
                yield delta, None, event.token
                continue
            finished = True
            delta = text.add(event.token) if event.reason == "length" else ""
            delta += text.rest()
            reason = "length" if event.reason in ("length", "too_large") else "stop"
            yield delta, reason, event.token
            return
    finally:
        if not finished:
            worker.cancel(request_id)


async def _sse(stream, name: str, model: str, chat: bool) -> AsyncIterator[str]:
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield _event(name, kind, created, model, first)
    async for delta, finish, _ in stream:
        choice = {"index": 0, "finish_reason": finish}
        choice |= {"delta": {"content": delta}} if chat else {"text": delta, "logprobs": None}
        yield _event(name, kind, created, model, choice)
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
