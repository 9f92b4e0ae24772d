"""Conf-KV: confidence, EMA attention mass, confidence-gated budgets, protected window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv import policies
from jaxkv.policies import confkv
from models import init_model
from models.configs import Family
from tests.tiny_models import tiny_config

CONFIG = tiny_config(Family.LLAMA, num_layers=3)


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=2, scale=0.3)


def test_confidence_features_match_numpy():
    logits = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32) * 3
    ent, margin, top = (np.asarray(x) for x in confkv.confidence_features(jnp.asarray(logits)))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(ent, 1 + (p * np.log(p)).sum(-1) / np.log(50), rtol=1e-5)
    top2 = np.sort(np.log(p), axis=-1)[:, ::-1][:, :2]
    np.testing.assert_allclose(margin, top2[:, 0] - top2[:, 1], rtol=1e-5)
    np.testing.assert_allclose(top, p.max(-1), rtol=1e-5)


@settings(max_examples=50, deadline=None)
@given(
    base=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    which=st.integers(0, 2),
    delta=st.floats(0.01, 1.0),
)
def test_confidence_is_increasing_in_each_ingredient(base, which, delta):
    weights = confkv.ConfidenceWeights()
    scale = (weights.entropy, weights.margin, weights.top)

    def c(values):
        z = sum(w * v for w, v in zip(scale, values, strict=True)) + weights.bias
        return float(jax.nn.sigmoid(z))

    bumped = list(base)
    bumped[which] += delta
    assert c(bumped) > c(base)


def test_peaked_distributions_are_more_confident():
    flat = jnp.zeros((1, 100))
    peaked = flat.at[0, 3].set(12.0)
    assert float(policies.confidence(peaked)[0]) > 0.9 > 0.1 > float(policies.confidence(flat)[0])


def test_chunked_prefill_ema_equals_query_by_query(model):
    prompt = [np.random.default_rng(1).integers(0, 64, 40).tolist()]
    policy = policies.ConfKV(tight=128, loose=256, protected=8, evict_every=1)
    chunked = jaxkv.compress_prompt(model, prompt, policy, prefill_chunk=16, page_size=4)
    stepwise = jaxkv.compress_prompt(model, prompt, policy, prefill_chunk=1, page_size=4)
    np.testing.assert_allclose(
        np.asarray(chunked.token_scores()), np.asarray(stepwise.token_scores()), atol=1e-6
    )
    assert np.all(np.asarray(chunked.token_scores())[..., :40] > 0)


def _rank_reference(mass, positions, protected_mask, alpha):
    """Numpy: min-max normalised mass and recency over non-protected held tokens."""
    cand = (positions >= 0) & ~protected_mask

    def norm(x):
        lo, hi = x[cand].min(), x[cand].max()
        return np.where(cand, (x - lo) / (hi - lo) if hi > lo else 0.0, 0.0)

    return alpha * norm(mass) + (1 - alpha) * norm(positions.astype(np.float64))


def test_tau_zero_is_a_fixed_tight_budget_ema_recency_eviction(model):
    prompt = [np.random.default_rng(2).integers(0, 64, 60).tolist()]
    tight = policies.ConfKV(tight=40, loose=200, tau=0.0, protected=8, evict_every=1)
    # The same step, no eviction.
    never = policies.ConfKV(tight=40, loose=200, tau=1.0, protected=8, evict_every=1)
    # One decode step writes position 60, updates the EMA, then evicts down to 40 per head.
    before = jaxkv.generate(model, prompt, max_new_tokens=2, policy=never, stop_tokens=()).state
    after = jaxkv.generate(model, prompt, max_new_tokens=2, policy=tight, stop_tokens=()).state
    positions, mass = np.asarray(before.positions()), np.asarray(before.token_scores())
    kept_after = np.asarray(after.positions())
    for index in np.ndindex(positions.shape[:3]):
        held = positions[index] >= 0
        old = positions[index][held]
        assert len(old) == 61
        protected = old > 60 - 8
        ranked = np.where(
            protected, np.inf, _rank_reference(mass[index][held], old, protected, 0.5)
        )
        expected = sorted(old[np.argsort(-ranked, kind="stable")[:40]].tolist())
        kept = kept_after[index]
        assert kept[kept >= 0].tolist() == expected


def test_confident_steps_use_the_tight_budget_and_protected_tokens_stay(model):
    prompt = [np.random.default_rng(3).integers(0, 64, 100).tolist()]
    always_loose = policies.ConfKV(tight=32, loose=64, tau=1.0, protected=16, evict_every=1)
    always_tight = policies.ConfKV(tight=32, loose=64, tau=0.0, protected=16, evict_every=1)
    loose = jaxkv.generate(model, prompt, max_new_tokens=6, policy=always_loose, stop_tokens=())
    tight = jaxkv.generate(model, prompt, max_new_tokens=6, policy=always_tight, stop_tokens=())
    assert np.all(np.asarray(loose.state.lengths) == 64)
    # The per-step confidence trace (the paper's Fig. 8) comes with every generation.
    assert loose.confidence.shape == (6, 1)
    assert np.all((loose.confidence > 0) & (loose.confidence < 1))
    assert np.all(np.asarray(tight.state.lengths) == 32)
    positions = np.asarray(tight.state.positions())
    newest = 100 + 6 - 2
    for index in np.ndindex(positions.shape[:3]):
        assert set(range(newest - 15, newest + 1)) <= set(positions[index].tolist())


def test_pyramid_budgets_fall_with_depth(model):
    prompt = [np.random.default_rng(4).integers(0, 64, 120).tolist()]
    policy = policies.ConfKV(tight=40, loose=80, tau=0.0, protected=8, pyramid=True, evict_every=1)
    out = jaxkv.generate(model, prompt, max_new_tokens=3, policy=policy, stop_tokens=())
    lengths = np.asarray(out.state.lengths)[:, 0, 0]
    np.testing.assert_array_equal(lengths, [60, 40, 20])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tight=600, loose=512), "tight=600 must be <= loose=512"),
        (dict(tight=64, protected=64), "protected=64 must be smaller"),
        (dict(tight=100, protected=64, pyramid=True), "protected=64 must be smaller"),
        (dict(tau=1.2), r"tau=1.2 must be in \[0, 1\]"),
        (dict(beta=1.0), r"beta=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_confkv_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        policies.ConfKV(**kwargs, evict_every=1)


def test_random_ranking_ablation_keeps_the_schedule_and_the_protected_window(model):
    prompt = [np.random.default_rng(5).integers(0, 64, 90).tolist()]
    policy = policies.ConfKV(
        tight=32, loose=64, tau=0.0, protected=16, ranking="random", evict_every=1
    )
    composite = policies.ConfKV(tight=32, loose=64, tau=0.0, protected=16, evict_every=1)
    out = jaxkv.generate(
        model, prompt, max_new_tokens=4, policy=policy, stop_tokens=(), key=jax.random.PRNGKey(1)
    )
    ref = jaxkv.generate(model, prompt, max_new_tokens=4, policy=composite, stop_tokens=())
    assert np.all(np.asarray(out.state.lengths) == 32)
    positions, ref_positions = np.asarray(out.state.positions()), np.asarray(ref.state.positions())
    newest = 90 + 4 - 2
    assert not np.array_equal(positions, ref_positions)
    for index in np.ndindex(positions.shape[:3]):
        assert set(range(newest - 15, newest + 1)) <= set(positions[index].tolist())
