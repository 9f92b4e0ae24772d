"""WG-KV inference: dual cache (local ring + global pages), lazy promotion, vertical-slash prefill.

Every check compares the paged path (chunked prefill, then decode steps as chunks of one token)
against a dense numpy forward over the whole sequence with the mask (i - j < W) OR (g_j > tau),
with g computed by `write_gate_values` on the model's own keys. W = 8 and pages of 4 tokens make
the ring wrap and promotions cross page boundaries.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import policies
from jaxkv.cache import KVState, PoolExhaustedError
from jaxkv.gates.wgkv import init_write_gates, write_gate_values
from jaxkv.models import init_model
from jaxkv.models.configs import Family
from jaxkv.models.decoder import (
    attention_input,
    attention_output_and_mlp,
    embed,
    final_hidden,
    forward,
    logits_from_hidden,
    project_queries,
    project_unrotated_keys_values,
)
from jaxkv.models.layers import apply_rope, rope_cos_sin
from jaxkv.step import parts
from jaxkv.step.forward import forward_cached
from tests import dense_reference as decode_reference
from tests.test_quest import _quest_select
from tests.tiny_models import tiny_config

WINDOW = 8
PAGE = 4
TAU = 0.5
WGKV = policies.WGKV(tau=TAU, window=WINDOW)  # one policy for all tests: compiled once
# Width 32; Llama with head dim 8, Qwen3 with 16 (the kernels' minimum).
CONFIGS = {
    "llama": tiny_config(Family.LLAMA, hidden_size=32, intermediate_size=64, head_dim=8),
    "qwen3": tiny_config(Family.QWEN3, hidden_size=32, intermediate_size=64),
}
PROMPT_LENGTHS = (37, 26)
DECODE_STEPS = 11


@functools.cache
def tiny_model(name):
    return init_model(CONFIGS[name], seed=5, scale=0.3)


def forced_gates(cfg, logit: float):
    """Gates with g = sigmoid(logit) (clamped >= 1e-3) for every token."""
    params = init_write_gates(cfg, jax.random.PRNGKey(0))
    return params | {"w2": jnp.zeros_like(params["w2"]), "b2": jnp.full_like(params["b2"], logit)}


def random_gates(cfg):
    """Gates whose values spread on both sides of TAU."""
    params = init_write_gates(cfg, jax.random.PRNGKey(7))
    return params | {"w2": 8.0 * params["w2"], "b2": jnp.zeros_like(params["b2"])}


def prompts_and_continuations():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in PROMPT_LENGTHS]
    return prompts, rng.integers(0, 64, (len(prompts), DECODE_STEPS))


def wgkv_gate_fn(gate_params):
    def gates(layer, k_unrotated, k, positions):
        del positions
        layer_params = jax.tree.map(lambda x: x[layer], gate_params)
        return np.asarray(write_gate_values(layer_params, k_unrotated, k))

    return gates


def dense_reference(model, tokens, gate_fn, window, tau):
    """Logits [T, V] and gates [L, K, T] of one sequence, every layer attending densely in
    float64 with the mask causal AND ((i - j < window) OR (g_j > tau)), where
    g = gate_fn(layer, k_unrotated, k, positions) [1, K, T]."""
    cfg, params = model.config, model.params
    t = len(tokens)
    positions = jnp.arange(t)[None]
    cos, sin = rope_cos_sin(cfg, positions)
    x = embed(params, jnp.asarray(tokens)[None])
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    gates = []
    for layer in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, n=layer: a[n], params["layers"])
        h = attention_input(lp, cfg, x)
        q = np.asarray(project_queries(lp, cfg, h, cos, sin), np.float64)[0]  # [N, T, H]
        k_unrotated, v = project_unrotated_keys_values(lp, cfg, h)
        k = apply_rope(k_unrotated, cos, sin)
        g = gate_fn(layer, k_unrotated, k, positions)[0]  # [K, T]
        gates.append(g)
        k, v = np.asarray(k, np.float64)[0], np.asarray(v, np.float64)[0]
        out = np.zeros_like(q)
        for head in range(cfg.num_heads):
            kv_head = head // cfg.group_size
            visible = (j <= i) & ((i - j < window) | (g[kv_head][None, :] > tau))
            scores = np.where(visible, q[head] @ k[kv_head].T / np.sqrt(cfg.head_dim), -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            out[head] = (probs / probs.sum(-1, keepdims=True)) @ v[kv_head]
        x = attention_output_and_mlp(lp, cfg, x, jnp.asarray(out[None], jnp.float32))
    logits = np.asarray(logits_from_hidden(params, cfg, final_hidden(params, cfg, x)))[0]
    return logits, np.stack(gates)


@functools.partial(jax.jit, static_argnames=("policy", "backend"))
def _chunk(model, kv, tokens, positions, policy_params, read_budget, policy, backend="xla"):
    hidden, kv, _ = forward_cached(
        model,
        tokens,
        positions,
        kv,
        policy=policy,
        policy_params=policy_params,
        read_budget=read_budget,
        backend=backend,
        thresholds=jnp.asarray(policy.thresholds(tokens.shape[0])),
    )
    return logits_from_hidden(model.params, model.config, hidden), kv


def new_state(cfg, batch, max_tokens, policy, num_pages=400):
    return KVState.create(
        num_layers=cfg.num_layers,
        batch=batch,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_tokens=max_tokens,
        page_size=PAGE,
        num_pages=num_pages,
        dtype=jnp.float32,
        key_bounds=policy.selection is not None,
        local_window=parts.local_window(policy),
    )


def cached_run(
    model, prompts, continuations, policy, policy_params, chunk, read_budget=None, backend="xla"
):
    """Chunked prefill then one decode step per continuation token through `forward_cached`.

    Returns (prefill logits per prompt [len, V], decode logits [S, B, V], state after prefill,
    state at the end).
    """
    lengths = np.array([len(p) for p in prompts])
    padded = -(-lengths.max() // chunk) * chunk
    tokens = np.zeros((len(prompts), padded), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    kv = new_state(model.config, len(prompts), padded + continuations.shape[1], policy)
    prefill = []
    for start in range(0, padded, chunk):
        index = start + np.arange(chunk)
        positions = np.where(index < lengths[:, None], index, -1)
        logits, kv = _chunk(
            model,
            kv,
            tokens[:, start : start + chunk],
            positions,
            policy_params,
            None,
            policy,
            backend,
        )
        prefill.append(np.asarray(logits))
    prefill = np.concatenate(prefill, axis=1)
    prefilled = kv
    decoded = []
    for step in range(continuations.shape[1]):
        positions = (lengths + step)[:, None]
        logits, kv = _chunk(
            model,
            kv,
            continuations[:, step : step + 1],
            positions,
            policy_params,
            read_budget,
            policy,
            backend,
        )
        decoded.append(np.asarray(logits)[:, 0])
    assert not bool(kv.pool.overflow)
    decoded = np.stack(decoded) if decoded else np.zeros((0, len(prompts), 0))
    return [prefill[b, :n] for b, n in enumerate(lengths)], decoded, prefilled, kv


def assert_matches_reference(model, policy, policy_params, chunk, reference, backend="xla"):
    """Prefill and every decode step equal `reference(tokens) -> logits [T, V]`; returns the
    final state."""
    prompts, continuations = prompts_and_continuations()
    prefill, decoded, _, final = cached_run(
        model, prompts, continuations, policy, policy_params, chunk, backend=backend
    )
    for b, prompt in enumerate(prompts):
        expected = reference([*prompt, *continuations[b]])
        np.testing.assert_allclose(prefill[b], expected[: len(prompt)], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(decoded[:, b], expected[len(prompt) :], atol=1e-5, rtol=1e-5)
    return final


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gates_forced_to_one_equal_full_attention(name):
    model = tiny_model(name)
    gates = forced_gates(model.config, 30.0)

    def full_attention(tokens):
        return np.asarray(forward(model, jnp.asarray(tokens)[None]))[0]

    final = assert_matches_reference(model, WGKV, gates, 16, full_attention)
    held = np.asarray(final.lengths) + WINDOW  # every token left the ring into the global cache
    np.testing.assert_array_equal(held[:, :, 0], [np.array(PROMPT_LENGTHS) + DECODE_STEPS] * 2)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gates_forced_to_zero_equal_sliding_window(name):
    model = tiny_model(name)
    gates = forced_gates(model.config, -30.0)  # g = 1e-3 (the clamp) <= tau

    def band(tokens):
        no_gates = np.zeros((1, model.config.num_kv_heads, len(tokens)))
        return dense_reference(model, tokens, lambda *_: no_gates, WINDOW, TAU)[0]

    final = assert_matches_reference(model, WGKV, gates, 16, band)
    assert int(final.pages_in_use()) == 0  # nothing ever reached the global cache
    assert final.memory_bytes() == final.ring_bytes > 0


@pytest.mark.parametrize(
    ("name", "chunk", "backend"),
    [
        ("llama", 16, "xla"),
        ("qwen3", 16, "xla"),
        ("llama", 3, "xla"),
        ("qwen3", 40, "interpret"),  # head dim 16: the kernels' minimum
        ("qwen3", 40, "interpret-tpu"),
        pytest.param("qwen3", 40, "pallas", marks=pytest.mark.gpu),
    ],
)
def test_random_gates_equal_vertical_slash_reference(name, chunk, backend):
    model = tiny_model(name)
    gates = random_gates(model.config)

    def reference(tokens):
        return dense_reference(model, tokens, wgkv_gate_fn(gates), WINDOW, TAU)[0]

    final = assert_matches_reference(model, WGKV, gates, chunk, reference, backend)
    # Global pages hold exactly the admitted tokens that left the ring; the ring the last W.
    prompts, continuations = prompts_and_continuations()
    for b, prompt in enumerate(prompts):
        tokens = [*prompt, *continuations[b]]
        _, g = dense_reference(model, tokens, wgkv_gate_fn(gates), WINDOW, TAU)  # [L, K, T]
        admitted = g > TAU
        assert 0.2 < admitted.mean() < 0.8  # the gates really choose
        for layer in range(model.config.num_layers):
            ring = np.asarray(final.ring.positions[layer, b])
            np.testing.assert_array_equal(
                np.sort(ring), np.arange(len(tokens) - WINDOW, len(tokens))
            )
            held = np.asarray(final.positions(layer))[b]
            scores = np.asarray(final.token_scores(layer))[b]
            for head in range(model.config.num_kv_heads):
                expected = np.flatnonzero(admitted[layer, head, : len(tokens) - WINDOW])
                np.testing.assert_array_equal(np.sort(held[head][held[head] >= 0]), expected)
                kept = held[head] >= 0
                np.testing.assert_allclose(
                    scores[head][kept], g[layer, head, held[head][kept]], rtol=1e-5
                )


def test_generate_follows_the_reference_and_holds_admitted_tokens_plus_the_ring():
    model = tiny_model("qwen3")
    cfg = model.config
    gates = random_gates(cfg)
    prompts, _ = prompts_and_continuations()
    out = jaxkv.generate(
        model,
        prompts,
        max_new_tokens=DECODE_STEPS,
        policy=WGKV,
        policy_params=gates,
        stop_tokens=(),
        cache=jaxkv.CacheConfig(page_size=PAGE),
        prefill_chunk=16,
    )
    page_bytes = out.state.pool.page_bytes
    pages = admitted_tokens = 0
    for b, prompt in enumerate(prompts):
        generated = out.tokens[b]
        tokens = [*prompt, *generated[:-1]]
        logits, g = dense_reference(model, tokens, wgkv_gate_fn(gates), WINDOW, TAU)
        np.testing.assert_array_equal(np.argmax(logits[len(prompt) - 1 :], -1), generated)
        admitted = np.sum(g[:, :, : len(prompt) - WINDOW] > TAU, axis=-1)  # [L, K] after prefill
        pages += int(np.sum(-(-admitted // PAGE)))
        admitted_tokens += int(admitted.sum())
    ring = out.state.ring_bytes
    assert ring == cfg.num_layers * len(prompts) * (
        cfg.num_kv_heads * WINDOW * (2 * cfg.head_dim * 4 + 4 + 1) + WINDOW * 4 + 4
    )
    assert out.memory_bytes[0] == pages * page_bytes + ring
    heads = cfg.num_layers * len(prompts) * cfg.num_kv_heads
    assert (
        abs(out.memory_bytes[0] - admitted_tokens * page_bytes / PAGE - ring) <= heads * page_bytes
    )
    full = heads * np.mean(PROMPT_LENGTHS) * page_bytes / PAGE
    assert out.memory_bytes[0] < 0.9 * full


def test_pool_exhaustion_during_promotion_is_reported_and_spares_live_pages():
    model = tiny_model("llama")
    gates = forced_gates(model.config, 30.0)
    kv = new_state(model.config, 2, 48, WGKV, num_pages=20)
    tokens = np.random.default_rng(1).integers(0, 64, (2, 32)).astype(np.int32)
    positions = np.broadcast_to(np.arange(16), (2, 16))
    # 8 of 16 tokens per head leave the ring: 2 pages for each of 8 heads.
    _, before = _chunk(model, kv, tokens[:, :16], positions, gates, None, WGKV)
    _, after = _chunk(model, before, tokens[:, 16:], positions + 16, gates, None, WGKV)
    assert not bool(before.pool.overflow) and int(before.pages_in_use()) == 16
    assert bool(after.pool.overflow)  # 16 more per head do not fit in the 4 free pages
    np.testing.assert_array_equal(after.page_table, before.page_table)
    np.testing.assert_array_equal(after.lengths, before.lengths)
    live = np.asarray(before.page_table)[np.asarray(before.page_table) >= 0]
    np.testing.assert_array_equal(after.pool.k_pages[live], before.pool.k_pages[live])
    np.testing.assert_array_equal(after.pool.v_pages[live], before.pool.v_pages[live])
    assert int(after.pages_in_use()) == 16
    with pytest.raises(PoolExhaustedError):
        after.check()


def test_bad_input_is_refused_before_compiling():
    for tau in (0.0, 1.0, -0.2, 1.5):
        with pytest.raises(ValueError, match=r"tau=.* must be in \(0, 1\)"):
            policies.WGKV(tau=tau)
    for window in (0, -4):
        with pytest.raises(ValueError, match="window=.* must be > 0"):
            policies.WGKV(window=window)
    with pytest.raises(ValueError, match="window=2.5 must be an integer"):
        policies.WGKV(window=2.5)
    with pytest.raises(ValueError, match="sinks=-1"):
        policies.LocalAttention(sinks=-1)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs policy_params"):
        jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=2, policy=WGKV)
    other = init_write_gates(CONFIGS["qwen3"], jax.random.PRNGKey(0))  # head dim 16, not 8
    with pytest.raises(ValueError, match="write gate .* head dim"):
        jaxkv.generate(model, [[1, 2, 3]], max_new_tokens=2, policy=WGKV, policy_params=other)
    duo = policies.DuoAttention(window=WINDOW)
    with pytest.raises(ValueError, match=r"shape \[L, K\] = \(2, 2\)"):
        jaxkv.generate(
            model, [[1, 2, 3]], max_new_tokens=2, policy=duo, policy_params=jnp.ones((2, 4), bool)
        )
    no_ring = new_state(model.config, 1, 8, policies.FullCache())
    with pytest.raises(ValueError, match="needs a KV state with a local ring"):
        forward_cached(
            model,
            jnp.zeros((1, 1), jnp.int32),
            jnp.zeros((1, 1), jnp.int32),
            no_ring,
            policy=WGKV,
            policy_params=forced_gates(model.config, 0.0),
        )


def _global_and_visible_ring(state, position):
    """Per layer/sequence/head: the global keys and values followed by the ring tokens a query
    at `position` [B] sees (band or admitted), and how many of them are global."""
    keys, values = decode_reference.cached_keys_values(state)
    ring = jax.tree.map(np.asarray, state.ring)
    num_global = {}
    for layer, b, head in np.ndindex(ring.admitted.shape[:3]):
        pos = ring.positions[layer, b]
        visible = (pos >= 0) & ((position[b] - pos < WINDOW) | ring.admitted[layer, b, head])
        num_global[layer, b, head] = len(keys[layer][b][head])
        keys[layer][b][head] = np.concatenate(
            [keys[layer][b][head], ring.k[layer, b, head][visible]]
        )
        values[layer][b][head] = np.concatenate(
            [values[layer][b][head], ring.v[layer, b, head][visible]]
        )
    return keys, values, num_global


def test_composed_keeps_the_admission_prefill_pool_and_refuses_decode_eviction():
    config = tiny_model("llama").config
    policy = policies.compose(WGKV, policies.Quest(budget=8))
    # WG-KV's admission sizes the pool for what the gates admit (grown on demand), not Quest's
    # full-cache need (Quest has no admission part).
    assert policy.admission == WGKV.admission and policies.Quest(budget=8).admission is None
    geometry = (np.array([200, 90]), 16, config, PAGE, 8)
    assert isinstance(policy.admission.prefill_pages(*geometry), int)
    with pytest.raises(ValueError, match="'streaming_llm' and 'quest' both have a budget"):
        policies.compose(policies.StreamingLLM(budget=32), policies.Quest(budget=8))


def test_wgkv_with_quest_reads_the_selected_global_pages_and_the_whole_ring():
    model = tiny_model("llama")
    gates = random_gates(model.config)
    budget = 8
    policy = policies.compose(WGKV, policies.Quest(budget=budget))
    assert parts.local_window(policy) == WINDOW and policy.selection is not None
    prompts, continuations = prompts_and_continuations()
    _, _, state, _ = cached_run(model, prompts, continuations[:, :0], policy, gates, 16)
    assert int(np.asarray(state.lengths).max()) > 3 * PAGE  # Quest has pages to leave out
    quest = _quest_select(PAGE, budget)
    selection_mattered = False
    for step in range(4):
        token, position = continuations[:, step], np.array(PROMPT_LENGTHS) + step
        keys, values, num_global = _global_and_visible_ring(state, position)

        def select(layer, b, head, q_group, keys, num_global=num_global):
            n = num_global[layer, b, head]
            chosen = quest(layer, b, head, q_group, keys[:n]) if n else np.arange(0)
            return np.concatenate([chosen, np.arange(n, len(keys))])

        expected = decode_reference.decode_step_logits(model, token, position, keys, values, select)
        unselected = decode_reference.decode_step_logits(model, token, position, keys, values)
        logits, state = _chunk(
            model,
            state,
            token[:, None],
            position[:, None],
            gates,
            jnp.full((2,), budget, jnp.int32),
            policy,
        )
        np.testing.assert_allclose(np.asarray(logits)[:, 0], expected, atol=1e-5, rtol=1e-5)
        selection_mattered |= not np.allclose(expected, unselected, atol=1e-4)
    assert selection_mattered


RETRIEVAL = np.array([[True, False], [False, True]])


@pytest.mark.parametrize("kind", ["local", "duo"])
def test_static_admission_baselines_equal_their_dense_masks(kind):
    model = tiny_model("llama")
    sinks = 3
    if kind == "local":
        policy, params = policies.LocalAttention(tau=TAU, window=WINDOW, sinks=sinks), None
        retrieval = np.zeros_like(RETRIEVAL)
    else:
        policy = policies.DuoAttention(tau=TAU, window=WINDOW, sinks=sinks)
        params, retrieval = jnp.asarray(RETRIEVAL), RETRIEVAL

    def gate_fn(layer, k_unrotated, k, positions):
        del k_unrotated, k
        sink = np.asarray(positions)[0] < sinks
        return (sink[None, :] | retrieval[layer][:, None]).astype(np.float32)[None]

    def reference(tokens):
        return dense_reference(model, tokens, gate_fn, WINDOW, TAU)[0]

    final = assert_matches_reference(model, policy, params, 16, reference)
    left_ring = np.array(PROMPT_LENGTHS) + DECODE_STEPS - WINDOW
    expected = np.where(retrieval[:, None, :], left_ring[None, :, None], sinks)  # [L, B, K]
    np.testing.assert_array_equal(final.lengths, expected)


def _layer0_probabilities(model, tokens) -> np.ndarray:
    """float64 [B, N, T, T]: layer 0's causal attention probabilities, by hand in numpy."""
    cfg = model.config
    b, t = tokens.shape
    lp = jax.tree.map(lambda a: a[0], model.params["layers"])
    cos, sin = rope_cos_sin(cfg, jnp.broadcast_to(jnp.arange(t), (b, t)))
    h = attention_input(lp, cfg, embed(model.params, tokens))
    q = np.asarray(project_queries(lp, cfg, h, cos, sin), np.float64)
    k = np.asarray(apply_rope(project_unrotated_keys_values(lp, cfg, h)[0], cos, sin), np.float64)
    causal = np.arange(t)[None, :] <= np.arange(t)[:, None]
    probs = np.zeros((b, cfg.num_heads, t, t))
    for row, head in np.ndindex(b, cfg.num_heads):
        logits = q[row, head] @ k[row, head // cfg.group_size].T / np.sqrt(cfg.head_dim)
        logits = np.where(causal, logits, -np.inf)
        probs[row, head] = np.exp(logits - logits.max(-1, keepdims=True))
        probs[row, head] /= probs[row, head].sum(-1, keepdims=True)
    return probs


def _per_kv_head(model, per_query_head) -> np.ndarray:
    """[K]: [B, N] averaged over the batch and each KV head's query heads."""
    cfg = model.config
    return per_query_head.reshape(-1, cfg.num_kv_heads, cfg.group_size).mean(axis=(0, 2))


def test_attention_mass_on_chosen_keys_and_queries():
    model = tiny_model("llama")
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 20)), jnp.int32)
    rng = np.random.default_rng(5)
    keys, queries = rng.random((20, 20)) < 0.3, rng.random(20) < 0.5
    scores = np.asarray(policies.attention_mass(model, tokens, keys, queries))
    probs = _layer0_probabilities(model, tokens)
    expected = np.sum(probs * keys, axis=-1)[:, :, queries].mean(axis=-1)  # [B, N]
    np.testing.assert_allclose(scores[0], _per_kv_head(model, expected), rtol=1e-5, atol=1e-7)
    every_key = np.ones((20, 20), bool)  # only the causal ones count: a query's whole mass
    whole = policies.attention_mass(model, tokens, every_key, queries)
    np.testing.assert_allclose(whole, 1.0, rtol=1e-5)


