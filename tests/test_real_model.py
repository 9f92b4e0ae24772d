"""SmolLM2-135M-Instruct (GGUF Q4_1), the real pretrained model, against transformers.

Needs the file fetched once (`jaxkv fetch smollm2-135m-instruct`); without it these tests skip
with that command as the reason. CI's GGUF coverage does not depend on them: tests/test_gguf.py
writes its own files.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxkv
from jaxkv import downloads, policies
from jaxkv.models import encode_chat, forward, gguf_tokenizer, load_gguf
from jaxkv.prose import prose

NAME = "smollm2-135m-instruct"
F32_ULP = np.finfo(np.float32).eps


@pytest.fixture(scope="module")
def path():
    try:
        return downloads.model_path(NAME)
    except FileNotFoundError as missing:
        pytest.skip(str(missing))


@pytest.fixture(scope="module")
def reference(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


@pytest.fixture(scope="module")
def ours(path):
    return load_gguf(path), gguf_tokenizer(path)


def test_logits_over_a_2k_token_prompt_equal_transformers(reference, ours):
    model, tokenizer = ours
    prompt = tokenizer.encode(prose(12_000))[:2048]
    assert len(prompt) == 2048
    with torch.no_grad():
        expected = reference[0](torch.tensor([prompt])).logits[0].numpy()
    got = np.asarray(forward(model, jnp.asarray([prompt])))[0]
    # 30 layers summed in f32 in different orders, over 2K positions.
    np.testing.assert_allclose(got, expected, rtol=0, atol=256 * F32_ULP * np.abs(expected).max())
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.999


def test_greedy_chat_answers_equal_transformers(reference, ours):
    model, tokenizer = ours
    questions = [
        "What is the capital of France? Answer in one sentence.",
        "Write a haiku about the sea.",
    ]
    prompts = [encode_chat(tokenizer, question) for question in questions]
    out = jaxkv.generate(
        model, prompts, max_new_tokens=24, policy=policies.get("full"), stop_tokens=[2]
    )
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = (
                reference[0]
                .generate(
                    torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=2
                )[0, len(prompt) :]
                .tolist()
            )
        n = int(out.num_tokens[row])
        assert np.asarray(out.tokens[row, :n]).tolist() == expected
    answer = tokenizer.decode(out.tokens[0, : int(out.num_tokens[0])])
    assert answer == "The capital of France is Paris."


def test_token_ids_equal_transformers(reference, ours):
    texts = [
        prose(4000),
        "The special magic number for amber-otter is 4821937.",
        "café naïve 東京 😀 Ελληνικά\n\tdef f(x):\n        return x ** 2  # 1,000,000",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12345 -3.5e10<|im_end|>",
    ]
    for text in texts:
        ids = ours[1].encode(text)
        assert ids == reference[1].encode(text, add_special_tokens=True)
        assert ours[1].decode(ids, skip_special_tokens=False) == text
    digits = [ours[1].encode(digit)[0] for digit in "4829173"]
    assert ours[1].encode(" 4829173") == ours[1].encode(" ") + digits  # one token a digit


def test_ask_over_one_compressed_document_answers_as_each_question_alone(ours):
    """Issue 55 on the real model: four questions over one kvzip:0.3 copy of a 1K-token
    document answer token for token as each asked alone over the same compressed copy."""
    from jaxkv.benchmarks.needles import build_document

    model, tokenizer = ours
    document = build_document(tokenizer, 1024, 4)
    policy = policies.from_spec("kvzip:0.3").for_tokenizer(tokenizer)
    session = jaxkv.prefill(model, list(document.context_ids), policy)
    stop = list(model.config.eos_token_ids)
    asked = jaxkv.ask(
        model, session, [list(q) for q in document.questions], max_new_tokens=10, stop_tokens=stop
    )
    for row, question in enumerate(document.questions):
        alone = jaxkv.decode(session.extend(list(question)), 10, stop_tokens=stop)
        np.testing.assert_array_equal(asked.answers.tokens[row], alone.tokens[0])
    assert asked.total_bytes < 0.5 * asked.separate_bytes
