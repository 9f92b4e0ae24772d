"""An OpenAI-compatible HTTP server: a thin layer over `jaxkv.Engine` (the `serve` extra).

    jaxkv serve --model smollm2-135m-instruct --policy kvzip:0.3 --num-pages 4096 --port 8000

Endpoints: `/v1/completions` and `/v1/chat/completions` (the model's chat template; `stream:
true` as server-sent events; `max_tokens` or `max_completion_tokens`, `temperature`, `top_p`,
`top_k` (an extension), `stop`, `seed`; a field left out gets the server's default,
`RequestDefaults`), `/v1/models`, `/health`, `/metrics` (Prometheus text: requests running and
waiting, pages in use, KV bytes, tokens generated and per second). Before it serves, the engine
compiles its step programs (`warm_up`, `Engine.warm_up`), so that no request waits for them.
One thread owns the engine and steps it while there is work; request handlers talk to it through
a queue, and each request's tokens come back to its handler as they are produced. Errors have
OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): 400 for a bad request (the
engine keeps serving the others), including one the pool could not hold (code
`context_length_exceeded`), 404 for an unknown route, 503 when the queue is full or the engine
has stopped. A client that disconnects mid-stream cancels its request, and its pages return to
the pool.
"""

from jaxkv.serve.app import METRICS, Server, create_app, warm_up
from jaxkv.serve.protocol import APIError, RequestDefaults
from jaxkv.serve.worker import EngineStoppedError, EngineWorker

__all__ = [
    "METRICS",
    "APIError",
    "EngineStoppedError",
    "EngineWorker",
    "RequestDefaults",
    "Server",
    "create_app",
    "warm_up",
]
