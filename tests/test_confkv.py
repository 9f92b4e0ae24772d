"""Conf-KV: confidence, EMA attention mass, confidence-gated budgets, protected window."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv import policies
from jaxkv.models import init_model
from jaxkv.models.configs import Family
from jaxkv.policies import confkv
from tests.decode_steps import teacher_forced_steps
from tests.tiny_models import tiny_config

TAU_SWITCHING = 0.5

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
    bumped = list(base)
    bumped[which] += delta

    def z(features):
        return float(policies.confidence_logit([np.float32([f]) for f in features], weights)[0])

    def c(features):
        return float(policies.confidence_from_features([np.float32([f]) for f in features])[0])

    assert z(bumped) > z(base)
    # The f32 sigmoid rounds to 1.0 above z ~ 17 (the threshold is compared on z).
    assert c(bumped) > c(base) or c(base) == 1.0
    assert c(base) == pytest.approx(1 / (1 + np.exp(-z(base))), rel=1e-6)


def test_peaked_distributions_are_more_confident():
    flat = jnp.zeros((1, 100))
    peaked = flat.at[0, 3].set(12.0)
    assert float(policies.confidence(peaked)[0]) > 0.9 > 0.1 > float(policies.confidence(flat)[0])


def test_chunked_prefill_ema_equals_query_by_query(model):
    prompt = [np.random.default_rng(1).integers(0, 64, 40).tolist()]
    policy = policies.ConfKV(tight=128, loose=256, protected=8, evict_every=1)
    chunked = jaxkv.compress_prompt(
        model, prompt, policy, prefill_chunk=16, cache=jaxkv.CacheConfig(page_size=4)
    )
    stepwise = jaxkv.compress_prompt(
        model, prompt, policy, prefill_chunk=1, cache=jaxkv.CacheConfig(page_size=4)
    )
    np.testing.assert_allclose(
        np.asarray(chunked.token_scores()), np.asarray(stepwise.token_scores()), atol=1e-6
    )
    assert np.all(np.asarray(chunked.token_scores())[..., :40] > 0)


def _numpy_confidence(logits, a_e=4.0, a_m=1.0, a_t=4.0, a_0=-5.0):
    """c = sigmoid(a_e (1 - H/log V) + a_m (log p1 - log p2) + a_t p1 + a_0): docs/confkv.md,
    "Method"."""
    log_p = logits - logits.max() - np.log(np.sum(np.exp(logits - logits.max())))
    p = np.exp(log_p)
    entropy = -np.sum(p * log_p)
    first, second = np.sort(log_p)[::-1][:2]
    z = (
        a_e * (1 - entropy / np.log(len(logits)))
        + a_m * (first - second)
        + a_t * np.exp(first)
        + a_0
    )
    return 1 / (1 + np.exp(-z))


def _ranking_mass(positions, mass, per_head):
    """[K, S]: per head its own mass; per layer (the paper) the mean over the layer's heads of
    the mass each gives the same position (every head must hold it)."""
    if per_head:
        return mass
    layer = np.zeros_like(mass)
    for head, slot in zip(*np.nonzero(positions >= 0), strict=True):
        p = positions[head, slot]
        layer[head, slot] = np.mean(
            [m[pos == p][0] for m, pos in zip(mass, positions, strict=True)]
        )
    return layer


def _kept_by_rule(positions, mass, newest, protected, budget, alpha=0.5):
    """One head: sorted kept positions and the scores that ranked them. The newest `protected`
    positions stay; the others are ranked by alpha * minmax(mass) + (1 - alpha) *
    minmax(position) over the candidates and the lowest go until `budget` remain."""
    held = positions >= 0
    old, mass = positions[held], mass[held]
    if len(old) <= budget:
        return sorted(old.tolist()), None
    candidates = old <= newest - protected

    def norm(x):
        lo, hi = x[candidates].min(), x[candidates].max()
        return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)

    score = alpha * norm(mass) + (1 - alpha) * norm(old.astype(np.float64))
    ranked = np.where(candidates, score, np.inf)
    return sorted(old[np.argsort(-ranked, kind="stable")[:budget]].tolist()), dict(
        zip(old.tolist(), ranked.tolist(), strict=True)
    )


def _assert_kept(kept, expected, scores, where, tol=1e-5):
    """Same kept set, allowing swaps between positions whose reference scores tie within tol."""
    kept, expected = set(kept), set(expected)
    assert len(kept) == len(expected), where
    differ = sorted(kept ^ expected)
    if differ:
        assert scores is not None, f"{where}: positions {differ} differ"
        boundary = min(scores[p] for p in expected)
        gaps = [abs(scores[p] - boundary) for p in differ]
        assert max(gaps) <= tol, f"{where}: positions {differ} differ by {gaps}"


@pytest.mark.parametrize("per_head", [False, True])
def test_tight_budget_keeps_the_best_ranked_per_layer_or_per_head(model, per_head):
    prompt = [np.random.default_rng(2).integers(0, 64, 60).tolist()]
    tight = policies.ConfKV(
        tight=40, loose=200, tau=0.0, protected=8, evict_every=1, per_head=per_head
    )
    # The same step, no eviction (tau = 1 is never tight: c >= 1 never holds for finite z).
    never = policies.ConfKV(tight=40, loose=200, tau=1.0, protected=8, evict_every=1)
    # One decode step writes position 60, updates the EMA, then evicts down to 40 per head.
    before = jaxkv.generate(model, prompt, max_new_tokens=2, policy=never, stop_tokens=()).state
    after = jaxkv.generate(model, prompt, max_new_tokens=2, policy=tight, stop_tokens=()).state
    positions, mass = np.asarray(before.positions())[:, 0], np.asarray(before.token_scores())[:, 0]
    kept_after = np.asarray(after.positions())[:, 0]
    for layer in range(positions.shape[0]):
        ranked_by = _ranking_mass(positions[layer], mass[layer], per_head)
        for head in range(positions.shape[1]):
            assert np.sum(positions[layer, head] >= 0) == 61
            expected, scores = _kept_by_rule(
                positions[layer, head], ranked_by[head], newest=60, protected=8, budget=40
            )
            kept = kept_after[layer, head]
            _assert_kept(kept[kept >= 0].tolist(), expected, scores, f"layer {layer} head {head}")
        if not per_head:  # one ranking per layer: every KV head evicts the same positions
            assert all(np.array_equal(kept_after[layer, 0], k) for k in kept_after[layer])


# The step's confidence (z = 18.42: c = 1 - 1e-8) rounds to 1.0 in f32, and so do these taus;
# the rule c >= tau still tells them apart.
SATURATED = confkv.ConfidenceWeights(entropy=0.0, margin=0.0, top=0.0, bias=math.log(1e8 - 1))


@pytest.mark.parametrize(
    ("tau", "confident"), [(1 - 2e-8, True), (1 - 5e-9, False), (1.0, False), (0.0, True)]
)
def test_tau_rule_holds_where_the_f32_confidence_rounds_to_one(model, tau, confident):
    logits = jnp.zeros((1, 64))
    assert float(policies.confidence(logits, SATURATED)[0]) == 1.0
    assert tau == 0.0 or np.float32(tau) == 1.0
    assert (1 - 1e-8 >= tau) == confident
    assert bool(policies.is_confident(logits, tau, SATURATED)[0]) == confident
    prompt = [np.random.default_rng(3).integers(0, 64, 100).tolist()]
    policy = policies.ConfKV(
        tight=32, loose=64, tau=tau, weights=SATURATED, protected=16, evict_every=1
    )
    out = jaxkv.generate(model, prompt, max_new_tokens=3, policy=policy, stop_tokens=())
    assert np.all(np.asarray(out.state.lengths) == (32 if confident else 64))


def test_a_tau_sweep_compiles_the_decode_loop_once(model):
    """Conf-KV's tau travels as the array logit(tau) (`ConfKV.thresholds`): three taus, one
    decode loop; tau 0 is always tight and tau 1 never (the lengths each one leaves)."""
    from jaxkv.generation import loop

    prompt = [np.random.default_rng(3).integers(0, 64, 100).tolist()]

    def lengths(tau: float) -> set[int]:
        policy = policies.ConfKV(
            tight=32, loose=64, tau=tau, weights=SATURATED, protected=16, evict_every=1
        )
        out = jaxkv.generate(model, prompt, max_new_tokens=3, policy=policy, stop_tokens=())
        return set(np.asarray(out.state.lengths).ravel().tolist())

    assert lengths(0.0) == {32}
    before = loop.decode_loop.jitted._cache_size()
    assert lengths(1.0) == {64}
    assert lengths(1 - 2e-8) == {32}
    assert loop.decode_loop.jitted._cache_size() == before


def test_alpha_and_beta_sweeps_compile_once_and_change_the_cache(model):
    """Conf-KV's alpha (mass against recency) and beta (the EMA's decay) travel as thresholds
    too: a sweep over them compiles prefill and the decode loop once, and each value acts:
    alpha 0 keeps the newest positions, alpha 1 others; beta changes the scores."""
    from jaxkv.generation import loop, prefill

    prompt = [np.random.default_rng(4).integers(0, 64, 100).tolist()]

    def run(alpha: float, beta: float):
        policy = policies.ConfKV(
            tight=32, loose=48, tau=0.5, protected=8, evict_every=1, alpha=alpha, beta=beta
        )
        out = jaxkv.generate(model, prompt, max_new_tokens=3, policy=policy, stop_tokens=())
        held = np.asarray(out.state.positions(0))[0, 0]
        return np.sort(held[held >= 0]), np.asarray(out.state.token_scores(0))[0, 0]

    recency, _ = run(alpha=0.0, beta=0.9)
    programs = (prefill.prefill_and_compress, loop.decode_loop)
    before = [program.jitted._cache_size() for program in programs]
    mass, scores = run(alpha=1.0, beta=0.9)
    _, other_scores = run(alpha=1.0, beta=0.5)
    assert [program.jitted._cache_size() for program in programs] == before
    # The prompt and the 2 decode tokens written before the last: positions 0-101.
    np.testing.assert_array_equal(recency, np.arange(102 - len(recency), 102))
    assert not np.array_equal(mass, recency)
    assert not np.allclose(scores, other_scores)


def test_budget_switches_with_each_steps_confidence(model):
    """Per step (evict_every=1): numpy confidence from the step's logits -> tight or loose
    budget -> the per-layer rule's kept positions, against the cache after the hook."""
    rng = np.random.default_rng(8)
    prompt, continuation = rng.integers(0, 64, 60).tolist(), rng.integers(0, 64, 16).tolist()
    tau, tight, loose, protected = TAU_SWITCHING, 24, 40, 8
    policy = policies.ConfKV(tight=tight, loose=loose, tau=tau, protected=protected, evict_every=1)
    _, steps = teacher_forced_steps(model, prompt, policy, continuation)
    budgets = []
    for step in steps:
        c = _numpy_confidence(step.logits)
        assert abs(c - tau) > 1e-4  # a clear decision: f32 and f64 agree
        budget = tight if c >= tau else loose
        budgets.append(budget)
        for layer in range(step.written_positions.shape[0]):
            positions = step.written_positions[layer]
            ranked_by = _ranking_mass(positions, step.written_scores[layer], per_head=False)
            for head in range(positions.shape[0]):
                expected, scores = _kept_by_rule(
                    positions[head], ranked_by[head], step.position, protected, budget
                )
                kept = step.kept_positions[layer, head]
                where = f"position {step.position}, layer {layer}, head {head}"
                _assert_kept(kept[kept >= 0].tolist(), expected, scores, where)
    switches = np.count_nonzero(np.diff(budgets))
    assert tight in budgets and loose in budgets and switches >= 2, budgets


def test_confident_steps_use_the_tight_budget_and_protected_tokens_stay(model):
    prompt = [np.random.default_rng(3).integers(0, 64, 100).tolist()]
    # tau = 1 / tau = 0: never / always tight, exactly (c >= tau is decided on the logit).
    always_loose = policies.ConfKV(tight=32, loose=64, tau=1.0, protected=16, evict_every=1)
    always_tight = policies.ConfKV(tight=32, loose=64, tau=0.0, protected=16, evict_every=1)
    loose = jaxkv.generate(model, prompt, max_new_tokens=6, policy=always_loose, stop_tokens=())
    tight = jaxkv.generate(model, prompt, max_new_tokens=6, policy=always_tight, stop_tokens=())
    assert np.all(np.asarray(loose.state.lengths) == 64)
    # The per-step confidence trace (the paper's Fig. 8) comes with every generation.
    assert loose.policy_trace.shape == (6, 1)
    assert np.all((loose.policy_trace > 0) & (loose.policy_trace < 1))
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
