"""Scissorhands against a numpy version of the paper's rule, driven step by step.

The reference (written from arXiv:2305.17118, Algorithms 1 and 2, not from the policy's code)
holds, per (layer, KV head), the cached keys, values, positions and unimportance counts; each
decode step computes the attention densely in float64, adds 1 to the count of every cached token
whose group-mean attention is below 1 / n (n: the tokens the query attends to, itself included),
appends the new token with count 0, and every `evict_every` steps a head over its budget keeps
its sinks, its newest `recent` positions and the lowest counts (newer first on ties).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.models import init_model
from jaxkv.models.configs import Family
from jaxkv.models.decoder import (
    attention_inputs,
    attention_output_and_mlp,
    embed,
    logits_from_hidden,
)
from jaxkv.models.layers import rope_cos_sin
from jaxkv.step.decode import StepContext, after_decode_step, decode_context
from jaxkv.step.forward import forward_cached
from jaxkv.step.rows import Rows
from tests.dense_reference import cached_keys_values
from tests.tiny_models import tiny_config

CONFIG = tiny_config(Family.LLAMA)
PAGE_SIZE = 4
# Indicators whose attention lies this close to 1/n could flip between f32 and f64.
CLEAR_MARGIN = 2e-6


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=3, scale=0.3)


# --- the policy, step by step --------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="policy")
def _step(model, kv, token, position, prompt_length, budget_tokens, thresholds, step, policy):
    hidden, kv, _ = forward_cached(
        model,
        token[None, None],
        position[None, None],
        kv,
        policy=policy,
        thresholds=thresholds,
    )
    rows = Rows.start(
        prompt_lengths=prompt_length[None],
        budget_tokens=budget_tokens,
        budget_ratio=jnp.zeros((1,), jnp.float32),
        thresholds=thresholds,
        keys=jax.random.PRNGKey(0)[None],
        sampling=jaxkv.Sampler().rows(1),
        steps=step[None],
    )
    logits = logits_from_hidden(model.params, model.config, hidden[:, 0])
    ctx = decode_context(
        StepContext(rows=rows, policy=policy), position[None], logits, model.config.group_size
    )
    return kv, after_decode_step(policy, kv, ctx)


def policy_steps(model, prompt, policy, continuation, cache=None):
    """The compressed prompt state and, per continuation token, (position -> count) per
    (layer, head) after the write and the kept positions per (layer, head) after the hook."""
    cache = jaxkv.CacheConfig(page_size=PAGE_SIZE) if cache is None else cache
    kv = jaxkv.compress_prompt(
        model, [prompt], policy, cache=cache, reserve_tokens=len(continuation)
    )
    prompt_state = kv
    length = np.array([len(prompt)], np.int32)
    budget_tokens = jnp.asarray(policy.budget_tokens(length))
    thresholds = jnp.asarray(policy.thresholds(1))
    counts, kept = [], []
    for i, token in enumerate(continuation):
        args = (jnp.int32(token), jnp.int32(len(prompt) + i), jnp.int32(len(prompt)))
        written, kv = _step(
            model, kv, *args, budget_tokens, thresholds, jnp.int32(i + 1), policy.static()
        )
        positions = np.asarray(written.positions())[:, 0]
        scores = np.asarray(written.token_scores())[:, 0]
        counts.append(
            {
                index: dict(zip(positions[index].tolist(), scores[index].tolist(), strict=True))
                for index in np.ndindex(positions.shape[:2])
            }
        )
        after = np.asarray(kv.positions())[:, 0]
        kept.append(
            {index: sorted(after[index][after[index] >= 0].tolist()) for index in counts[-1]}
        )
        for index in counts[-1]:
            counts[-1][index].pop(-1, None)
    return prompt_state, counts, kept, kv


# --- the reference ------------------------------------------------------------------------


def _evict(positions, counts, newest, budget, sinks, recent):
    """Indices of one head's tokens to keep: protected, then fewest counts (newer on ties)."""
    if len(positions) <= budget:
        return np.arange(len(positions))
    protected = (positions < sinks) | (positions > newest - recent)
    others = [i for i in range(len(positions)) if not protected[i]]
    others.sort(key=lambda i: (counts[i], -positions[i]))
    keep = list(np.nonzero(protected)[0]) + others[: budget - int(protected.sum())]
    return np.sort(np.asarray(keep, int))


