"""`jaxkv serve`'s OpenAI-compatible API, through the `openai` client against a server this test
starts on 127.0.0.1 (every request bounded in time, the server stopped at the end): answers as
`generate`, streaming, chat, the server's defaults, errors in OpenAI's shape (a request too large
for the pool, before or while it runs), a bounded load, disconnects, overload, a dead engine,
the warm-up, Prometheus metrics."""

import concurrent.futures
import contextlib
import dataclasses
import socket
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest
import uvicorn

import jaxkv
from jaxkv import CacheConfig, bundled, prose
from jaxkv.engine import intake
from jaxkv.models import byte_tokenizer, load_hf_checkpoint
from jaxkv.serve import RequestDefaults, create_app

# A chat template for the byte-level reference model (it ships none).
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PROMPT = " ".join(prose.paragraphs()[:2])[:300]
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    return dataclasses.replace(byte_tokenizer(), chat_template=TEMPLATE)


def snapkv_engine(model, **options) -> jaxkv.Engine:
    defaults = dict(cache=CacheConfig(num_pages=1024), max_slots=8, max_context=2048)
    return jaxkv.Engine(model, "snapkv:0.3", **(defaults | options))


@contextlib.contextmanager
def serving(engine, tokenizer, **app_options):
    """The app over `engine` on a free 127.0.0.1 port in a thread (no warm-up unless asked);
    yields its base URL; stops it."""
    app_options = {"warm_up_first": False} | app_options
    app = create_app(engine, tokenizer, "reference", "snapkv:0.3", **app_options)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive()


def running_server(model, tokenizer, **engine_options):
    """A snapkv:0.3 server (`serving`) over an engine of these options."""
    return serving(snapkv_engine(model, **engine_options), tokenizer)


# The module's server: a request that leaves them out gets 6 tokens, greedy.
DEFAULTS = RequestDefaults(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def base_url(model, tokenizer):
    with serving(snapkv_engine(model), tokenizer, defaults=DEFAULTS) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def metrics(base_url) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=TIMEOUT).text
    samples = (line.split() for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=TIMEOUT)