def test_duo_calibration_score_and_head_choice():
    model = tiny_model("llama")
    cfg = model.config
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 24)), jnp.int32)
    sinks, window = 2, 4
    scores = np.asarray(
        policies.long_range_attention_mass(model, tokens, sinks=sinks, window=window)
    )
    assert scores.shape == (cfg.num_layers, cfg.num_kv_heads)
    i, j = np.arange(24)[:, None], np.arange(24)[None, :]
    far = (j <= i) & (j >= sinks) & (i - j >= window)
    expected = np.sum(_layer0_probabilities(model, tokens) * far, axis=-1)[..., sinks + window :]
    per_kv_head = _per_kv_head(model, expected.mean(axis=-1))
    np.testing.assert_allclose(scores[0], per_kv_head, rtol=1e-5, atol=1e-7)
    assert np.all((scores > 0) & (scores < 1))
    chosen = policies.retrieval_heads(scores, 0.5)
    assert chosen.sum() == 2 and scores[chosen].min() >= scores[~chosen].max()
    with pytest.raises(ValueError, match="fraction=1.5"):
        policies.retrieval_heads(scores, 1.5)
    with pytest.raises(ValueError, match="must exceed sinks"):
        policies.long_range_attention_mass(model, tokens[:, :6], sinks=sinks, window=window)