def reference_steps(model, prompt_state, prompt_length, continuation, **rule):
    """Per step: (position -> count) per (layer, head) after the write, the kept positions per
    (layer, head) after eviction, and the smallest |attention - 1/n| seen."""
    cfg, params = model.config, model.params
    g = cfg.group_size
    keys, values = cached_keys_values(prompt_state)
    state_positions = np.asarray(prompt_state.positions())[:, 0]
    heads = {}
    for layer, head in np.ndindex(cfg.num_layers, cfg.num_kv_heads):
        held = state_positions[layer, head] >= 0
        heads[layer, head] = dict(
            k=np.asarray(keys[layer][0][head], np.float64),
            v=np.asarray(values[layer][0][head], np.float64),
            positions=state_positions[layer, head][held],
            counts=np.zeros(int(held.sum()), np.int64),
        )
    counts, kept, margin = [], [], np.inf
    for i, token in enumerate(continuation):
        position = prompt_length + i
        x = embed(params, jnp.asarray([[token]]))
        cos, sin = rope_cos_sin(cfg, jnp.asarray([[position]]))
        for layer in range(cfg.num_layers):
            lp = jax.tree.map(lambda a, i=layer: a[i], params["layers"])
            q, k, v = (np.asarray(a, np.float64) for a in attention_inputs(lp, cfg, x, cos, sin))
            out = np.zeros(q.shape)
            for head in range(cfg.num_kv_heads):
                h = heads[layer, head]
                all_k = np.concatenate([h["k"], k[0, head]])
                all_v = np.concatenate([h["v"], v[0, head]])
                probs = []
                for n in range(head * g, (head + 1) * g):
                    s = all_k @ q[0, n, 0] / np.sqrt(cfg.head_dim)
                    p = np.exp(s - s.max())
                    p /= p.sum()
                    out[0, n, 0] = p @ all_v
                    probs.append(p)
                attention = np.mean(probs, axis=0)[:-1]  # to the cached tokens
                average = 1.0 / len(all_k)
                margin = min(margin, np.abs(attention - average).min(initial=np.inf))
                h["counts"] = np.append(h["counts"] + (attention < average), 0)
                h["k"], h["v"] = all_k, all_v
                h["positions"] = np.append(h["positions"], position)
            x = attention_output_and_mlp(lp, cfg, x, jnp.asarray(out, jnp.float32))
        counts.append(
            {
                index: dict(zip(h["positions"].tolist(), h["counts"].tolist(), strict=True))
                for index, h in heads.items()
            }
        )
        if (i + 1) % rule["evict_every"] == 0:
            for h in heads.values():
                keep = _evict(
                    h["positions"],
                    h["counts"],
                    position,
                    rule["budget"],
                    rule["sinks"],
                    rule["recent"],
                )
                for field in ("k", "v", "positions", "counts"):
                    h[field] = h[field][keep]
        kept.append({index: sorted(h["positions"].tolist()) for index, h in heads.items()})
    return counts, kept, margin


# --- tests --------------------------------------------------------------------------------


def test_prompt_is_compressed_like_h2o_then_counts_start_at_zero(model):
    prompt = np.random.default_rng(0).integers(0, 64, 40).tolist()
    kwargs = dict(budget=16, sinks=2, recent=4)
    h2o = jaxkv.compress_prompt(
        model, [prompt], policies.H2O(**kwargs), cache=jaxkv.CacheConfig(page_size=PAGE_SIZE)
    )
    ours = jaxkv.compress_prompt(
        model,
        [prompt],
        policies.Scissorhands(**kwargs),
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
    )
    np.testing.assert_array_equal(np.asarray(ours.positions()), np.asarray(h2o.positions()))
    assert np.all(np.asarray(ours.lengths) == 16)
    assert np.all(np.asarray(h2o.token_scores())[np.asarray(h2o.positions()) >= 0] > 0)
    assert np.all(np.asarray(ours.token_scores()) == 0)