def test_a_completion_is_generate_s_answer_streamed_or_not(client, model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    out = jaxkv.generate(model, [ids], max_new_tokens=12, policy="snapkv:0.3")
    expected = tokenizer.decode(out.tokens[0, : out.num_tokens[0]])
    reply = client.completions.create(
        model="reference", prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert reply.choices[0].text == expected
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 12
    assert reply.choices[0].finish_reason == "length"
    # The cache it held after its last step: generate's, and less than the full cache's.
    assert reply.usage.kv_bytes == int(out.memory_bytes[-1])
    full = jaxkv.generate(model, [ids], max_new_tokens=12, policy="full")
    assert reply.usage.kv_bytes_full_cache == int(full.memory_bytes[-1]) > reply.usage.kv_bytes
    chunks = client.completions.create(
        model="reference", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in chunks]
    assert "".join(pieces) == expected and len(pieces) >= 12
    # stream_options.include_usage: every chunk says usage null, a last one without choices
    # the whole answer's usage.
    chunks = list(
        client.chat.completions.create(
            model="reference",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(chunk.usage is None and chunk.choices for chunk in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5
    with pytest.raises(openai.BadRequestError, match="stream_options: only with stream=true"):
        client.completions.create(
            model="reference", prompt=PROMPT, max_tokens=2, stream_options={"include_usage": True}
        )


def test_a_request_may_ask_for_a_smaller_budget_and_gets_generate_s_answer_at_it(
    client, model, tokenizer
):
    ids = tokenizer.encode(PROMPT)
    out = jaxkv.generate(model, [ids], max_new_tokens=8, policy="snapkv:0.1")
    reply = client.completions.create(
        model="reference", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"budget": 0.1}
    )
    assert reply.choices[0].text == tokenizer.decode(out.tokens[0, : out.num_tokens[0]])
    assert reply.usage.kv_bytes == int(out.memory_bytes[-1])


def test_chat_and_stop_strings_and_seeds(client, tokenizer):
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(
        model="reference", messages=messages, max_tokens=10, temperature=0
    )
    text = reply.choices[0].message.content
    streamed = client.chat.completions.create(
        model="reference", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == text
    stop = text[3:5]
    cut = client.chat.completions.create(
        model="reference", messages=messages, max_tokens=10, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    sampled = [
        client.completions.create(
            model="reference", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed
        )
        .choices[0]
        .text
        for seed in (1, 1, 2)
    ]
    assert sampled[0] == sampled[1] != sampled[2]


def test_fields_left_out_get_the_server_defaults(client, model, tokenizer):
    """The server's defaults (`jaxkv serve --max-new-tokens 6 --temperature 0`), and OpenAI's
    current name of the limit, max_completion_tokens."""
    ids = tokenizer.encode(PROMPT)
    out = jaxkv.generate(model, [ids], max_new_tokens=6, policy="snapkv:0.3")
    reply = client.completions.create(model="reference", prompt=PROMPT)
    assert reply.choices[0].text == tokenizer.decode(out.tokens[0, : out.num_tokens[0]])
    assert reply.usage.completion_tokens == 6
    messages = [{"role": "user", "content": PROMPT}]
    limited = client.chat.completions.create(
        model="reference", messages=messages, max_completion_tokens=3
    )
    assert limited.usage.completion_tokens == 3
    assert limited.choices[0].finish_reason == "length"


def test_models_health_and_metrics(client, base_url):
    assert [card.id for card in client.models.list().data] == ["reference"]
    assert client.models.list().data[0].policy == "snapkv:0.3"  # not OpenAI's field
    assert httpx.get(f"{base_url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    numbers = metrics(base_url)
    assert numbers["jaxkv_pool_pages"] == 1024
    assert numbers["jaxkv_requests_running"] == 0 and numbers["jaxkv_pages_in_use"] == 0
    assert numbers["jaxkv_ring_bytes"] == 0 and numbers["jaxkv_kv_bytes_in_use"] == 0


def test_metrics_are_prometheus_text_with_help_and_type(base_url):
    reply = httpx.get(f"{base_url}/metrics", timeout=TIMEOUT)
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = reply.text.splitlines()
    samples = [index for index, line in enumerate(lines) if not line.startswith("#")]
    assert len(samples) == len(lines) // 3 >= 8
    for index in samples:
        name = lines[index].split()[0]
        assert lines[index - 2].startswith(f"# HELP {name} ")
        kind = "counter" if name.endswith("_total") else "gauge"
        assert lines[index - 1] == f"# TYPE {name} {kind}"


def test_unknown_routes_and_malformed_json_answer_in_openai_s_shape(base_url):
    missing = httpx.get(f"{base_url}/v1/nothing", timeout=TIMEOUT)
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "Invalid URL (GET /v1/nothing)",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    wrong_method = httpx.get(f"{base_url}/v1/completions", timeout=TIMEOUT)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    malformed = httpx.post(
        f"{base_url}/v1/completions",
        content=b'{"prompt": "x", not json',
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert malformed.status_code == 400
    error = malformed.json()["error"]
    assert error["param"] is None and error["message"].startswith("the body is not valid JSON")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": -1}, "temperature"),
        ({"prompt": "x" * 3000, "max_tokens": 4}, "prompt"),
        ({"prompt": PROMPT, "policy": "h2o:0.5"}, "policy"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": PROMPT, "top_k": 0}, "top_k"),
        ({"prompt": PROMPT, "max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ({"prompt": PROMPT, "budget": 0.5}, "budget"),  # more than the server's 0.3
        ({"prompt": PROMPT, "budget": 64}, "budget"),  # a count where the server's is a ratio
        ({"prompt": PROMPT, "budget": 0.0}, "budget"),
        ({"prompt": PROMPT, "budget": "half"}, "budget"),
    ],
)
def test_bad_requests_get_openai_shaped_400s_and_the_server_keeps_serving(base_url, body, param):
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=TIMEOUT)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]
    malformed = httpx.post(
        f"{base_url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] is None
    ok = httpx.post(
        f"{base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=TIMEOUT
    )
    assert ok.status_code == 200


def test_a_bounded_load_completes_every_request_once(client, base_url):
    def ask(index: int) -> tuple[int, str, int]:
        reply = client.completions.create(
            model="reference", prompt=PROMPT[index:], max_tokens=6, temperature=0
        )
        return index, reply.id, reply.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(ask, range(64), timeout=10 * TIMEOUT))
    assert sorted(index for index, _, _ in results) == list(range(64))
    assert len({name for _, name, _ in results}) == 64
    assert all(count == 6 for _, _, count in results)
    numbers = metrics(base_url)
    assert numbers["jaxkv_generation_tokens_total"] >= 64 * 6
    assert numbers["jaxkv_pages_in_use"] == 0 and numbers["jaxkv_requests_running"] == 0


def test_a_client_that_disconnects_mid_stream_frees_its_pages(base_url):
    body = {"prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True}
    generated = metrics(base_url)["jaxkv_generation_tokens_total"]
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=TIMEOUT) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert metrics(base_url)["jaxkv_pages_in_use"] > 0
    deadline = time.monotonic() + TIMEOUT
    while metrics(base_url)["jaxkv_pages_in_use"] > 0:
        assert time.monotonic() < deadline, "the disconnected request kept its pages"
        time.sleep(0.1)
    numbers = metrics(base_url)
    assert numbers["jaxkv_requests_running"] == 0
    # cancelled, not run out: far fewer than its 500 tokens were generated
    assert numbers["jaxkv_generation_tokens_total"] - generated < 250


def test_a_client_that_gives_up_on_a_whole_answer_has_its_request_cancelled(base_url):
    body = {"prompt": PROMPT, "max_tokens": 500, "temperature": 0}
    generated = metrics(base_url)["jaxkv_generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):  # the client closes the connection
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + TIMEOUT
    busy = ("jaxkv_requests_waiting", "jaxkv_requests_running", "jaxkv_pages_in_use")
    while any(metrics(base_url)[name] > 0 for name in busy):  # queued, prefilling or running
        assert time.monotonic() < deadline, "the abandoned request is still there"
        time.sleep(0.1)
    # cancelled, not run out: far fewer than its 500 tokens were generated
    assert metrics(base_url)["jaxkv_generation_tokens_total"] - generated < 250


def test_overload_queues_then_answers_503_and_never_crashes(model, tokenizer):
    with running_server(model, tokenizer, max_slots=1, max_waiting=2) as url:

        def post(_):
            body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)

        with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
            replies = list(pool.map(post, range(12), timeout=10 * TIMEOUT))
        codes = sorted(reply.status_code for reply in replies)
        assert set(codes) == {200, 503} and codes.count(200) >= 3
        overloaded = next(reply for reply in replies if reply.status_code == 503)
        assert "max_waiting=2" in overloaded.json()["error"]["message"]
        texts = {
            reply.json()["choices"][0]["text"] for reply in replies if reply.status_code == 200
        }
        assert len(texts) == 1  # greedy: the same answer whoever waited
        assert post(0).status_code == 200


@pytest.fixture(scope="module")
def small_pool_url(model, tokenizer):
    """A server whose pool holds 200 pages: 16 a head of the model's 12, and 8 more."""
    with running_server(model, tokenizer, cache=CacheConfig(num_pages=200)) as url:
        yield url


def test_a_request_the_pool_cannot_hold_is_refused_before_it_runs(small_pool_url):
    """400 naming the pool and the field to shrink: the prompt (messages), or the limit when a
    smaller one fits."""
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    reply = post(small_pool_url, "/v1/chat/completions", chat)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert "the pool's num_pages=200" in error["message"]
    for limit in ("max_tokens", "max_completion_tokens"):
        # 225 tokens: 180 pages while the prompt is read; then 67 kept a head, 276 pages with
        # 300 new tokens (the plan's).
        body = {"prompt": PROMPT[:224], limit: 300}
        error = post(small_pool_url, "/v1/completions", body).json()["error"]
        assert (error["param"], error["code"]) == (limit, "context_length_exceeded")
        assert "give max_new_tokens <= " in error["message"]
    assert metrics(small_pool_url)["jaxkv_requests_waiting"] == 0


def test_a_request_larger_than_its_plan_ends_in_an_error_not_length(small_pool_url, monkeypatch):
    """The engine's too_large (a request that needed more pages than the pool has while
    running alone) is an OpenAI error, never finish_reason "length": a 400 response, or an
    error event in the stream, which the client raises."""
    monkeypatch.setattr(intake, "pages_needed_alone", lambda *args: 0)  # a plan that fits
    client = openai.OpenAI(
        base_url=f"{small_pool_url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="reference", prompt=PROMPT, max_tokens=2)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"
    assert "more pages than the pool's 200 hold" in refused.value.message
    chunks = client.completions.create(model="reference", prompt=PROMPT, max_tokens=2, stream=True)
    with pytest.raises(openai.APIError, match="more pages than the pool's 200 hold"):
        list(chunks)
    assert metrics(small_pool_url)["jaxkv_pages_in_use"] == 0


def test_health_and_requests_say_so_when_the_engine_thread_has_died(model, tokenizer):
    broken = snapkv_engine(model)

    def step():
        raise RuntimeError("the device is gone")

    broken.step = step
    with serving(broken, tokenizer) as url:
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
        failed = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "server_error"
        assert "RuntimeError: the device is gone" in failed.json()["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=TIMEOUT)
        assert health.status_code == 503
        assert health.json() == {"status": "error", "error": "RuntimeError: the device is gone"}
        refused = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert refused.status_code == 503 and "engine has stopped" in refused.text


def test_the_warm_up_compiles_the_engine_before_the_server_is_ready(model, tokenizer):
    eng = snapkv_engine(model, prefill_chunk=32)  # chunk buckets 16 and 32
    submitted = []
    submit = eng.submit
    eng.submit = lambda *args, **kwargs: submitted.append(submit(*args, **kwargs))
    with serving(eng, tokenizer, warm_up_first=True) as url:
        # 1, 2 and 4 prompts read at once at each bucket, run to their end before `started`
        assert len(submitted) == 2 * (1 + 2 + 4) and not eng.has_work()
        assert metrics(url)["jaxkv_generation_tokens_total"] == 0  # not a client's tokens
