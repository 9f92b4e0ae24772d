"""Sessions: prefill once, extend, fork into rows that share the context's pages, decode (and
decode again); `ask` answers as each question asked alone over the same compressed context."""

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxkv
from jaxkv import Sampler, bundled, policies, prose
from jaxkv.cache.sharing import row_pages
from jaxkv.models import load_hf_checkpoint
from jaxkv.models.configs import Family
from jaxkv.policies.kvzip import byte_ids
from tests import gguf_files
from tests.tiny_models import tiny_config

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL)


def text_ids(text: str) -> list[int]:
    """The bundled byte-level model's ids of `text`."""
    return list(text.encode())


CONTEXT = text_ids(" ".join(prose.paragraphs()[:3])[:700])
QUESTIONS = [text_ids(q) for q in ("\nIn short, ", "\nThe answer is that the ", "\nSo ")]
ANSWER_TOKENS = 10


def loaded(policy: policies.Policy, model):
    """(policy, its bundled parameters for the reference model, or None)."""
    if policy.params is None:
        return policy, None
    path = policy.params.shipped_path(bundled.REFERENCE)
    return policy, None if path is None else policy.params.load(path, model.config)


# The full cache and policies that compress the prompt and evict nothing within ANSWER_TOKENS
# decode steps, one of each kind of kept state: the same count on every head (SnapKV), a budget
# split unevenly over heads (AdaKV), KVzip's replay, votes (GVote), a learned sink gate (Fast
# KVzip), a learned write gate with a local ring (WG-KV). Those that evict on every step are
# refused on shared pages (below).
SHARING_POLICIES = ["full", "snapkv", "adakv", "kvzip", "gvote", "fastkvzip", "wgkv"]


def build(name: str, model):
    kwargs = {} if name in ("full", "gvote", "wgkv") else {"budget": 0.3}
    return loaded(policies.get(name, **kwargs), model)