@pytest.mark.parametrize("evict_every", [1, 4])
def test_decode_matches_the_papers_rule_step_by_step(model, evict_every):
    rng = np.random.default_rng(5)
    prompt, continuation = rng.integers(0, 64, 40).tolist(), rng.integers(0, 64, 20).tolist()
    rule = dict(budget=16, sinks=2, recent=4, evict_every=evict_every)
    policy = policies.Scissorhands(**rule)
    prompt_state, counts, kept, _ = policy_steps(model, prompt, policy, continuation)
    want_counts, want_kept, margin = reference_steps(
        model, prompt_state, len(prompt), continuation, **rule
    )
    assert margin > CLEAR_MARGIN  # every indicator is a clear decision in f32 and f64
    evicted_some = False
    for step, (got, want) in enumerate(zip(counts, want_counts, strict=True)):
        assert got == want, f"counts after step {step}"
        assert kept[step] == want_kept[step], f"kept positions after step {step}"
        evicted_some |= any(len(kept[step][i]) < len(got[i]) for i in got)
    assert evicted_some
    # Counts were really ranked: some step kept a token with a count above an evicted one's.
    assert max(max(c.values()) for step in counts for c in step.values()) >= 3


def test_counts_survive_int8_storage(model):
    rng = np.random.default_rng(6)
    prompt, continuation = rng.integers(0, 64, 40).tolist(), rng.integers(0, 64, 12).tolist()
    policy = policies.Scissorhands(budget=16, recent=4, evict_every=2)
    int8 = jaxkv.CacheConfig(page_size=PAGE_SIZE, storage="int8", full_precision_window=4)
    _, counts, kept, kv = policy_steps(model, prompt, policy, continuation, cache=int8)
    assert np.all(np.asarray(kv.pool.int8.lengths) > 0)
    previous = None
    for step, (step_counts, step_kept) in enumerate(zip(counts, kept, strict=True)):
        position = len(prompt) + step
        for index, held in step_counts.items():
            assert held[position] == 0  # the new token starts at 0
            if previous is not None:  # each step adds 0 or 1 to the kept tokens' counts
                old = {p: c for p, c in held.items() if p != position}
                assert old.keys() == previous[index].keys()
                assert all(old[p] - previous[index][p] in (0, 1) for p in old)
            assert len(step_kept[index]) == (16 if (step + 1) % 2 == 0 else len(held))
        previous = {i: {p: step_counts[i][p] for p in step_kept[i]} for i in step_kept}
    assert max(max(c.values()) for c in previous.values()) >= 2


def test_generate_evicts_in_blocks_and_keeps_the_window(model):
    prompt = np.random.default_rng(7).integers(0, 64, 60).tolist()
    policy = policies.get("scissorhands", budget=20, sinks=2, recent=6, evict_every=4)
    assert isinstance(policy, policies.Scissorhands)
    out = jaxkv.generate(
        model,
        [prompt],
        max_new_tokens=8,
        stop_tokens=(),
        policy=policy,
        cache=jaxkv.CacheConfig(page_size=PAGE_SIZE),
    )
    lengths = np.asarray(out.state.lengths)
    assert np.all(lengths == 20 + 3)  # 7 tokens written: evicted to 20 after the 4th
    positions = np.asarray(out.state.positions())
    newest = 60 + 8 - 2
    for index in np.ndindex(lengths.shape):
        held = set(positions[index][positions[index] >= 0].tolist())
        assert {0, 1} <= held and set(range(newest - 5, newest + 1)) <= held


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(budget=16, evict_every=0), "evict_every"),
        (dict(budget=16, recent=-1), "recent"),
        (dict(budget=16, sinks=-2), "sinks"),
        (dict(budget=0), "budget"),
        (dict(budget=16, window=8), "no field 'window'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        policies.get("scissorhands", **kwargs)


def test_bad_geometry_is_refused(model):
    prompt = [list(range(30))]
    with pytest.raises(ValueError, match="smaller than the 10 tokens each head protects"):
        jaxkv.compress_prompt(model, prompt, policies.Scissorhands(budget=8, sinks=4, recent=6))
    with pytest.raises(ValueError, match="prefill_chunk=1"):
        jaxkv.compress_prompt(model, prompt, policies.Scissorhands(budget=8), prefill_chunk=1)
    with pytest.raises(ValueError, match="needs budget"):
        jaxkv.compress_prompt(model, prompt, policies.Scissorhands())
    with pytest.raises(ValueError, match="'scissorhands' and 'quest' both have a budget"):
        policies.compose(policies.Scissorhands(budget=8), policies.Quest(budget=8))
