"""What a request says and what an error answers, in OpenAI's shapes: the bodies of
`/v1/completions`, `/v1/chat/completions` and `/v1/contexts`, the server's defaults for fields
left out, and `APIError` (`{"error": {"message", "type", "param", "code"}}`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from jaxkv.cache.config import check_count
from jaxkv.sampling import Sampler


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


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: `include_usage` adds a last chunk with the usage."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields both endpoints take; None (left out) gets the server's `RequestDefaults`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's current name
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)  # not OpenAI's: vLLM's extension
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # a 64-bit key's range
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    policy: str | None = None
    # Not OpenAI's: a smaller budget of the server's policy, a ratio or a token count (checked by
    # `jaxkv.policies.Budget.parse`, whose errors name the field, so any JSON value is let in).
    budget: Any = None
    # Not OpenAI's: the id of a cached context the request reads after (`POST /v1/contexts`).
    context: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class ContextRequest(BaseModel):
    """`POST /v1/contexts`: a document to compress once, as a prompt's text or as chat
    messages (exactly one), with an optional smaller budget of the server's policy."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    budget: Any = None


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


def error_response(error: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def new_tokens(body: SamplingFields, defaults: RequestDefaults) -> tuple[int, str]:
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


def request_sampler(body: SamplingFields, defaults: RequestDefaults) -> Sampler:
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
