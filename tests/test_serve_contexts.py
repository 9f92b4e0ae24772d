"""`jaxkv serve`'s cached contexts through the `openai` client against a server this test
starts on 127.0.0.1 (every request bounded in count and time, the server stopped at the end): a
context made once answers concurrent requests as `jaxkv.ask` does; chats split automatically
into a cached context and a question; a context dropped for its pages is a 404 and is made
again; bad ids and fields are OpenAI-shaped errors naming the field; the server stays
healthy."""

import concurrent.futures

import openai
import pytest

import jaxkv
from jaxkv import CacheConfig, bundled, prose
from jaxkv.models import encode_chat, load_hf_checkpoint
from jaxkv.serve.contexts import Contexts
from jaxkv.serve.protocol import APIError
from tests.test_serve import TIMEOUT, metrics, post, serving
from tests.test_serve import tokenizer as tokenizer  # noqa: F401  (the module's fixture)

DOCUMENT = " ".join(prose.paragraphs()[:4])[:600]
QUESTIONS = ["\nIn short, ", "\nThe answer is that the ", "\nSo "]
ANSWER_TOKENS = 8


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL, dtype="float32")  # exact across batches


def served(model, tokenizer, num_pages=2048, storage="model", **app_options):
    engine = jaxkv.Engine(
        model,
        "snapkv:0.3",
        cache=storage_config(storage, num_pages=num_pages),
        max_slots=4,
        max_contexts=2,
        max_context=2048,
    )
    return serving(engine, tokenizer, **app_options)


def storage_config(storage: str, **more) -> CacheConfig:
    """The cache of a storage: "int8" keeps each head's newest 32 tokens in the kv dtype."""
    window = {"full_precision_window": 32} if storage == "int8" else {}
    return CacheConfig(storage=storage, **window, **more)


def openai_client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def asked(model, tokenizer, context_ids, question_ids, storage="model") -> str:
    """`jaxkv.ask`'s greedy answer as the server's text (its stop tokens left out)."""
    stop = {t for t in [tokenizer.eos_id, *model.config.eos_token_ids] if t is not None}
    out = jaxkv.ask(
        model,
        context_ids,
        [question_ids],
        "snapkv:0.3",
        max_new_tokens=ANSWER_TOKENS,
        stop_tokens=sorted(stop),
        cache=storage_config(storage),
    ).answers
    tokens = out.tokens[0, : int(out.num_tokens[0])].tolist()
    return tokenizer.decode([t for t in tokens if t not in stop])


def test_a_context_made_once_answers_concurrent_requests_as_ask(model, tokenizer):
    with served(model, tokenizer) as url:
        client = openai_client(url)
        made = post(url, "/v1/contexts", {"prompt": DOCUMENT})
        assert made.status_code == 200, made.text
        card = made.json()
        context_ids = tokenizer.encode(DOCUMENT)
        assert card["tokens"] == len(context_ids) and card["compressed"] is True
        session = jaxkv.prefill(model, context_ids, "snapkv:0.3")
        assert card["kv_bytes"] == session.memory_bytes() < card["kv_bytes_full_cache"]

        def ask_server(question):
            return client.completions.create(
                model="reference",
                prompt=question,
                max_tokens=ANSWER_TOKENS,
                temperature=0,
                extra_body={"context": card["id"]},
            )

        with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
            replies = list(pool.map(ask_server, QUESTIONS))
        for question, reply in zip(QUESTIONS, replies, strict=True):
            question_ids = tokenizer.encode(question, add_bos=False)
            assert reply.choices[0].text == asked(model, tokenizer, context_ids, question_ids)
            usage = reply.usage
            assert usage.prompt_tokens == len(context_ids) + len(question_ids)
            assert usage.prompt_tokens_details.cached_tokens == len(context_ids)
            assert usage.context == card["id"]
            assert card["kv_bytes"] <= usage.kv_bytes < usage.kv_bytes_full_cache
        numbers = metrics(url)
        assert numbers["jaxkv_contexts"] == 1 and numbers["jaxkv_context_hits_total"] == 3
        assert numbers["jaxkv_context_pages"] == numbers["jaxkv_pages_in_use"] > 0
        listed = client.get("/contexts", cast_to=object)["data"]
        assert [c["id"] for c in listed] == [card["id"]] and listed[0]["hits"] == 3
        deleted = client.delete(f"/contexts/{card['id']}", cast_to=object)
        assert deleted == {"id": card["id"], "object": "context", "deleted": True}
        assert metrics(url)["jaxkv_pages_in_use"] == 0
        with pytest.raises(openai.NotFoundError) as missing:
            ask_server(QUESTIONS[0])
        assert missing.value.body["param"] == "context"
        assert missing.value.body["code"] == "context_not_found"
        assert client.with_options(max_retries=0).models.list().data[0].id == "reference"


