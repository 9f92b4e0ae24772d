"""Fast KVzip's sink-attention gate: the formula against plain numpy, shape checks, persistence."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxkv.gates import fastkvzip as gate
from jaxkv.models.configs import Family
from tests.tiny_models import tiny_config

CONFIG = tiny_config(
    Family.LLAMA, hidden_size=32, intermediate_size=64, head_dim=8, max_position_embeddings=256
)


def random_params(seed=0):
    params = gate.init_params(CONFIG, jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)
    # Non-trivial norms and biases, so that every term of the formula matters.
    return {name: np.asarray(v) + 0.3 * rng.standard_normal(v.shape) for name, v in params.items()}


def numpy_scores(p, h):
    """The gate of Fast KVzip (arXiv:2601.17668; docs/fastkvzip.md, "Gate"), written from its
    description, token by token and head by head in float64.

    h [C, D] -> [K, C]. For KV head k, query head j: q = RMSNorm_q(W_q h + b_q), key =
    RMSNorm_k(W_k h) (RMSNorm over D' = E, one weight, eps 1e-6); logit = q . key / sqrt(D') + b
    with b[k, j] added once; sinks_r = q . k_sink_r / sqrt(D'); the token's own key competes
    with the S sinks in one softmax: score = e^logit / (e^logit + sum_r e^sinks_r), the same
    as 1 / (1 + sum_r exp(sinks_r - logit)); s_k = mean over j.
    """
    wq, bq, wk = (np.asarray(p[n], np.float64) for n in ("wq", "bq", "wk"))
    q_weight, k_weight = np.asarray(p["q_norm"], np.float64), np.asarray(p["k_norm"], np.float64)
    sink_keys, logit_bias = np.asarray(p["sinks"], np.float64), np.asarray(p["bias"], np.float64)
    num_kv, group, dim = bq.shape

    def rms_norm(x, weight):
        return weight * x / np.sqrt(np.sum(x**2) / len(x) + 1e-6)

    out = np.zeros((num_kv, len(h)))
    for t, token in enumerate(np.asarray(h, np.float64)):
        for k in range(num_kv):
            key = rms_norm(np.einsum("d,de->e", token, wk[:, k]), k_weight)
            scores = []
            for j in range(group):
                q = rms_norm(np.einsum("d,de->e", token, wq[:, k, j]) + bq[k, j], q_weight)
                logits = np.concatenate(
                    [
                        [q.dot(key) / np.sqrt(dim) + logit_bias[k, j]],
                        sink_keys[k].dot(q) / np.sqrt(dim),
                    ]
                )
                e = np.exp(logits - logits.max())
                scores.append(e[0] / e.sum())
            out[k, t] = sum(scores) / group
    return out


def test_logit_bias_is_added_once():
    """Raising b[k, j] by delta multiplies the score's odds e^logit / sum_r e^sinks_r by
    e^delta (added twice it would be e^(2 delta))."""
    params = jax.tree.map(np.float32, random_params(3))
    lp = gate.layer_slice(params, 0)
    h = np.random.default_rng(4).standard_normal((1, 5, CONFIG.hidden_size)).astype(np.float32)
    delta = 0.75
    shifted = dict(lp, bias=lp["bias"] + np.float32(delta))
    before = np.asarray(gate.head_scores(lp, h), np.float64)
    after = np.asarray(gate.head_scores(shifted, h), np.float64)
    odds_ratio = (after / (1 - after)) / (before / (1 - before))
    np.testing.assert_allclose(odds_ratio, np.exp(delta), rtol=1e-4)


def test_fastkvzip_needs_policy_params():
    from jaxkv import policies

    part = policies.get("fastkvzip", ratio=0.5).params
    assert isinstance(part, policies.SinkGateParams) and part.kind == "fastkvzip"
    with pytest.raises(ValueError, match="'fastkvzip' needs policy_params: the trained gates"):
        policies.get("fastkvzip", ratio=0.5).check_params(None, CONFIG)


def test_gate_matches_numpy_formula():
    params = random_params()
    h = np.random.default_rng(1).standard_normal((2, 7, CONFIG.hidden_size)).astype(np.float32)
    for layer in range(CONFIG.num_layers):
        lp = gate.layer_slice(params, layer)
        got = np.asarray(gate.gate_scores(jax.tree.map(np.float32, lp), h))
        assert got.shape == (2, CONFIG.num_kv_heads, 7)
        for b in range(2):
            np.testing.assert_allclose(got[b], numpy_scores(lp, h[b]), rtol=2e-5, atol=1e-6)


def test_check_params_names_the_bad_leaf():
    params = random_params()
    gate.check_params(params, CONFIG)
    bad = dict(params, bias=np.zeros((CONFIG.num_layers, 3, 2)))
    with pytest.raises(ValueError, match="'bias' has shape"):
        gate.check_params(bad, CONFIG)
    with pytest.raises(ValueError, match="keys"):
        gate.check_params({"wq": params["wq"]}, CONFIG)
    deeper = dataclasses.replace(CONFIG, num_layers=3)
    with pytest.raises(ValueError, match="L=3"):
        gate.check_params(params, deeper)


def test_safetensors_and_orbax_round_trip(tmp_path):
    params = jax.tree.map(np.float32, random_params(2))
    gate.save_safetensors(params, tmp_path / "gates.safetensors", metadata={"steps": 3})
    loaded = gate.load_safetensors(tmp_path / "gates.safetensors", CONFIG)
    gate.save_orbax(params, tmp_path / "orbax")
    restored = gate.load_orbax(tmp_path / "orbax", CONFIG)
    for name, value in params.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)
        np.testing.assert_array_equal(np.asarray(restored[name]), value)
