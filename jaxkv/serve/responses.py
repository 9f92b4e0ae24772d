"""How a request's tokens become an answer: text cut at its stop strings, the reason it ended
(or the error it ended with), server-sent events of a stream, the body of a whole response."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator

from jaxkv.engine import TokenEvent
from jaxkv.models import Tokenizer
from jaxkv.serve.protocol import APIError
from jaxkv.serve.worker import EngineWorker


class StopText:
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


@dataclasses.dataclass(frozen=True)
class Ending:
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
# stop string appeared); any other ends the request with an error (`Ending.error`).
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}


async def token_deltas(
    worker: EngineWorker,
    request_id: int,
    events: asyncio.Queue,
    text: StopText,
    ending: Ending,
) -> AsyncIterator[tuple[str, str | None, TokenEvent]]:
    """(text delta, finish reason or None, the engine's event) per token until the request
    ends; raises APIError when it ends without an answer (`FINISH_REASONS`). Cancels the
    request when a stop string appears or the client goes away (which closes this generator:
    `finally`)."""
    finished, generated = False, 0
    try:
        while True:
            event: TokenEvent = await events.get()
            generated += event.token >= 0
            if event.token >= 0 and not event.finished:
                delta = text.add(event.token)
                if text.stopped:
                    yield delta, "stop", event
                    return
                yield delta, None, event
                continue
            finished = True
            if event.reason not in FINISH_REASONS:
                raise ending.error(event.reason, generated)
            delta = text.add(event.token) if event.reason == "length" else ""
            delta += text.rest()
            # A stop string that the last allowed token completes cut the text: "stop".
            yield delta, "stop" if text.stopped else FINISH_REASONS[event.reason], event
            return
    finally:
        if not finished:
            worker.cancel(request_id)


async def server_sent_events(
    stream, name: str, model: str, chat: bool, usage=None
) -> AsyncIterator[str]:
    """The stream's chunks as server-sent events; an error mid-stream as OpenAI sends it (a
    `data: {"error": ...}` event, which its client raises as an APIError). With `usage` (a
    function of the tokens generated and the last event, `stream_options.include_usage`),
    every chunk says `"usage": null` and a last one, without choices, the usage."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    usage_field = {} if usage is None else {"usage": None}

    def event(choices: list) -> str:
        chunk = {"id": name, "object": kind, "created": created, "model": model}
        return f"data: {json.dumps(chunk | {'choices': choices} | usage_field)}\n\n"

    if chat:
        yield event(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )
    count, last = 0, None
    try:
        async for delta, finish, token_event in stream:
            choice = {"index": 0, "finish_reason": finish}
            choice |= {"delta": {"content": delta}} if chat else {"text": delta, "logprobs": None}
            count, last = count + (token_event.token >= 0), token_event
            yield event([choice])
    except APIError as error:
        yield f"data: {json.dumps(error.body())}\n\n"
        return
    if usage is not None:
        usage_field = {"usage": usage(count, last)}
        yield event([])
    yield "data: [DONE]\n\n"


def completion_body(name, model, chat, text, reason, usage: dict) -> dict:
    """The whole response (`usage`: `usage_of`'s)."""
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
        "usage": usage,
    }


def usage_of(
    prompt_tokens: int,
    completion_tokens: int,
    last: TokenEvent | None,
    context: str | None = None,
    cached_tokens: int = 0,
) -> dict:
    """OpenAI's usage, with (not OpenAI's fields) the KV bytes the request held at its last
    step, `kv_bytes`, and those the full cache would have held, `kv_bytes_full_cache`, when
    the engine reported them on its final event `last` (not when a stop string cancelled it).
    A request on a cached `context` counts its tokens in its prompt's, as OpenAI's
    `prompt_tokens_details.cached_tokens`, and names it (`context`)."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if context is not None:
        usage |= {"prompt_tokens_details": {"cached_tokens": cached_tokens}, "context": context}
    if last is not None and last.kv_bytes is not None:
        usage |= {"kv_bytes": last.kv_bytes, "kv_bytes_full_cache": last.full_kv_bytes}
    return usage
