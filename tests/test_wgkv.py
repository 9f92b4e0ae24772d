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

from jaxkv import policies
from jaxkv.cache import KVState
from jaxkv.gates.wgkv import init_write_gates, write_gate_values
from models import ModelConfig, forward_cached, init_model
from models.configs import Family
from models.decoder import (
    attention_input,
    attention_output_and_mlp,
    embed,
    final_hidden,
    forward,
    logits_from_hidden,
    project_queries,
    project_unrotated_keys_values,
)
from models.layers import apply_rope, rope_cos_sin

WINDOW = 8
PAGE = 4
TAU = 0.5
WGKV = policies.WGKV(tau=TAU, window=WINDOW)  # one policy for all tests: compiled once
CONFIGS = {
    "llama": ModelConfig(
        family=Family.LLAMA,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    ),
    "qwen3": ModelConfig(
        family=Family.QWEN3,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
    ),
}
PROMPT_LENGTHS = (37, 26)
DECODE_STEPS = 11


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return init_model(CONFIGS[request.param], seed=5, scale=0.3)


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


@functools.partial(jax.jit, static_argnames="policy")
def _chunk(model, kv, tokens, positions, policy_params, read_budget, policy):
    hidden, kv, _ = forward_cached(
        model,
        tokens,
        positions,
        kv,
        policy=policy,
        policy_params=policy_params,
        read_budget=read_budget,
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
        key_bounds=policy.selects_pages,
        local_window=policy.local_window,
    )


def cached_run(model, prompts, continuations, policy, policy_params, chunk, read_budget=None):
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
            model, kv, tokens[:, start : start + chunk], positions, policy_params, None, policy
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
        )
        decoded.append(np.asarray(logits)[:, 0])
    assert not bool(kv.pool.overflow)
    return [prefill[b, :n] for b, n in enumerate(lengths)], np.stack(decoded), prefilled, kv


def assert_matches_reference(model, policy, policy_params, chunk, reference):
    """Prefill and every decode step equal `reference(tokens) -> logits [T, V]`."""
    prompts, continuations = prompts_and_continuations()
    prefill, decoded, _, final = cached_run(
        model, prompts, continuations, policy, policy_params, chunk
    )
    for b, prompt in enumerate(prompts):
        expected = reference([*prompt, *continuations[b]])
        np.testing.assert_allclose(prefill[b], expected[: len(prompt)], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(decoded[:, b], expected[len(prompt) :], atol=1e-5, rtol=1e-5)
    return final


def test_gates_forced_to_one_equal_full_attention(model):
    gates = forced_gates(model.config, 30.0)

    def full_attention(tokens):
        return np.asarray(forward(model, jnp.asarray(tokens)[None]))[0]

    final = assert_matches_reference(model, WGKV, gates, 16, full_attention)
    held = np.asarray(final.lengths) + WINDOW  # every token left the ring into the global cache
    np.testing.assert_array_equal(held[:, :, 0], [np.array(PROMPT_LENGTHS) + DECODE_STEPS] * 2)


def test_gates_forced_to_zero_equal_sliding_window(model):
    gates = forced_gates(model.config, -30.0)  # g = 1e-3 (the clamp) <= tau

    def band(tokens):
        no_gates = np.zeros((1, model.config.num_kv_heads, len(tokens)))
        return dense_reference(model, tokens, lambda *_: no_gates, WINDOW, TAU)[0]

    final = assert_matches_reference(model, WGKV, gates, 16, band)
    assert int(final.pages_in_use()) == 0  # nothing ever reached the global cache
    assert final.memory_bytes() == final.ring_bytes > 0


@pytest.mark.parametrize("chunk", [3, 16])
def test_random_gates_equal_vertical_slash_reference(model, chunk):
    gates = random_gates(model.config)

    def reference(tokens):
        return dense_reference(model, tokens, wgkv_gate_fn(gates), WINDOW, TAU)[0]

    final = assert_matches_reference(model, WGKV, gates, chunk, reference)
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
                    scores[head][kept], g[layer, head, held[head][kept]], rtol=1e-6
                )
