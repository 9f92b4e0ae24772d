"""Gate training for a model with its own tokenizer (a tiny GGUF file): rows in the model's ids,
`jaxkv train wgkv|fastkvzip|duo_attention --model FILE.gguf` end to end, and the policies load
what they save."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import policies, prose
from jaxkv.model_sources import load_model
from jaxkv.models import gguf_tokenizer, load_gguf, render_chat
from jaxkv.models.tokenizer import max_token_bytes
from jaxkv.policies import spec
from jaxkv.policies.kvzip import context_prefix_ids
from jaxkv.train import corpus as corpus_lib
from jaxkv.train import duo_attention, fastkvzip, wgkv
from tests import gguf_files


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return gguf_files.write_tiny_qwen2(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def train_text() -> str:
    return corpus_lib.load_corpus("train").data.tobytes().decode("utf-8", errors="ignore")


def test_wgkv_rows_are_the_prefix_and_corpus_text_in_the_models_ids(gguf_path, train_text):
    tokenizer = gguf_tokenizer(gguf_path)
    spec = wgkv.GateTraining(band=32, seq_len=160, batch_size=3)
    batch = wgkv.make_batch(corpus_lib.load_corpus("train"), spec, 0, 5, tokenizer)
    again = wgkv.make_batch(corpus_lib.load_corpus("train"), spec, 0, 5, tokenizer)
    np.testing.assert_array_equal(batch["tokens"], again["tokens"])
    assert batch["tokens"].shape == (3, 160) and batch["valid"].all()
    prefix = tokenizer.encode(wgkv.PROMPT_PREFIX)
    for row in batch["tokens"]:
        assert row[: len(prefix)].tolist() == prefix
        assert tokenizer.decode(row[len(prefix) :]) in train_text
    assert len({tuple(row) for row in batch["tokens"]}) == 3


def test_token_ids_of_a_corpus_shorter_than_the_sure_bound_come_from_a_quarter_of_it(gguf_path):
    """count * max_token_bytes would not fit in the corpus: a quarter of it is encoded, and a
    count that quarter cannot hold is refused rather than cut short."""
    tokenizer = gguf_tokenizer(gguf_path)
    text = prose.prose(20_000, seed=3)
    corpus = corpus_lib.Corpus(np.frombuffer(text.encode(), np.uint8), "heldout")
    count = len(corpus.data) // 8
    assert (count + 1) * max_token_bytes(tokenizer) > len(corpus.data)
    ids = corpus.token_ids(np.random.default_rng(0), tokenizer, count)
    assert ids.shape == (count,) and tokenizer.decode(ids.tolist()) in text
    with pytest.raises(ValueError, match=r"bytes of heldout text gave \d+ < \d+ ids"):
        corpus.token_ids(np.random.default_rng(0), tokenizer, len(corpus.data) // 3)


def test_byte_level_episodes_are_refused_for_another_tokenizer(gguf_path):
    tokenizer = gguf_tokenizer(gguf_path)
    spec = wgkv.GateTraining(band=32, seq_len=512, episode_fraction=0.5)
    with pytest.raises(ValueError, match=r"episode_fraction=0.5: retrieval episodes are byte"):
        wgkv.check_model(load_gguf(gguf_path).config, spec, tokenizer)
    with pytest.raises(ValueError, match=r"episode_fraction=0.5: retrieval episodes are byte"):
        fastkvzip.contexts("train", 1, 64, 1, tokenizer, episode_fraction=0.5)


def test_fastkvzip_contexts_open_like_the_chat_prompt_kvzip_replays(gguf_path, train_text):
    tokenizer = gguf_tokenizer(gguf_path)
    prefix = list(context_prefix_ids(tokenizer))
    header = render_chat(tokenizer, [{"role": "user", "content": "MARK"}]).split("MARK")[0]
    assert tokenizer.decode(prefix, skip_special_tokens=False) == header
    for context in fastkvzip.contexts("train", 3, 200, 1, tokenizer):
        assert len(context) == 200 and context[: len(prefix)] == prefix
        assert tokenizer.decode(context[len(prefix) :]) in train_text


def test_train_wgkv_on_a_gguf_model_and_load_the_gates(gguf_path, tmp_path):
    out = tmp_path / "wgkv"
    argv = ["--model", str(gguf_path), "--out", str(out), "--steps", "2", "--seq-len", "128"]
    summary = wgkv.main([*argv, "--band", "32", "--eval-rows", "1", "--text", "docstrings"])
    assert summary["steps_done"] == 2 and summary["model"] == str(gguf_path)
    assert summary["text"] == "docstrings"
    assert json.loads((out / "run.json").read_text())["command"] == summary["command"]
    model = load_gguf(gguf_path)
    gates = policies.get("wgkv").params.load(out, model.config)
    assert gates["w1"].shape[0] == model.config.num_layers


def test_train_fastkvzip_on_a_gguf_model_and_load_the_gates(gguf_path, tmp_path):
    out, targets = tmp_path / "fkz", tmp_path / "targets.npz"
    argv = ["--model", str(gguf_path), "--targets", str(targets), "--out", str(out)]
    sizes = ["--contexts", "2", "--validation-contexts", "1", "--length", "512"]
    train = ["--steps", "2", "--warmup", "1", "--batch-tokens", "16"]
    summary = fastkvzip.main([*argv, *sizes, *train, "--gate-dim", "8", "--sinks", "4"])
    assert summary["train_tokens"] == 2 * 512 and summary["model"] == str(gguf_path)
    assert (summary["gate_dim"], summary["num_sinks"]) == (8, 4)
    model = load_gguf(gguf_path)
    gates = policies.get("fastkvzip").params.load(out, model.config)
    policies.get("fastkvzip").check_params(gates, model.config)
    assert gates["sinks"].shape[-2:] == (4, 8)


def test_policies_without_parameters_refuse_a_path(gguf_path):
    with pytest.raises(ValueError, match=r"--params snapkv=.*: policy 'snapkv' takes no param"):
        spec.parse_params([f"snapkv={gguf_path}"])
    with pytest.raises(ValueError, match=r"policy 'snapkv' takes no policy_params"):
        policies.get("snapkv", budget=0.5).check_params(
            {"w": np.zeros(2)}, load_gguf(gguf_path).config
        )


def test_copy_pairs_point_each_repeated_token_at_the_token_after_its_first_occurrence():
    tokens, half = duo_attention.repeated_halves([[9, 1, 2, 3, 4, 5], [9, 6, 7, 8, 0, 5]], 1)
    np.testing.assert_array_equal(tokens, [[9, 1, 2, 1, 2], [9, 6, 7, 6, 7]])
    keys, queries = duo_attention.copy_pairs(1, half)
    assert half == 2 and queries.tolist() == [False, False, False, True, False]
    assert np.argwhere(keys).tolist() == [[3, 2]]  # the repeated 1 (6) looks at the first 2 (7)


@pytest.mark.parametrize(("score", "text"), [("copy", "source"), ("mass", "docstrings")])
def test_duo_attention_heads_are_the_top_share_of_the_mean_score(gguf_path, tmp_path, score, text):
    out = tmp_path / "duo"
    window = ["--sinks", "2", "--window", "16"]
    argv = ["--model", str(gguf_path), "--out", str(out), "--score", score, "--share", "0.5"]
    sizes = ["--contexts", "3", "--length", "96", "--context-batch", "2", "--text", text]
    summary = duo_attention.main([*argv, *sizes, *window])
    assert summary["text"] == text
    model, tokenizer = load_model(str(gguf_path), dtype="float32")
    rows = fastkvzip.contexts("train", 3, 96, fastkvzip.TRAIN_SEED, tokenizer, text=text)
    prefix = len(context_prefix_ids(tokenizer))

    def one_context(row):  # the stage batches two contexts and then one
        if score == "mass":
            return policies.long_range_attention_mass(model, jnp.asarray([row]), sinks=2, window=16)
        tokens, half = duo_attention.repeated_halves([row], prefix)
        keys, queries = duo_attention.copy_pairs(prefix, half)
        return policies.attention_mass(model, jnp.asarray(tokens), keys, queries)

    per_context = [np.asarray(one_context(row)) for row in rows]
    expected = np.mean(per_context, axis=0)
    np.testing.assert_allclose(summary["scores"], expected, rtol=1e-5, atol=1e-7)
    assert not np.allclose(per_context[0], per_context[1])  # the contexts differ
    heads = policies.get("duo_attention").params.load(out / "heads.npy", model.config)
    np.testing.assert_array_equal(heads, policies.retrieval_heads(expected, 0.5))
    layers, kv_heads = model.config.num_layers, model.config.num_kv_heads
    assert heads.sum() == summary["retrieval_heads"] == round(0.5 * layers * kv_heads)
    run = json.loads((out / "run.json").read_text())
    assert run["command"] == summary["command"] and run["score"] == score


@pytest.mark.parametrize(
    "option, message",
    [
        (["--share", "1.0"], r"--share 1.0: the share of retrieval heads, in \(0, 1\)"),
        (["--contexts", "0"], r"--contexts 0 must be >= 1"),
        (["--length", "100"], r"--length 100 must exceed --sinks \+ --window = 260"),
    ],
)
def test_duo_attention_calibration_refuses_bad_options(tmp_path, option, message):
    with pytest.raises(ValueError, match=message):
        duo_attention.main(["--out", str(tmp_path), *option])


def test_duo_attention_copy_score_needs_the_repeat_beyond_the_window(gguf_path, tmp_path):
    argv = ["--model", str(gguf_path), "--out", str(tmp_path), "--length", "96"]
    with pytest.raises(ValueError, match=r"--length 96: the copy score .* --window 60"):
        duo_attention.main([*argv, "--sinks", "2", "--window", "60"])
    assert not (tmp_path / "heads.npy").exists()