def test_duo_attention_picks_its_retrieval_heads_on_the_prompt():
    model = tiny_model("llama")
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 64, 24)]
    duo = policies.DuoAttention(window=4, sinks=2, retrieval_share=0.5)
    mass = policies.long_range_attention_mass(model, jnp.asarray([ids]), sinks=2, window=4)
    expected = policies.retrieval_heads(mass, 0.5)
    np.testing.assert_array_equal(duo.params.from_prompt(model, ids), expected)
    composed = policies.compose(duo, policies.Quest(budget=8))
    np.testing.assert_array_equal(composed.params.from_prompt(model, ids), expected)
    assert policies.WGKV().params.from_prompt(model, ids) is None  # gates are learned, never picked
    assert duo.static().retrieval_share is None  # host-only: no recompile per share
    # Too short to measure long-range attention (<= sinks + 1 tokens): every head retrieves.
    assert np.all(duo.params.from_prompt(model, ids[:3]))
    with pytest.raises(ValueError, match=r"retrieval_share=1.5 must be a number in \[0, 1\]"):
        policies.DuoAttention(retrieval_share=1.5)
    with pytest.raises(ValueError, match="reads its retrieval heads from heads.npy"):
        duo.params.load("heads.npy", model.config)


@pytest.mark.parametrize(
    "backend", ["interpret", "interpret-tpu", pytest.param("pallas", marks=pytest.mark.gpu)]
)
def test_wgkv_with_quest_kernel_backend_equals_xla(backend):
    model = tiny_model("qwen3")
    gates = random_gates(model.config)
    prompts, _ = prompts_and_continuations()
    kwargs = dict(
        max_new_tokens=2,
        policy=policies.compose(WGKV, policies.Quest(budget=8)),
        policy_params=gates,
        stop_tokens=(),
        cache=jaxkv.CacheConfig(page_size=PAGE),
        prefill_chunk=16,
    )
    want = jaxkv.generate(model, prompts, **kwargs)
    got = jaxkv.generate(model, prompts, backend=backend, **kwargs)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.memory_bytes, want.memory_bytes)
    np.testing.assert_array_equal(got.state.ring.positions, want.state.ring.positions)
    np.testing.assert_allclose(got.state.ring.k, want.state.ring.k, atol=1e-5)


