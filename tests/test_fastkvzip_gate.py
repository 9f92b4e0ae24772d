"""Fast KVzip's sink-attention gate: the formula against plain numpy, shape checks, persistence."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxkv.gates import fastkvzip as gate
from models.configs import Family
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
    """The paper's formula token by token, head by head, in float64. h [C, D] -> [K, C]."""
    k_heads, g = p["bias"].shape
    e = p["q_norm"].shape[0]

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x) + 1e-6) * w

    out = np.zeros((k_heads, len(h)))
    for t, x in enumerate(h.astype(np.float64)):
        for k in range(k_heads):
            key = rms(x @ p["wk"][:, k], p["k_norm"])
            per_head = []
            for j in range(g):
                q = rms(x @ p["wq"][:, k, j] + p["bq"][k, j], p["q_norm"])
                logit = q @ key / np.sqrt(e) + p["bias"][k, j]
                sinks = p["sinks"][k] @ q / np.sqrt(e)
                per_head.append(1.0 / (1.0 + np.sum(np.exp(sinks - logit))))
            out[k, t] = np.mean(per_head)
    return out


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
