"""Sessions with int8 storage (Conf-KV's tier): they read on, fork into rows that share the
int8 tier's pages, save and load; each tier holds what it should after every step."""

import numpy as np
import pytest

import jaxkv
from jaxkv.cache.int8 import quantize
from jaxkv.cache.sharing import row_pages
from jaxkv.models import init_model
from jaxkv.models.configs import Family
from tests.tiny_models import tiny_config

CONFIG = tiny_config(Family.LLAMA, max_position_embeddings=512)
WINDOW, PAGE = 8, 4
PLAIN = jaxkv.CacheConfig(page_size=PAGE)
INT8 = jaxkv.CacheConfig(page_size=PAGE, storage="int8", full_precision_window=WINDOW)
ANSWER_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=3, scale=0.3)


def _ids(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length).tolist()


CONTEXT, MORE = _ids(45, 0), _ids(13, 1)
QUESTIONS = [_ids(3, 2), _ids(5, 3), _ids(11, 4)]


def _slots(pool, table) -> np.ndarray:
    """The page-aligned field `pool` [P, p, ...] per head slot through `table` [L, B, K, M]."""
    gathered = np.asarray(pool)[np.maximum(np.asarray(table), 0)]
    return gathered.reshape(*gathered.shape[:3], -1, *gathered.shape[5:])


def _tier_slots(kv, field: str):
    """(int8 tier's, model-dtype pages') `field` per head slot."""
    tier = kv.pool.int8
    return (
        _slots(getattr(tier.pool, field), tier.page_table),
        _slots(getattr(kv.pool, field), kv.page_table),
    )


def test_an_int8_session_reads_on_each_tier_holding_its_tokens(model):
    session = jaxkv.prefill(model, CONTEXT, cache=INT8)
    longer = session.extend(MORE, prefill_chunk=4)
    total = len(CONTEXT) + len(MORE)
    kv = longer.kv
    assert np.all(np.asarray(kv.lengths) == total)
    assert np.all(np.asarray(kv.pool.int8.lengths) == total - WINDOW)
    int8_positions, newest = _tier_slots(kv, "token_positions")
    for layer, head in np.ndindex(CONFIG.num_layers, CONFIG.num_kv_heads):
        np.testing.assert_array_equal(
            int8_positions[layer, 0, head, : total - WINDOW], np.arange(total - WINDOW)
        )
        np.testing.assert_array_equal(
            newest[layer, 0, head, :WINDOW], np.arange(total - WINDOW, total)
        )
    # The first layer's keys of the tokens read depend on those tokens only: those that left
    # the window are the plain session's keys quantised with the tier's channel scales.
    plain = jaxkv.prefill(model, CONTEXT, cache=PLAIN).extend(MORE, prefill_chunk=4)
    plain_keys = _slots(plain.kv.pool.k_pages, plain.kv.page_table)[0, 0]  # [K, S, H]
    read = slice(len(CONTEXT), total - WINDOW)
    expected, expected_scales = quantize(
        plain_keys[:, read], kv.pool.int8.k_channel_scales[0, 0][:, None]
    )
    tier = kv.pool.int8
    int8_keys = _slots(tier.pool.k_pages, tier.page_table)
    int8_scales = _slots(tier.pool.k_scales, tier.page_table)
    np.testing.assert_array_equal(int8_keys[0, 0][:, read], np.asarray(expected))
    np.testing.assert_allclose(int8_scales[0, 0][:, read], expected_scales, rtol=1e-6)
    # The session read is unchanged and reads on again.
    assert np.all(np.asarray(session.kv.lengths) == len(CONTEXT))
    assert jaxkv.decode(longer, ANSWER_TOKENS).tokens.shape == (1, ANSWER_TOKENS)


def test_an_int8_session_refuses_a_chunk_longer_than_its_window(model):
    session = jaxkv.prefill(model, CONTEXT, cache=INT8)
    refused = f"prefill_chunk=9 exceeds .*full_precision_window={WINDOW}"
    with pytest.raises(ValueError, match=refused):
        session.extend(MORE, prefill_chunk=9)
    with pytest.raises(ValueError, match="prefill_chunk=16 exceeds"):
        session.fork(QUESTIONS, prefill_chunk=16)