def gated_context_then_all(gate_params, context_length):
    """The learned gates on the first `context_length` positions, 1 (admitted) after them."""

    def gates(layer, k_unrotated, k, positions):
        g = wgkv_gate_fn(gate_params)(layer, k_unrotated, k, positions)
        return np.where(np.arange(g.shape[-1]) < context_length, g, 1.0)

    return gates


def test_full_cache_continues_a_compressed_wgkv_state():
    """The quality benchmark's multi-question path: compress the context with WG-KV, then read
    more tokens over it with the full-cache policy (everything new is admitted)."""
    model = tiny_model("llama")
    gates = random_gates(model.config)
    prompts, continuations = prompts_and_continuations()
    state = jaxkv.compress_prompt(
        model,
        prompts,
        WGKV,
        policy_params=gates,
        cache=jaxkv.CacheConfig(page_size=PAGE),
        prefill_chunk=16,
        reserve_tokens=DECODE_STEPS,
    )
    positions = np.array(PROMPT_LENGTHS)[:, None] + np.arange(DECODE_STEPS)
    full = policies.FullCache()
    logits, _ = _chunk(model, state, continuations, positions, None, None, full)
    for b, prompt in enumerate(prompts):
        tokens = [*prompt, *continuations[b]]
        gate_fn = gated_context_then_all(gates, len(prompt))
        expected, _ = dense_reference(model, tokens, gate_fn, WINDOW, TAU)
        np.testing.assert_allclose(logits[b], expected[len(prompt) :], atol=1e-5, rtol=1e-5)


def _compiled(programs) -> list[int]:
    return [program.jitted._cache_size() for program in programs]


def test_a_tau_sweep_compiles_once_and_each_tau_admits_its_own_tokens():
    """tau travels as an array (`Policy.thresholds`): generate over three taus compiles no
    program again after the first, and a higher tau admits fewer tokens (each token's gate is
    compared with its own request's tau)."""
    from jaxkv.generation import loop, prefill

    model = tiny_model("llama")
    gates = random_gates(model.config)
    prompt = prompts_and_continuations()[0][:1]
    programs = (prefill.prefill_span, prefill.compress, loop.decode_loop)

    def held(tau: float) -> int:
        policy = policies.WGKV(tau=tau, window=WINDOW)
        out = jaxkv.generate(
            model, prompt, max_new_tokens=4, policy=policy, policy_params=gates, stop_tokens=()
        )
        return int(np.asarray(out.state.lengths).sum())

    first = held(0.2)
    before = _compiled(programs)
    rest = [held(tau) for tau in (0.4, 0.6, 0.8)]
    assert _compiled(programs) == before
    assert first > rest[0] > rest[1] > rest[2]
