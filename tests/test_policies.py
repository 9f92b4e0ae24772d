"""Each eviction policy keeps exactly what a plain-numpy version of its algorithm keeps.

The references read a `transformers` forward pass of each prompt alone; the project compresses a
ragged batch through its paged cache. Kept positions must match per (layer, sequence, head),
allowing swaps only between entries whose reference scores tie within 1e-6.
"""

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from tests import hf_models
from tests import policy_references as ref

PROMPT_LENGTHS = (96, 71)
PAGE_SIZE = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = tmp_path_factory.mktemp("policy-model")
    hf, model = hf_models.build_and_load("llama2-tied", directory, seed=5, scale=0.3)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, hf.config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    return hf, model, prompts, [ref.run(hf, p) for p in prompts]


def _kept_positions(state, layer, row, head, length):
    positions = np.asarray(state.positions(layer))[row, head]
    keep = np.zeros(length, bool)
    keep[positions[positions >= 0]] = True
    return keep


def assert_same_selection(state, references, lengths, tol=1e-6):
    for layer in range(state.num_layers):
        for row, length in enumerate(lengths):
            keep_ref, scores = references[row][layer]
            for head in range(keep_ref.shape[0]):
                ours = _kept_positions(state, layer, row, head, length)
                where = f"layer {layer}, sequence {row}, head {head}"
                assert ours.sum() == keep_ref[head].sum(), where
                differ = np.flatnonzero(ours != keep_ref[head])
                if len(differ):
                    assert scores is not None, f"{where}: positions {differ} differ"
                    boundary = np.min(scores[head][keep_ref[head] & np.isfinite(scores[head])])
                    gap = np.abs(scores[head][differ] - boundary)
                    assert np.all(gap <= tol), f"{where}: positions {differ} differ by {gap}"


def _budgets(ratio):
    return [int(np.floor(ratio * n)) for n in PROMPT_LENGTHS]


CASES = {
    "streaming_llm": (lambda: policies.StreamingLLM(budget=0.3), ref.streaming_llm, {}),
    "sliding_window": (
        lambda: policies.SlidingWindow(budget=0.3),
        ref.streaming_llm,
        {"sinks": 0},
    ),
    "snapkv": (lambda: policies.SnapKV(budget=0.3, window=16), ref.snapkv, {"window": 16}),
    "pyramidkv": (
        lambda: policies.PyramidKV(budget=0.4, window=4, beta=4.0),
        ref.pyramidkv,
        {"window": 4, "beta": 4.0, "share": 0.4},
    ),
    "tova": (lambda: policies.TOVA(budget=0.3), ref.tova, {}),
    "knorm": (lambda: policies.Knorm(budget=0.3), ref.knorm, {}),
    "h2o": (lambda: policies.H2O(budget=0.3), ref.h2o, {}),
    "observed_attention": (
        lambda: policies.ObservedAttention(budget=0.3),
        ref.h2o,
        {"observed": True},
    ),
    "adakv": (
        lambda: policies.AdaKV(inner=policies.SnapKV(window=8), budget=0.3),
        ref.adakv_snapkv,
        {"window": 8},
    ),
    "sage_kv": (lambda: policies.SageKV(budget=0.4), ref.sage_kv, {}),
    "adakv_expected_attention": (
        lambda: policies.AdaKV(inner=policies.ExpectedAttention(future_positions=64), budget=0.3),
        ref.adakv_expected_attention,
        {"future_positions": 64},
    ),
    "expected_attention": (
        lambda: policies.ExpectedAttention(budget=0.3, future_positions=64),
        ref.expected_attention,
        {"future_positions": 64},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_policy_matches_numpy_reference(setup, name):
    _, model, prompts, forwards = setup
    make_policy, reference, kwargs = CASES[name]
    ratio = make_policy().budget.ratio
    state = jaxkv.compress_prompt(
        model,
        prompts,
        make_policy(),
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
        prefill_chunk=32,  # several chunks: statistics gathered over chunks must combine exactly
    )
    expected = [
        reference(fwd, budget, **kwargs)
        for fwd, budget in zip(forwards, _budgets(ratio), strict=True)
    ]
    assert_same_selection(state, expected, PROMPT_LENGTHS)


def test_pyramid_budgets_really_differ_by_layer(setup):
    _, model, prompts, _ = setup
    state = jaxkv.compress_prompt(
        model,
        prompts,
        policies.PyramidKV(budget=0.4, window=4, beta=4.0),
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
    )
    lengths = np.asarray(state.lengths)
    assert np.all(lengths[0] > lengths[1])


def test_gvote_matches_listing_and_is_seeded(setup):
    _, model, prompts, forwards = setup
    key = jax.random.PRNGKey(7)
    state = jaxkv.compress_prompt(
        model, prompts, policies.GVote(), cache=jaxkv.CacheConfig(page_size=PAGE_SIZE), key=key
    )
    expected = [ref.gvote(fwd, key, row) for row, fwd in enumerate(forwards)]
    assert_same_selection(state, expected, PROMPT_LENGTHS)
    again = jaxkv.compress_prompt(
        model, prompts, policies.GVote(), cache=jaxkv.CacheConfig(page_size=PAGE_SIZE), key=key
    )
    np.testing.assert_array_equal(np.asarray(again.lengths), np.asarray(state.lengths))
    lengths = np.asarray(state.lengths)
    assert len(np.unique(lengths)) > 1  # budgets differ by layer / head / request
    assert np.all(lengths < np.array(PROMPT_LENGTHS)[None, :, None])