@pytest.mark.parametrize("spec", ["full", "snapkv:0.5"])
def test_forked_int8_rows_answer_as_each_question_alone_and_share_the_int8_pages(model, spec):
    session = jaxkv.prefill(model, CONTEXT, spec, cache=INT8)
    alone = [jaxkv.decode(session.extend(q), ANSWER_TOKENS).tokens[0] for q in QUESTIONS]
    rows = session.fork(QUESTIONS, reserve_tokens=ANSWER_TOKENS)
    tier = rows.kv.pool.int8
    table = np.asarray(tier.page_table)
    context_full_pages = np.asarray(session.kv.pool.int8.lengths)[:, 0] // PAGE  # [L, K]
    for row in range(1, len(QUESTIONS)):
        for layer, head in np.ndindex(context_full_pages.shape):
            shared = context_full_pages[layer, head]
            np.testing.assert_array_equal(
                table[layer, row, head, :shared], table[layer, 0, head, :shared]
            )
    shared_ids = np.unique(table[:, 0][np.isin(table[:, 0], table[:, 1]) & (table[:, 0] >= 0)])
    assert len(shared_ids) == int(np.sum(context_full_pages)) > 0
    assert row_pages(rows.kv).shared == 0  # the window's pages: one copy per row
    before = np.asarray(tier.pool.k_pages)[shared_ids]
    out = jaxkv.decode(rows, ANSWER_TOKENS)
    for i, tokens in enumerate(alone):
        np.testing.assert_array_equal(out.tokens[i], tokens, err_msg=f"row {i}")
    # After decoding, every row still reads the context's int8 tokens where it shares them.
    context = session.kv.pool.int8
    context_keys = _slots(context.pool.k_pages, context.page_table)[:, 0]  # [L, K, S, H]
    decoded = out.state.pool.int8
    decoded_keys = _slots(decoded.pool.k_pages, decoded.page_table)
    for layer, head in np.ndindex(context_full_pages.shape):
        shared = slice(0, context_full_pages[layer, head] * PAGE)
        for row in range(len(QUESTIONS)):
            np.testing.assert_array_equal(
                decoded_keys[layer, row, head, shared], context_keys[layer, head, shared]
            )
    np.testing.assert_array_equal(np.asarray(rows.kv.pool.int8.pool.k_pages)[shared_ids], before)
    # One copy of the context's int8 pages: three rows hold less than three contexts.
    assert rows.memory_bytes() < len(QUESTIONS) * session.memory_bytes()
    asked = jaxkv.ask(model, session, QUESTIONS, max_new_tokens=ANSWER_TOKENS)
    np.testing.assert_array_equal(asked.answers.tokens, out.tokens)
    int8_page_bytes = session.kv.pool.int8.pool.page_bytes
    assert asked.shared_bytes == int(np.sum(context_full_pages)) * int8_page_bytes
    assert asked.total_bytes == int(asked.answers.memory_bytes[-1])


def test_a_saved_int8_session_loads_reads_on_and_forks_as_before(model, tmp_path):
    session = jaxkv.prefill(model, CONTEXT, "snapkv:0.5", cache=INT8)
    path = jaxkv.save_session(session, tmp_path / "doc")
    loaded = jaxkv.load_session(path, model, "snapkv:0.5")
    assert loaded.memory_bytes() == session.memory_bytes()
    assert loaded.kv.pool.int8.pool.num_pages == session.kv.pool.int8.pool.num_pages
    np.testing.assert_array_equal(loaded.kv.positions(), session.kv.positions())
    np.testing.assert_array_equal(
        jaxkv.decode(loaded.extend(MORE), ANSWER_TOKENS).tokens,
        jaxkv.decode(session.extend(MORE), ANSWER_TOKENS).tokens,
    )
    np.testing.assert_array_equal(
        jaxkv.decode(loaded.fork(QUESTIONS), ANSWER_TOKENS).tokens,
        jaxkv.decode(session.fork(QUESTIONS), ANSWER_TOKENS).tokens,
    )
    plain = jaxkv.prefill(model, CONTEXT, "snapkv:0.5", cache=PLAIN)
    assert session.memory_bytes() < plain.memory_bytes()
