"""Fast KVzip's policy: gate-scored global eviction during chunked prefill and buffered decode.

The exact selection is checked against a plain-numpy version (a transformers forward for the
attention inputs, the paper's gate formula, one global ranking); memory follows the ratio with
the pool array itself sized for the compressed cache plus one chunk.
"""

import dataclasses

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.cache import geometry
from jaxkv.gates import fastkvzip as gate
from jaxkv.generation import prefill
from tests import hf_models
from tests import policy_references as ref
from tests.test_fastkvzip_gate import numpy_scores
from tests.test_prefill_pieces import retrace_prefill

LENGTHS = (150, 97)
RATIO = 0.3
PAGE_SIZE = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fastkvzip-model")
    hf, model = hf_models.build_and_load("llama2-tied", directory, seed=7, scale=0.3)
    params = gate.init_params(model.config, jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    params = {
        k: np.float32(np.asarray(v) + 0.5 * rng.standard_normal(v.shape)) for k, v in params.items()
    }
    prompts = [rng.integers(0, hf.config.vocab_size, n).tolist() for n in LENGTHS]
    return hf, model, params, prompts


def reference_keep(hf, params, prompt, kept_per_head, window):
    """[L, K, T] keep mask: the first 4 and newest `window` positions plus the best-gated
    others, one ranking over layers x heads x positions, kept_per_head x L x K in all."""
    fwd = ref.run(hf, prompt)
    layers = len(fwd.attention_inputs)
    scores = np.stack(
        [numpy_scores(gate.layer_slice(params, i), fwd.attention_inputs[i]) for i in range(layers)]
    )
    t = len(prompt)
    protected = np.broadcast_to((np.arange(t) >= t - window) | (np.arange(t) < 4), scores.shape)
    total = kept_per_head * scores.size // t
    ranked = np.where(protected, np.inf, scores).ravel()
    order = np.argsort(-ranked, kind="stable")
    keep = np.zeros(ranked.shape, bool)
    keep[order[:total]] = True
    return keep.reshape(scores.shape), scores


def kept_positions(state, layer, row, head, length):
    positions = np.asarray(state.positions(layer))[row, head]
    keep = np.zeros(length, bool)
    keep[positions[positions >= 0]] = True
    return keep


# 160: the chunk's forward in one piece; 32: in five (as a 16K chunk runs in 2K pieces).
@pytest.mark.parametrize("max_forward_tokens", [160, 32])
def test_one_chunk_keeps_the_global_top_with_the_window_forced(
    setup, monkeypatch, max_forward_tokens
):
    hf, model, params, prompts = setup
    policy = policies.get("fastkvzip", ratio=RATIO)
    monkeypatch.setattr(prefill, "MAX_FORWARD_TOKENS", max_forward_tokens)
    retrace_prefill()
    state = jaxkv.compress_prompt(
        model,
        prompts,
        policy,
        policy_params=params,
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
        prefill_chunk=160,
    )
    retrace_prefill()
    for row, prompt in enumerate(prompts):
        t = len(prompt)
        expected, scores = reference_keep(
            hf, params, prompt, int(RATIO * t), policies.fastkvzip.default_window(t)
        )
        for layer in range(model.config.num_layers):
            for head in range(model.config.num_kv_heads):
                ours = kept_positions(state, layer, row, head, t)
                np.testing.assert_array_equal(ours, expected[layer, head], f"{layer}/{row}/{head}")
                held = np.asarray(state.token_scores(layer))[row, head, : ours.sum()]
                np.testing.assert_allclose(held, scores[layer, head][ours], rtol=1e-4, atol=1e-6)


def test_chunked_prefill_memory_follows_the_ratio(setup):
    _, model, params, prompts = setup
    cfg = model.config
    heads = cfg.num_layers * cfg.num_kv_heads
    policy = policies.FastKVzip(ratio=RATIO)
    state = jaxkv.compress_prompt(
        model,
        prompts,
        policy,
        policy_params=params,
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
        prefill_chunk=32,
    )
    lengths = np.asarray(state.lengths)
    full_pages = heads * sum(-(-n // PAGE_SIZE) for n in LENGTHS)
    assert int(state.pages_in_use()) == int(np.sum(-(-lengths // PAGE_SIZE)))
    # The pool array itself holds the compressed cache plus one chunk, not the full context
    # (its size rounded up to a pool bucket, whose smallest is larger than this tiny cache).
    bound = policy.chunk_eviction.prefill_pages(np.array(LENGTHS), 32, cfg, PAGE_SIZE, 0)
    assert bound < 0.75 * full_pages
    assert state.pool.num_pages == geometry.pool_pages_bucket(bound, PAGE_SIZE)
    for row, n in enumerate(LENGTHS):
        assert lengths[:, row].sum() == int(RATIO * n) * heads
        window = policies.fastkvzip.default_window(n)
        for layer in range(cfg.num_layers):
            for head in range(cfg.num_kv_heads):
                assert kept_positions(state, layer, row, head, n)[n - window :].all()
    assert len(np.unique(lengths)) > 1  # non-uniform head budgets


def test_decode_evicts_every_buffer_to_the_ratio(setup):
    # A 32-token buffer (the paper's is 128) keeps the test short: sinks + buffer < budget.
    _, model, params, prompts = setup
    buffer = 32
    cfg = model.config
    heads = cfg.num_layers * cfg.num_kv_heads
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=buffer + 2,
        policy=policies.FastKVzip(ratio=RATIO, decode_buffer=buffer),
        policy_params=params,
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
        prefill_chunk=32,
        stop_tokens=[],
    )
    lengths = np.asarray(out.state.lengths)
    assert out.pages_in_use[buffer] < out.pages_in_use[buffer - 1]  # evicted at 32 generated
    for row, n in enumerate(LENGTHS):
        evicted_to = int(int(RATIO * n) * (n + buffer) / n) * heads
        assert lengths[:, row].sum() == evicted_to + heads  # plus the one token written since
        for layer in range(cfg.num_layers):
            positions = np.asarray(out.state.positions(layer))[row]
            for head in range(cfg.num_kv_heads):
                held = set(positions[head][positions[head] >= 0].tolist())
                assert set(range(4)) <= held
                assert set(range(n, n + buffer + 1)) <= held


def test_a_fixed_decode_budget_evicts_to_that_many_tokens_per_head(setup):
    # The paper's reasoning-model setting: decode evictions go down to a fixed token budget.
    _, model, params, prompts = setup
    buffer, fixed = 32, 40  # fixed > sinks + buffer, so the forced tokens fit inside it
    heads = model.config.num_layers * model.config.num_kv_heads
    policy = policies.FastKVzip(ratio=RATIO, decode_buffer=buffer, decode_tokens=fixed)
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=buffer + 2,
        policy=policy,
        policy_params=params,
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
        prefill_chunk=32,
        stop_tokens=[],
    )
    lengths = np.asarray(out.state.lengths)
    for row in range(len(LENGTHS)):
        assert lengths[:, row].sum() == fixed * heads + heads  # plus the token written since
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="decode_tokens="):
            policies.FastKVzip(ratio=RATIO, decode_tokens=bad)


def test_bad_input_raises_before_compiling(setup):
    _, model, params, prompts = setup
    for ratio in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="ratio"):
            policies.FastKVzip(ratio=ratio)
    with pytest.raises(ValueError, match="prefill_chunk=32 is smaller than the protected window"):
        jaxkv.compress_prompt(
            model,
            prompts,
            policies.FastKVzip(ratio=0.5, window=40),
            policy_params=params,
            prefill_chunk=32,
        )
    other = dataclasses.replace(model.config, num_kv_heads=1)
    with pytest.raises(ValueError, match="gate parameter 'wq' has shape"):
        jaxkv.generate(
            model,
            prompts,
            max_new_tokens=2,
            policy=policies.FastKVzip(ratio=RATIO),
            policy_params=gate.init_params(other, jax.random.PRNGKey(0)),
        )
    with pytest.raises(ValueError, match="needs policy_params"):
        jaxkv.generate(model, prompts, max_new_tokens=2, policy=policies.FastKVzip(ratio=RATIO))
