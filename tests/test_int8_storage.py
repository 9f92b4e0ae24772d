"""Int8 mixed-precision storage: quantisation bound, attention over both tiers, transitions,
memory accounting, eviction through the merged slot view, bad input."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.cache.int8 import quantize, start_int8
from jaxkv.models import init_model
from jaxkv.models.configs import Family
from jaxkv.step.layer import attend_and_write, int8_tier_attention
from tests.tiny_models import tiny_config

CONFIG = tiny_config(Family.LLAMA, max_position_embeddings=512)
WINDOW, PAGE = 8, 4
PAGES = jaxkv.CacheConfig(page_size=PAGE)
INT8 = jaxkv.CacheConfig(page_size=PAGE, storage="int8", full_precision_window=WINDOW)


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=3, scale=0.3)


@pytest.fixture(scope="module")
def generated(model):
    """A full cache with int8 storage after a 21-token prompt and 6 generated tokens."""
    return jaxkv.generate(model, _prompts([21]), max_new_tokens=6, cache=INT8)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths]


def _tier_positions(kv):
    """(int8 positions, model-dtype positions) per head slot, from the raw pools."""
    tier = kv.pool.int8
    int8 = np.asarray(tier.pool.token_positions)[np.maximum(np.asarray(tier.page_table), 0)]
    full = np.asarray(kv.pool.token_positions)[np.maximum(np.asarray(kv.page_table), 0)]
    return int8.reshape(*int8.shape[:3], -1), full.reshape(*full.shape[:3], -1)


def test_round_trip_error_within_symmetric_int8_bound():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 2, 40, 16)).astype(np.float32)
    x[..., 5] *= 30.0  # an outlier channel, as keys have
    channel = np.abs(x).max(axis=2, keepdims=True)  # per (sequence, head, channel)
    q, token_scales = quantize(jnp.asarray(x), jnp.asarray(channel))
    q, token_scales = np.asarray(q), np.asarray(token_scales)
    assert q.dtype == np.int8 and np.abs(q.astype(int)).max() <= 127
    scale = token_scales[..., None] * channel  # per (sequence, head, token, channel)
    error = np.abs(x - q.astype(np.float32) * scale)
    assert np.all(error <= scale / 2 * (1 + 1e-5))
    # A token larger than the channel scales is not clipped: its own scale grows.
    big = 5 * x[:, :, :1]
    q_big, t_big = quantize(jnp.asarray(big), jnp.asarray(channel))
    deq = np.asarray(q_big).astype(np.float32) * np.asarray(t_big)[..., None] * channel
    assert np.all(np.abs(big - deq) <= np.asarray(t_big)[..., None] * channel / 2 * (1 + 1e-5))


@pytest.fixture(scope="module")
def prompt_state(model):
    """The model-dtype state after the same 21-token prompt."""
    return jaxkv.compress_prompt(model, _prompts([21]), cache=PAGES, reserve_tokens=8)


def test_tokens_move_to_int8_exactly_when_they_leave_the_window(prompt_state, generated):
    kv = start_int8(prompt_state, WINDOW)
    int8_pos, full_pos = _tier_positions(kv)
    n8 = np.asarray(kv.pool.int8.lengths)
    assert np.all(n8 == 21 - WINDOW) and np.all(np.asarray(kv.lengths) == 21)
    for layer, head in np.ndindex(2, 2):
        np.testing.assert_array_equal(int8_pos[layer, 0, head, :13], np.arange(13))
        np.testing.assert_array_equal(full_pos[layer, 0, head, :WINDOW], np.arange(13, 21))
    merged = np.asarray(kv.positions())
    np.testing.assert_array_equal(merged[..., :21], np.broadcast_to(np.arange(21), (2, 1, 2, 21)))
    assert np.all(merged[..., 21:] == -1)

    # Each decode step moves exactly the token that leaves the newest-WINDOW window.
    kv = generated.state
    total = 21 + 5
    int8_pos, full_pos = _tier_positions(kv)
    assert np.all(np.asarray(kv.pool.int8.lengths) == total - WINDOW)
    np.testing.assert_array_equal(int8_pos[0, 0, 0, : total - WINDOW], np.arange(total - WINDOW))
    np.testing.assert_array_equal(full_pos[0, 0, 0, :WINDOW], np.arange(total - WINDOW, total))


def test_int8_values_are_the_quantised_model_dtype_keys(prompt_state):
    full = prompt_state
    int8 = start_int8(full, WINDOW)
    tier = int8.pool.int8
    table = np.asarray(tier.page_table)[0, 0, 1]
    q = np.asarray(tier.pool.k_pages)[table].reshape(-1, 16)[:13]
    t = np.asarray(tier.pool.k_scales)[table].reshape(-1)[:13]
    c = np.asarray(tier.k_channel_scales)[0, 0, 1]
    keys = np.asarray(full.pool.k_pages)[np.asarray(full.page_table)[0, 0, 1]].reshape(-1, 16)
    np.testing.assert_allclose(c, np.abs(keys[:21]).max(0), rtol=1e-6)
    assert np.all(np.abs(keys[:13] - q * t[:, None] * c) <= t[:, None] * c / 2 * (1 + 1e-5))


def _numpy_attention(q, keys, values, sm_scale):
    """q [N, C, H] over keys/values [K, S, H] (every key visible), f64."""
    group = q.shape[0] // keys.shape[0]
    out = np.zeros(q.shape)
    for n in range(q.shape[0]):
        scores = q[n] @ keys[n // group].T * sm_scale
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[n] = (probs / probs.sum(-1, keepdims=True)) @ values[n // group]
    return out


def test_attention_over_both_tiers_equals_dense_reference_on_dequantised_values(model):
    lengths = [23, 14]
    kv = jaxkv.compress_prompt(
        model,
        _prompts(lengths, seed=1),
        policies.FullCache(),
        cache=INT8,
        reserve_tokens=4,
    )
    tier, layer = kv.pool.int8, 1
    rng = np.random.default_rng(2)
    q = rng.normal(size=(2, 4, 1, 16)).astype(np.float32)
    k_new = rng.normal(size=(2, 2, 1, 16)).astype(np.float32)
    v_new = rng.normal(size=(2, 2, 1, 16)).astype(np.float32)
    positions = np.array([[23], [14]], np.int32)
    out, pool, page_table, step_lengths, _ = attend_and_write(
        kv.pool,
        kv.page_table[layer],
        kv.lengths[layer],
        jnp.asarray(q),
        jnp.asarray(k_new),
        jnp.asarray(v_new),
        jnp.asarray(positions),
        layer=jnp.asarray(layer),
        sm_scale=0.25,
        policy=policies.FullCache().static(),
        backend="xla",
    )

    # The spill comes before the reads: the token the write pushed out of the window is read
    # from the int8 tier, dequantised; the chunk, the window's last slot, is read as itself.
    tier = pool.int8
    moved = np.asarray(tier.lengths[layer]) - np.asarray(kv.pool.int8.lengths[layer])
    assert np.all(moved == 1)

    def dequantised(pages, token_scales, channel, b, h):
        table = np.asarray(tier.page_table)[layer, b, h]
        n = int(tier.lengths[layer, b, h])
        raw = np.asarray(pages)[table].reshape(-1, 16)[:n].astype(np.float64)
        scales = np.asarray(token_scales)[table].reshape(-1)[:n, None]
        return raw * scales * np.asarray(channel)[layer, b, h]

    def full_precision(pages, b, h):
        n = int(step_lengths[b, h] - tier.lengths[layer, b, h]) - 1  # without the chunk
        return np.asarray(pages)[np.asarray(page_table)[b, h]].reshape(-1, 16)[:n]

    def held_tokens(kind, new, b, h):  # int8 tier, model-dtype window, the chunk: [n, H]
        int8 = dequantised(
            getattr(tier.pool, f"{kind}_pages"),
            getattr(tier.pool, f"{kind}_scales"),
            getattr(tier, f"{kind}_channel_scales"),
            b,
            h,
        )
        window = full_precision(getattr(pool, f"{kind}_pages"), b, h)
        assert len(int8) + len(window) == int(kv.lengths[layer, b, h])  # every cached token
        return np.concatenate([int8, window, new[b, h]])

    for b in range(2):
        keys = [held_tokens("k", k_new, b, h) for h in range(2)]
        values = [held_tokens("v", v_new, b, h) for h in range(2)]
        expected = _numpy_attention(q[b].astype(np.float64), np.stack(keys), np.stack(values), 0.25)
        np.testing.assert_allclose(np.asarray(out)[b], expected, atol=1e-5, rtol=1e-5)

    # The decode kernels (interpreted: Triton's, Mosaic's) dequantise the same pages to the
    # same result.
    xla, *kernels = [
        int8_tier_attention(
            tier, jnp.asarray(q), layer, sm_scale=0.25, return_probs=True, backend=backend
        )
        for backend in ("xla", "interpret", "interpret-tpu")
    ]
    for read in kernels:
        for want, got in zip(xla, read, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_a_chunk_longer_than_the_window_is_refused(model):
    kv = jaxkv.compress_prompt(model, _prompts([20]), cache=INT8, reserve_tokens=WINDOW + 1)
    c = WINDOW + 1
    with pytest.raises(ValueError, match=f"full_precision_window >= {c}"):
        attend_and_write(
            kv.pool,
            kv.page_table[0],
            kv.lengths[0],
            jnp.zeros((1, 4, c, 16)),
            jnp.zeros((1, 2, c, 16)),
            jnp.zeros((1, 2, c, 16)),
            jnp.arange(20, 20 + c)[None],
            layer=0,
            sm_scale=0.25,
            policy=policies.FullCache().static(),
            backend="xla",
        )


def test_memory_bytes_count_int8_bytes_and_scales(generated):
    kv = generated.state
    tier = kv.pool.int8
    # int8 keys and values, f32 token scales for each, int32 position and f32 score per token.
    assert tier.pool.page_bytes == PAGE * 16 * 2 + PAGE * 4 * 2 + PAGE * (4 + 4)
    channel_scales = 2 * 2 * 1 * 2 * 16 * 4  # f32 [L, B, K, H] for keys and values
    expected = (
        int(kv.pages_in_use()) * kv.pool.page_bytes
        + int(tier.pages_in_use()) * tier.pool.page_bytes
        + channel_scales
    )
    assert kv.memory_bytes() == expected == generated.memory_bytes[-1]
    heads, total = 2 * 2, 21 + 5
    assert int(kv.pages_in_use()) == heads * -(-WINDOW // PAGE)
    assert int(tier.pages_in_use()) == heads * -(-(total - WINDOW) // PAGE)
    # Every step's record: model-dtype pages for at most WINDOW + 1 tokens, the rest int8.
    assert np.all(generated.pages_in_use <= heads * -(-(WINDOW + 1) // PAGE))
    float_bytes = heads * -(-total // PAGE) * kv.pool.page_bytes
    assert generated.memory_bytes[-1] < 0.7 * float_bytes


def test_eviction_sees_one_slot_space_across_tiers(model):
    """Positional eviction keeps the same positions with and without int8 storage."""
    prompt = _prompts([30, 19], seed=4)
    for policy in (policies.ConfKV(tight=12, loose=12, protected=4, tau=0.0, alpha=0.0),):
        plain = jaxkv.generate(model, prompt, max_new_tokens=10, policy=policy, cache=PAGES)
        int8 = dataclasses.replace(INT8, full_precision_window=6)
        mixed = jaxkv.generate(model, prompt, max_new_tokens=10, policy=policy, cache=int8)
        np.testing.assert_array_equal(
            np.sort(np.asarray(plain.state.positions()), -1)[..., -20:],
            np.sort(np.asarray(mixed.state.positions()), -1)[..., -20:],
        )
        assert np.all(np.asarray(mixed.state.pool.int8.lengths) > 0)
        full_held = np.asarray(mixed.state.full_precision_lengths())
        assert np.all(full_held <= 6) and np.all(full_held > 0)


def test_h2o_mass_accumulates_over_both_tiers(model):
    prompt = _prompts([30])
    policy = policies.H2O(budget=24, evict_every=1)
    int8 = dataclasses.replace(INT8, full_precision_window=6)
    out = jaxkv.generate(model, prompt, max_new_tokens=6, policy=policy, cache=int8)
    scores = np.asarray(out.state.token_scores())
    held = np.asarray(out.state.positions()) >= 0
    assert np.all(np.asarray(out.state.lengths) == 24)
    assert np.all(scores[held] > 0)


def test_bad_storage_options_raise(model):
    prompt = _prompts([10])
    with pytest.raises(ValueError, match="kv_dtype=.*float dtype"):
        jaxkv.CacheConfig(storage="int8", kv_dtype=jnp.int8)
    with pytest.raises(ValueError, match="storage='fp4'"):
        jaxkv.CacheConfig(storage="fp4")
    with pytest.raises(ValueError, match="full_precision_window"):
        jaxkv.CacheConfig(storage="int8", full_precision_window=0)
    with pytest.raises(ValueError, match="selects pages"):
        jaxkv.generate(model, prompt, max_new_tokens=2, policy=policies.Quest(budget=8), cache=INT8)


def test_a_cache_smaller_than_the_window_decodes_with_an_empty_int8_tier(model):
    # SnapKV keeps 16 tokens per head, fewer than the 32-token window: nothing is quantised,
    # and the (empty) int8 tier must still be readable during decode.
    prompt = _prompts([80])
    policy = policies.SnapKV(budget=16, window=8)
    int8 = dataclasses.replace(INT8, full_precision_window=32)
    out = jaxkv.generate(model, prompt, max_new_tokens=5, policy=policy, cache=int8)
    plain = jaxkv.generate(model, prompt, max_new_tokens=5, policy=policy, cache=PAGES)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    assert np.all(out.int8_pages_in_use == 0)


def test_int8_storage_is_a_cache_choice_not_a_policy_field():
    for name, extra in (("snapkv", dict(budget=0.3)), ("confkv", {}), ("wgkv", {})):
        with pytest.raises(ValueError, match="has no field 'storage'"):
            policies.get(name, **extra, storage="int8")
