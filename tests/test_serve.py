"""`jaxkv serve`'s OpenAI-compatible API, through the `openai` client against a server this test
starts on 127.0.0.1 (every request bounded in time, the server stopped at the end): answers as
`generate`, streaming, chat, errors in OpenAI's shape, a bounded load, disconnects, overload."""

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
from jaxkv.models import byte_tokenizer, load_hf_checkpoint
from jaxkv.serve import create_app

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


@contextlib.contextmanager
def running_server(model, tokenizer, **engine_options):
    """A server on a free 127.0.0.1 port in a thread; yields its base URL; stops it."""
    options = dict(cache=CacheConfig(num_pages=1024), max_slots=8, max_context=2048)
    engine = jaxkv.Engine(model, "snapkv:0.3", **(options | engine_options))
    app = create_app(engine, tokenizer, model_name="reference", policy_spec="snapkv:0.3")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def base_url(model, tokenizer):
    with running_server(model, tokenizer) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def metrics(base_url) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=TIMEOUT).text
    return {name: float(value) for name, value in (line.split() for line in text.splitlines())}


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
    chunks = client.completions.create(
        model="reference", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in chunks]
    assert "".join(pieces) == expected and len(pieces) >= 12


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


def test_models_health_and_metrics(client, base_url):
    assert [card.id for card in client.models.list().data] == ["reference"]
    assert httpx.get(f"{base_url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    numbers = metrics(base_url)
    assert numbers["jaxkv_pages_total"] == 1024
    assert numbers["jaxkv_requests_running"] == 0 and numbers["jaxkv_pages_in_use"] == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": -1}, "temperature"),
        ({"prompt": "x" * 3000, "max_tokens": 4}, "prompt"),
        ({"prompt": PROMPT, "policy": "h2o:0.5"}, "policy"),
        ({"max_tokens": 4}, "prompt"),
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
    assert malformed.status_code == 400 and "error" in malformed.json()
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
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=TIMEOUT) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert metrics(base_url)["jaxkv_pages_in_use"] > 0
    deadline = time.monotonic() + TIMEOUT
    while metrics(base_url)["jaxkv_pages_in_use"] > 0:
        assert time.monotonic() < deadline, "the disconnected request kept its pages"
        time.sleep(0.1)
    assert metrics(base_url)["jaxkv_requests_running"] == 0


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