def test_a_chat_s_earlier_messages_are_a_cached_context_of_their_own(model, tokenizer, monkeypatch):
    system = {"role": "system", "content": DOCUMENT}
    with served(model, tokenizer, auto_context_tokens=64) as url:
        client = openai_client(url)
        for question in ("What is it about?", "Say it again."):
            messages = [system, {"role": "user", "content": question}]
            reply = client.chat.completions.create(
                model="reference", messages=messages, max_tokens=ANSWER_TOKENS, temperature=0
            )
            prefix = encode_chat(tokenizer, [system], add_generation_prompt=False)
            rest = encode_chat(tokenizer, messages)[len(prefix) :]
            assert reply.choices[0].message.content == asked(model, tokenizer, prefix, rest)
            assert reply.usage.prompt_tokens_details.cached_tokens == len(prefix)
        numbers = metrics(url)
        assert numbers["jaxkv_contexts"] == 1 and numbers["jaxkv_context_hits_total"] == 2
        # One message alone, or a prefix under the threshold: no context.
        client.chat.completions.create(
            model="reference",
            messages=[{"role": "user", "content": DOCUMENT}],
            max_tokens=2,
            temperature=0,
        )
        assert metrics(url)["jaxkv_context_hits_total"] == 2

        # Every context row read: a chat whose split finds them so runs whole instead.
        async def rows_all_read(self, ids, messages, budget):
            raise APIError(429, "every context row is read", None, code="contexts_full")

        monkeypatch.setattr(Contexts, "automatic", rows_all_read)
        messages = [{"role": "system", "content": DOCUMENT[::-1]}, messages[-1]]
        reply = client.chat.completions.create(
            model="reference", messages=messages, max_tokens=2, temperature=0
        )
        assert reply.usage.prompt_tokens == len(encode_chat(tokenizer, messages))
        details = reply.usage.prompt_tokens_details
        assert details is None or not details.cached_tokens  # read whole, no cached context
        assert metrics(url)["jaxkv_context_hits_total"] == 2


def test_a_context_dropped_for_pages_is_a_404_and_is_made_again(model, tokenizer):
    # 700 pages: the context (~450 pages during its prefill) or the long prompt, not both.
    with served(model, tokenizer, num_pages=700) as url:
        client = openai_client(url)
        first = post(url, "/v1/contexts", {"prompt": DOCUMENT}).json()["id"]
        long_prompt = " ".join(prose.paragraphs())[:900]
        reply = client.completions.create(
            model="reference", prompt=long_prompt, max_tokens=2, temperature=0
        )
        assert reply.choices[0].finish_reason == "length"
        assert metrics(url)["jaxkv_contexts_evicted_total"] == 1
        with pytest.raises(openai.NotFoundError, match="make it again"):
            client.completions.create(
                model="reference",
                prompt=QUESTIONS[0],
                max_tokens=2,
                extra_body={"context": first},
            )
        again = post(url, "/v1/contexts", {"prompt": DOCUMENT}).json()["id"]
        reply = client.completions.create(
            model="reference",
            prompt=QUESTIONS[0],
            max_tokens=ANSWER_TOKENS,
            temperature=0,
            extra_body={"context": again},
        )
        question_ids = tokenizer.encode(QUESTIONS[0], add_bos=False)
        expected = asked(model, tokenizer, tokenizer.encode(DOCUMENT), question_ids)
        assert reply.choices[0].text == expected


BAD_CONTEXTS = [
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": DOCUMENT, "budget": 0.9}, 400, "budget"),  # larger than the server's
    ({"prompt": DOCUMENT, "model": "other"}, 404, "model"),
]


def test_bad_contexts_and_requests_are_refused_naming_the_field(model, tokenizer):
    with served(model, tokenizer) as url:
        for body, status, param in BAD_CONTEXTS:
            reply = post(url, "/v1/contexts", body)
            assert reply.status_code == status, body
            assert reply.json()["error"]["param"] == param, body
        client = openai_client(url)
        made = post(url, "/v1/contexts", {"prompt": DOCUMENT}).json()["id"]
        with pytest.raises(openai.BadRequestError) as budget:
            client.completions.create(
                model="reference",
                prompt="x",
                max_tokens=2,
                extra_body={"context": made, "budget": 0.2},
            )
        assert budget.value.body["param"] == "budget"
        with pytest.raises(openai.BadRequestError, match="made from a prompt"):
            client.chat.completions.create(
                model="reference",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2,
                extra_body={"context": made},
            )
        with pytest.raises(openai.NotFoundError):
            client.delete("/contexts/ctx-nope", cast_to=object)
        assert post(url, "/v1/contexts", {"prompt": DOCUMENT}).status_code == 200
        assert metrics(url)["jaxkv_contexts"] == 2


@pytest.mark.parametrize("storage", ["model", "int8"])
def test_contexts_outlive_the_server_in_its_folder(model, tokenizer, tmp_path, storage):
    """Saved when the server stops, loaded when the next starts, in its storage: an int8
    context (each head's tokens past its 32 newest in int8) answers as `ask` with int8 storage
    and holds fewer bytes than the model-dtype one."""
    folder = tmp_path / "contexts"
    question = dict(model="reference", prompt=QUESTIONS[0], max_tokens=ANSWER_TOKENS, temperature=0)
    with served(model, tokenizer, contexts_dir=folder, storage=storage) as url:
        card = post(url, "/v1/contexts", {"prompt": DOCUMENT}).json()
        first = openai_client(url).completions.create(
            **question, extra_body={"context": card["id"]}
        )
    context_ids = tokenizer.encode(DOCUMENT)
    question_ids = tokenizer.encode(QUESTIONS[0], add_bos=False)
    assert first.choices[0].text == asked(model, tokenizer, context_ids, question_ids, storage)
    session = jaxkv.prefill(model, context_ids, "snapkv:0.3")  # the model-dtype context
    if storage == "int8":
        assert card["kv_bytes"] < 0.7 * session.memory_bytes()
    else:
        assert card["kv_bytes"] == session.memory_bytes()
    assert (folder / card["id"] / "context.json").is_file()
    with served(model, tokenizer, contexts_dir=folder, storage=storage) as url:
        client = openai_client(url)
        (loaded,) = client.get("/contexts", cast_to=object)["data"]
        assert loaded == card | {"hits": 1}
        again = client.completions.create(**question, extra_body={"context": card["id"]})
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.kv_bytes == first.usage.kv_bytes
        assert metrics(url)["jaxkv_contexts"] == 1