@pytest.mark.parametrize("name", SHARING_POLICIES)
def test_ask_answers_as_each_question_alone_over_one_shared_context(model, name):
    policy, params = build(name, model)
    session = jaxkv.prefill(model, CONTEXT, policy, policy_params=params)
    alone = [jaxkv.decode(session.extend(q), ANSWER_TOKENS) for q in QUESTIONS]
    out = jaxkv.ask(model, session, QUESTIONS, max_new_tokens=ANSWER_TOKENS)
    for i, single in enumerate(alone):
        np.testing.assert_array_equal(out.answers.tokens[i], single.tokens[0], err_msg=f"row {i}")
    # One copy of the context: the rows' tables name the same full pages.
    pages = row_pages(out.answers.state)
    p = session.kv.pool.page_size
    context_full_pages = int(np.sum(np.asarray(session.kv.lengths) // p))
    assert pages.shared == context_full_pages > 0
    assert out.total_bytes == int(out.answers.memory_bytes[-1])
    assert out.separate_bytes == out.total_bytes + (len(QUESTIONS) - 1) * out.shared_bytes
    # Each row holds its own pages only for its tails, question and answer.
    heads = model.config.num_layers * model.config.num_kv_heads
    longest = max(map(len, QUESTIONS)) + ANSWER_TOKENS
    assert np.all(pages.own <= heads * (-(-(longest + p - 1) // p)))


def test_a_session_decodes_twice_and_stays_valid(model):
    session = jaxkv.prefill(model, CONTEXT, "snapkv:0.3").extend(QUESTIONS[1])
    greedy = jaxkv.decode(session, ANSWER_TOKENS)
    again = jaxkv.decode(session, ANSWER_TOKENS)
    np.testing.assert_array_equal(greedy.tokens, again.tokens)
    sampled = jaxkv.decode(
        session, ANSWER_TOKENS, sampler=Sampler(temperature=5.0), key=jax.random.PRNGKey(3)
    )
    assert not np.array_equal(sampled.tokens, greedy.tokens)
    np.testing.assert_array_equal(jaxkv.decode(session, ANSWER_TOKENS).tokens, greedy.tokens)
    assert (
        session.memory_bytes()
        == jaxkv.prefill(model, CONTEXT, "snapkv:0.3").extend(QUESTIONS[1]).memory_bytes()
    )


def test_generate_is_decode_of_prefill(model):
    prompt = CONTEXT + QUESTIONS[0]
    out = jaxkv.generate(model, [prompt], max_new_tokens=ANSWER_TOKENS, policy="kvzip:0.3")
    key = jax.random.split(jax.random.PRNGKey(0))[0]  # generate's prefill key
    session = jaxkv.prefill(model, [prompt], "kvzip:0.3", key=key)
    np.testing.assert_array_equal(
        out.tokens, jaxkv.decode(session, ANSWER_TOKENS, key=jax.random.PRNGKey(0)).tokens
    )
    assert np.array_equal(
        np.asarray(jaxkv.compress_prompt(model, [prompt], "kvzip:0.3", key=key).lengths),
        np.asarray(session.kv.lengths),
    )


@pytest.mark.parametrize("name", ["full", "local_attention"])
def test_extending_a_prompt_reads_it_as_prefilling_it_whole(model, name):
    """Without prompt compression, reading a prompt in two parts (the second ragged over two
    rows, in small chunks) holds the same tokens and decodes the same answer."""
    policy = policies.get(name) if name == "full" else policies.get(name, window=32, sinks=4)
    heads, tails = CONTEXT[:300], [CONTEXT[300:], CONTEXT[300:520]]
    whole = jaxkv.prefill(model, [heads + tail for tail in tails], policy)
    parts = jaxkv.prefill(model, [heads, heads], policy).extend(tails, prefill_chunk=64)
    np.testing.assert_array_equal(parts.lengths, whole.lengths)
    slots = min(parts.kv.max_tokens_per_head, whole.kv.max_tokens_per_head)
    for kv in (parts.kv, whole.kv):
        assert np.all(np.asarray(kv.positions())[..., slots:] == -1)
    np.testing.assert_array_equal(
        parts.kv.positions()[..., :slots], whole.kv.positions()[..., :slots]
    )
    np.testing.assert_array_equal(
        jaxkv.decode(parts, ANSWER_TOKENS).tokens, jaxkv.decode(whole, ANSWER_TOKENS).tokens
    )


def test_extend_with_logits_scores_each_token_as_a_longer_prefill():
    model = load_hf_checkpoint(bundled.REFERENCE_MODEL, dtype="float32")
    session = jaxkv.prefill(model, CONTEXT[:200], "full")
    _, logits = jaxkv.generation.extend_with_logits(session, CONTEXT[200:260])
    reference = jaxkv.prefill(model, CONTEXT[:230], "full")
    expected = jaxkv.models.decoder.logits_from_hidden(
        model.params, model.config, reference.last_hidden
    )
    np.testing.assert_allclose(logits[0, 29], expected[0], atol=2e-4, rtol=2e-4)


def test_forked_rows_never_write_the_shared_pages(model):
    session = jaxkv.prefill(model, CONTEXT, "snapkv:0.3")
    rows = session.fork(QUESTIONS, reserve_tokens=ANSWER_TOKENS)
    shared = row_pages(rows.kv).shared
    table = np.asarray(rows.kv.page_table)
    shared_ids = np.unique(table[:, 0][np.isin(table[:, 0], table[:, 1]) & (table[:, 0] >= 0)])
    assert len(shared_ids) == shared > 0
    before = np.asarray(rows.kv.pool.k_pages)[shared_ids]
    out = jaxkv.decode(rows, ANSWER_TOKENS)
    if out.state.pool.num_pages == rows.kv.pool.num_pages:  # decoded in the fork's own pool
        np.testing.assert_array_equal(np.asarray(out.state.pool.k_pages)[shared_ids], before)
    after = jaxkv.decode(rows, ANSWER_TOKENS)
    np.testing.assert_array_equal(after.tokens, out.tokens)
    np.testing.assert_array_equal(np.asarray(rows.kv.pool.k_pages)[shared_ids], before)


@pytest.mark.parametrize("name", ["h2o", "confkv"])
def test_decode_eviction_on_shared_pages_is_refused_and_the_session_stays_usable(model, name):
    policy = policies.get(name) if name == "confkv" else policies.get(name, budget=0.3)
    rows = jaxkv.prefill(model, CONTEXT, policy).fork(QUESTIONS[:2])
    interval = policy.decode_eviction.decode_interval
    with pytest.raises(ValueError, match=f"policy '{name}' evicts during decode.*share"):
        jaxkv.decode(rows, interval + 1)
    assert jaxkv.decode(rows, interval).tokens.shape == (2, interval)


def test_bad_questions_and_sessions_are_refused_before_compiling(model):
    session = jaxkv.prefill(model, CONTEXT[:200], "snapkv:0.5")
    with pytest.raises(ValueError, match="non-empty list"):
        jaxkv.ask(model, session, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="question 1 is empty"):
        session.fork([[1, 2], []])
    with pytest.raises(ValueError, match="one context: this session has 2 rows"):
        jaxkv.prefill(model, [CONTEXT[:32], CONTEXT[:40]]).fork([[1]])
    too_long = [1] * model.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings=8192"):
        session.fork([too_long])
    with pytest.raises(ValueError, match="exceed the model's max_position_embeddings"):
        jaxkv.decode(session, model.config.max_position_embeddings)
    with pytest.raises(ValueError, match=r"outside the token ids \[0, 259\)"):
        session.extend([300])
    other = jaxkv.models.init_model(tiny_config(Family.LLAMA, vocab_size=259), seed=0)
    with pytest.raises(ValueError, match="another model"):
        jaxkv.ask(other, session, [[1]], max_new_tokens=2)
    # Nothing was lost: the session still answers.
    assert jaxkv.ask(model, session, [[32]], max_new_tokens=2).answers.tokens.shape == (1, 2)


def test_a_session_on_a_mesh_decodes_as_on_one_device(model):
    mesh = jaxkv.sharding.make_inference_mesh(data=2, model=2)
    prompts = [CONTEXT[:300], CONTEXT[:260]]
    one = jaxkv.prefill(model, prompts, "snapkv:0.5").extend(QUESTIONS[:2])
    many = jaxkv.prefill(model, prompts, "snapkv:0.5", mesh=mesh).extend(QUESTIONS[:2])
    np.testing.assert_array_equal(
        jaxkv.decode(many, ANSWER_TOKENS).tokens, jaxkv.decode(one, ANSWER_TOKENS).tokens
    )


def test_a_saved_session_loads_in_another_process_and_answers_the_same(model, tmp_path):
    import subprocess
    import sys

    policy, params = build("wgkv", model)
    session = jaxkv.prefill(model, CONTEXT, policy, policy_params=params)
    jaxkv.save_session(session, tmp_path / "doc")
    expected = jaxkv.decode(session.extend(QUESTIONS[0]), ANSWER_TOKENS).tokens
    script = (
        "import numpy as np, jaxkv\n"
        "from jaxkv import bundled, policies\n"
        "from jaxkv.models import load_hf_checkpoint\n"
        "model = load_hf_checkpoint(bundled.REFERENCE_MODEL)\n"
        f"session = jaxkv.load_session({str(tmp_path / 'doc')!r}, model, policies.get('wgkv'))\n"
        f"out = jaxkv.decode(session.extend({QUESTIONS[0]!r}), {ANSWER_TOKENS})\n"
        "print(out.tokens[0].tolist())\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    assert run.stdout.strip().splitlines()[-1] == str(expected[0].tolist())


def test_a_saved_session_refuses_another_model_or_policy(model, tmp_path):
    session = jaxkv.prefill(model, CONTEXT[:200], "snapkv:0.5")
    path = jaxkv.save_session(session, tmp_path / "doc")
    with pytest.raises(ValueError, match="exists"):
        jaxkv.save_session(session, path)
    with pytest.raises(ValueError, match=r"SnapKV policy: budget.ratio \(saved 0.5, given 0.4\)"):
        jaxkv.load_session(path, model, "snapkv:0.4")
    with pytest.raises(ValueError, match="saved with policy SnapKV, not H2O"):
        jaxkv.load_session(path, model, "h2o:0.5")
    other = dataclasses_replace_first_weight(model)
    with pytest.raises(ValueError, match="saved with another model"):
        jaxkv.load_session(path, other, "snapkv:0.5")
    loaded = jaxkv.load_session(path, model, "snapkv:0.5")
    np.testing.assert_array_equal(jaxkv.decode(loaded, 4).tokens, jaxkv.decode(session, 4).tokens)
    assert loaded.memory_bytes() == session.memory_bytes()


def dataclasses_replace_first_weight(model):
    """The model with one parameter changed by one ulp-sized step (same config, other params)."""
    params = jax.tree.map(lambda x: x, model.params)
    params["embed"] = params["embed"].at[0, 0].add(1)
    return model.replace(params=params)


def saved_array_bytes(path: Path) -> int:
    """Bytes of the arrays a saved session's checkpoint holds."""
    arrays = ocp.PyTreeCheckpointer().restore(path / "arrays")
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(arrays))


@pytest.mark.parametrize("spec", ["kvzip:0.3", "quest:0.3"])
def test_a_saved_session_holds_its_pages_only_and_reads_on_as_before(model, tmp_path, spec):
    session = jaxkv.prefill(model, CONTEXT, spec)
    path = jaxkv.save_session(session, tmp_path / "doc")
    kv, held = session.kv, session.memory_bytes()
    heads = kv.num_layers * kv.page_table.shape[-2]
    metadata = kv.page_table.nbytes + session.last_hidden.nbytes
    assert held <= saved_array_bytes(path) <= held + heads * kv.pool.page_bytes + metadata
    loaded = jaxkv.load_session(path, model, spec)
    assert loaded.kv.pool.num_pages == kv.pool.num_pages and loaded.memory_bytes() == held
    np.testing.assert_array_equal(
        jaxkv.decode(loaded.extend(QUESTIONS[0]), ANSWER_TOKENS).tokens,
        jaxkv.decode(session.extend(QUESTIONS[0]), ANSWER_TOKENS).tokens,
    )
    if spec.startswith("kvzip"):  # rows sharing pages: saved once, loaded shared
        rows = session.fork(QUESTIONS)
        loaded_rows = jaxkv.load_session(jaxkv.save_session(rows, tmp_path / "rows"), model, spec)
        assert loaded_rows.memory_bytes() == rows.memory_bytes()
        np.testing.assert_array_equal(
            jaxkv.decode(loaded_rows, ANSWER_TOKENS).tokens,
            jaxkv.decode(rows, ANSWER_TOKENS).tokens,
        )


def test_a_kvzip_session_loaded_with_other_repeat_prompts_names_them_and_the_fix(model, tmp_path):
    fitted = policies.get(
        "kvzip", budget=0.3, repeat_ids=byte_ids("\n\nRepeat."), continue_ids=byte_ids("\n\nOn.")
    )
    path = jaxkv.save_session(jaxkv.prefill(model, CONTEXT[:200], fitted), tmp_path / "doc")
    with pytest.raises(ValueError) as refused:
        jaxkv.load_session(path, model, "kvzip:0.3")
    message = str(refused.value)
    assert "KVzip policy: repeat_ids, continue_ids differ" in message
    assert "policy.for_tokenizer(tokenizer)" in message and len(message) < 400


def readme_session_snippet() -> str:
    """The Python block of the README's "Compress once, ask many" section."""
    section = README.read_text().split("### Compress once, ask many")[1].split("\n### ")[0]
    return section.split("```python\n")[1].split("```")[0]


def test_the_readme_session_snippet_runs_as_written_on_a_chat_model(tmp_path, monkeypatch):
    """The snippet, with a tiny GGUF model (its own BPE tokenizer and ChatML template) in place
    of SmolLM2: KVzip fitted to the tokenizer, the chat halves, the reloaded session."""
    gguf = gguf_files.write_tiny_qwen2(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.txt").write_text(" ".join(prose.paragraphs()[:3])[:400])
    snippet = readme_session_snippet()
    assert '"smollm2-135m-instruct"' in snippet
    names = {}
    exec(snippet.replace('"smollm2-135m-instruct"', repr(str(gguf))), names)
    tok, q1 = names["tok"], names["q1"]
    context = tok.decode(names["context_ids"], skip_special_tokens=False)
    assert context.startswith("<|im_start|>user\n")
    assert tok.decode(q1, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert names["asked"].answers.tokens.shape == (2, 32)
    np.testing.assert_array_equal(
        jaxkv.decode(names["session"].extend(q1), 32).tokens, names["out"].tokens
    )


def test_a_session_extended_past_its_budget_decodes_through_its_first_eviction(model):
    """StreamingLLM keeps 1/8 of a 2.8K-token context and evicts every 64 steps: a 128-token
    question read over it leaves every head over its budget as decoding starts, which the decode
    pool must hold until the first eviction (sized from the budget alone, the pool ran out)."""
    context = (CONTEXT * 4)[:2800]
    policy = policies.get("streaming_llm", budget=0.125, evict_every=64)
    session = jaxkv.prefill(model, [context], policy).extend([context[:128]])
    out = jaxkv.decode(session, 64, stop_tokens=[])
    assert int(out.num_tokens[0]) == 64
    whole = jaxkv.decode(jaxkv.prefill(model, [context + context[:128]]), 64, stop_tokens=[])
    assert out.pages_in_use.max() < whole.pages_in_use.min() / 2
