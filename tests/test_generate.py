"""generate(): sampling, stop tokens, per-step KV statistics, compress_prompt, and bad input."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import Sampler, policies
from jaxkv.models import ModelConfig, init_model
from jaxkv.models.configs import Family
from jaxkv.sampling import sample_rows

CONFIG = ModelConfig(
    family=Family.QWEN3,
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def model():
    # A larger init scale than usual gives peaked, varied next-token distributions.
    return init_model(CONFIG, seed=0, scale=0.5)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2]]


def test_sampler_top_k_and_top_p_restrict_the_support():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 2000)

    def draws(sampler):
        rows = jnp.repeat(logits, len(keys), axis=0)
        return np.asarray(sample_rows(rows, keys, sampler.rows(len(keys))))

    assert set(draws(Sampler(temperature=1.0, top_k=2))) == {0, 1}
    assert set(draws(Sampler(temperature=1.0, top_p=0.79))) == {0, 1}  # 0.5 + 0.3 crosses 0.79
    assert set(draws(Sampler(temperature=1.0, top_p=0.81))) == {0, 1, 2}
    counts = np.bincount(draws(Sampler(temperature=1.0)), minlength=4) / len(keys)
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.04)
    assert set(draws(Sampler(temperature=1.0, top_k=1))) == {0}
    assert int(sample_rows(logits, keys[:1], Sampler().rows(1))[0]) == 0


def test_sampler_rejects_bad_settings():
    with pytest.raises(ValueError, match="temperature=-1"):
        Sampler(temperature=-1)
    with pytest.raises(ValueError, match="top_p=1.5"):
        Sampler(temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="top_k=0"):
        Sampler(temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="need temperature > 0"):
        Sampler(top_k=3)


def test_sampling_is_reproducible_per_key(model):
    sampler = Sampler(temperature=1.0)

    def run(seed):
        return jaxkv.generate(
            model,
            PROMPTS,
            max_new_tokens=12,
            sampler=sampler,
            key=jax.random.PRNGKey(seed),
            stop_tokens=(),
        ).tokens

    np.testing.assert_array_equal(run(1), run(1))
    assert not np.array_equal(run(1), run(2))
    greedy = jaxkv.generate(model, PROMPTS, max_new_tokens=12, stop_tokens=()).tokens
    top1 = jaxkv.generate(
        model,
        PROMPTS,
        max_new_tokens=12,
        stop_tokens=(),
        sampler=Sampler(temperature=0.7, top_k=1),
        key=jax.random.PRNGKey(3),
    )
    np.testing.assert_array_equal(top1.tokens, greedy)


def test_stop_tokens_end_each_sequence(model):
    free = jaxkv.generate(model, PROMPTS, max_new_tokens=10, stop_tokens=()).tokens
    stop = int(free[0, 3])
    first = int(np.argmax(free[0] == stop))
    out = jaxkv.generate(model, PROMPTS, max_new_tokens=10, stop_tokens=(stop,), pad_id=-7)
    assert out.num_tokens[0] == first + 1
    np.testing.assert_array_equal(out.tokens[0, : first + 1], free[0, : first + 1])
    assert np.all(out.tokens[0, first + 1 :] == -7)
    row1_stops = np.flatnonzero(free[1] == stop)
    n1 = row1_stops[0] + 1 if len(row1_stops) else 10
    assert out.num_tokens[1] == n1
    np.testing.assert_array_equal(out.tokens[1, :n1], free[1, :n1])


def test_per_step_kv_statistics(model):
    page_size = 4
    out = jaxkv.generate(
        model,
        PROMPTS,
        max_new_tokens=9,
        stop_tokens=(),
        cache=jaxkv.CacheConfig(page_size=page_size),
    )
    lengths = np.array([len(p) for p in PROMPTS])
    heads = CONFIG.num_layers * CONFIG.num_kv_heads
    # Entry s: after s decode steps, each sequence holds its prompt plus s generated tokens.
    expected = [heads * int(np.sum(-(-(lengths + s) // page_size))) for s in range(9)]
    np.testing.assert_array_equal(out.pages_in_use, expected)
    np.testing.assert_array_equal(out.memory_bytes, np.array(expected) * out.state.pool.page_bytes)
    assert out.state.memory_bytes() == out.memory_bytes[-1]


def test_compress_prompt_full_keeps_every_position(model):
    state = jaxkv.compress_prompt(
        model, PROMPTS, policies.get("full"), cache=jaxkv.CacheConfig(page_size=4)
    )
    for layer in range(CONFIG.num_layers):
        positions = np.asarray(state.positions(layer))
        for row, prompt in enumerate(PROMPTS):
            for head in range(CONFIG.num_kv_heads):
                kept = positions[row, head][positions[row, head] >= 0]
                np.testing.assert_array_equal(kept, np.arange(len(prompt)))


@dataclasses.dataclass(frozen=True)
class _KeepAllButNotFull(policies.Policy):
    name: ClassVar[str] = "test-keep-all"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(prompt_ids=[[1, 2], []]), ValueError, "prompt 1 is empty"),
        (dict(prompt_ids=[]), ValueError, "non-empty"),
        (dict(prompt_ids=[[1, 2, 99]]), ValueError, r"outside \[0, vocab_size=50\)"),
        (dict(prompt_ids=[list(range(40)) * 4]), ValueError, "max_position_embeddings=128"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens=0"),
        (dict(sampler=Sampler(temperature=1.0)), ValueError, "PRNG key is required"),
        (dict(cache=jaxkv.CacheConfig(num_pages=5)), ValueError, "num_pages=5 is too small"),
        (dict(backend="cuda"), ValueError, "backend='cuda'"),
        (
            dict(cache=jaxkv.CacheConfig(num_pages=5), policy=_KeepAllButNotFull()),
            jaxkv.PoolExhaustedError,
            "num_pages=5",
        ),
    ],
)
def test_bad_input_raises_clear_errors(model, kwargs, error, match):
    kwargs = {"prompt_ids": PROMPTS, "max_new_tokens": 4} | kwargs
    with pytest.raises(error, match=match):
        jaxkv.generate(model, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(page_size=6), "page_size=6 must be a positive power of two"),
        (dict(page_size=0), "page_size=0 must be >= 1"),
        (dict(num_pages=0), "num_pages=0 must be >= 1"),
        (dict(num_pages=2.5), "num_pages=2.5 must be an integer"),
        (dict(kv_dtype=jnp.int32), "kv_dtype=.*float dtype.*storage='int8'"),
        (dict(kv_dtype="int8"), "kv_dtype='int8'"),
        (dict(storage="int4"), "storage='int4': allowed are 'model', 'int8'"),
        (dict(storage="int8", full_precision_window=-1), "full_precision_window=-1"),
    ],
)
def test_cache_config_is_validated_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.CacheConfig(**kwargs)


def test_cache_config_normalises_to_hashable_values():
    config = jaxkv.CacheConfig(kv_dtype="bfloat16", storage="int8", full_precision_window=8)
    assert config.storage is jaxkv.Storage.INT8
    assert config.kv_dtype == jnp.dtype(jnp.bfloat16)
    assert config.int8_window == 8
    assert jaxkv.CacheConfig().int8_window is None
    assert hash(config) == hash(
        jaxkv.CacheConfig(
            kv_dtype=jnp.bfloat16, storage=jaxkv.Storage.INT8, full_precision_window=8
        )
    )
