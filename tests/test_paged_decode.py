"""Decoding through the paged cache equals the full causal forward (fp32)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cache import KVState
from jaxkv.models import ModelConfig, forward, init_model
from jaxkv.models.configs import Family, RopeScaling
from jaxkv.models.decoder import logits_from_hidden
from jaxkv.policies import FullCache
from jaxkv.step.forward import forward_cached

CONFIG = ModelConfig(
    family=Family.LLAMA,
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rope_scaling=RopeScaling("llama3", 4.0, 1.0, 4.0, 16),
    max_position_embeddings=256,
)


def _model(seed=0):
    return init_model(CONFIG, seed=seed, dtype=jnp.float32)


def _empty_state(batch, max_tokens, page_size, num_pages, seed=None):
    kv = KVState.create(
        num_layers=CONFIG.num_layers,
        batch=batch,
        num_kv_heads=CONFIG.num_kv_heads,
        head_dim=CONFIG.head_dim,
        max_tokens=max_tokens,
        page_size=page_size,
        num_pages=num_pages,
        dtype=jnp.float32,
    )
    if seed is None:
        return kv
    # A permuted free stack hands pages out in random order: page tables become permutations.
    order = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    allocator = dataclasses.replace(kv.pool.allocator, free_stack=jnp.asarray(order))
    return dataclasses.replace(kv, pool=dataclasses.replace(kv.pool, allocator=allocator))


@functools.partial(jax.jit, donate_argnames=("kv",))
def _chunk_logits(model, tokens, positions, kv):
    hidden, kv, _ = forward_cached(model, tokens, positions, kv, policy=FullCache())
    return logits_from_hidden(model.params, model.config, hidden), kv


@pytest.mark.parametrize(
    ("page_size", "spare_pages", "seed"), [(1, 0, None), (4, 0, 0), (8, 5, 1), (16, 3, 2)]
)
def test_token_by_token_decode_equals_full_forward(page_size, spare_pages, seed):
    model = _model()
    batch, length = 2, 37
    tokens = np.random.default_rng(3).integers(0, CONFIG.vocab_size, (batch, length))
    expected = np.asarray(forward(model, tokens))
    per_head_pages = -(-length // page_size)
    num_pages = CONFIG.num_layers * batch * CONFIG.num_kv_heads * per_head_pages + spare_pages
    kv = _empty_state(batch, length, page_size, num_pages, seed)
    for t in range(length):
        positions = jnp.full((batch, 1), t, jnp.int32)
        logits, kv = _chunk_logits(model, jnp.asarray(tokens[:, t : t + 1]), positions, kv)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), expected[:, t], atol=1e-5, rtol=1e-5)
    assert not bool(kv.pool.overflow)
    assert int(kv.pages_in_use()) == num_pages - spare_pages
    assert kv.memory_bytes() == (num_pages - spare_pages) * kv.pool.page_bytes
    if seed is not None:  # the tables really are scattered, not the identity layout
        assert not np.array_equal(
            np.sort(np.asarray(kv.page_table).ravel()), np.asarray(kv.page_table).ravel()
        )
    for layer in range(CONFIG.num_layers):
        np.testing.assert_array_equal(
            np.asarray(kv.positions(layer))[..., :length],
            np.broadcast_to(np.arange(length), (batch, CONFIG.num_kv_heads, length)),
        )


@pytest.mark.parametrize(("chunk", "page_size"), [(5, 4), (16, 8), (40, 16)])
def test_chunked_prefill_with_ragged_lengths_equals_full_forward(chunk, page_size):
    model = _model(seed=1)
    lengths = np.array([33, 12])
    padded = -(-lengths.max() // chunk) * chunk
    tokens = np.random.default_rng(4).integers(0, CONFIG.vocab_size, (2, padded))
    num_pages = CONFIG.num_layers * CONFIG.num_kv_heads * int(np.sum(-(-lengths // page_size)))
    kv = _empty_state(2, padded, page_size, num_pages, seed=5)
    for start in range(0, padded, chunk):
        index = np.arange(start, start + chunk)
        positions = np.where(index < lengths[:, None], index, -1)
        logits, kv = _chunk_logits(
            model,
            jnp.asarray(tokens[:, start : start + chunk]),
            jnp.asarray(positions, jnp.int32),
            kv,
        )
        for row, n in enumerate(lengths):
            expected = np.asarray(forward(model, tokens[row : row + 1, :n]))[0]
            valid = index < n
            np.testing.assert_allclose(
                np.asarray(logits[row])[valid], expected[index[valid]], atol=1e-5, rtol=1e-5
            )
    assert int(kv.pages_in_use()) == num_pages  # padding was never written
    np.testing.assert_array_equal(
        np.asarray(kv.lengths), np.broadcast_to(lengths[None, :, None], kv.lengths.shape)
    )
