"""WG-KV write gates: the formula against plain numpy, init ranges, shape checks, save/load."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.gates import wgkv
from jaxkv.models.configs import Family
from tests.tiny_models import tiny_config

LLAMA = tiny_config(Family.LLAMA, num_layers=3, head_dim=8)
QWEN3 = tiny_config(Family.QWEN3)


def numpy_gate(layer, k_unrotated, k):
    """g[b, k, t] written loop by loop in float64 from the formula in `jaxkv.gates.wgkv`'s
    docstring (docs/wgkv.md)."""
    erf = np.vectorize(math.erf)

    def norm(x, w):
        return w * x / np.sqrt(np.mean(x * x) + 1e-6)

    batch, heads, time, _ = k.shape
    out = np.zeros((batch, heads, time))
    for b in range(batch):
        for h in range(heads):
            for t in range(time):
                x = np.concatenate(
                    [
                        norm(k_unrotated[b, h, t], layer["norm_unrotated"]),
                        norm(k[b, h, t], layer["norm_rotated"]),
                    ]
                )
                pre = x @ layer["w1"][h] + layer["b1"][h]
                hidden = 0.5 * pre * (1 + erf(pre / math.sqrt(2)))
                logit = hidden @ layer["w2"][h] + layer["b2"][h]
                out[b, h, t] = max(1 / (1 + math.exp(-logit)), 1e-3)
    return out


def random_gates(cfg, seed, scale=1.0):
    """Gates with non-trivial norms and weights scaled to spread g over (0, 1)."""
    params = wgkv.init_write_gates(cfg, jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)
    return {
        name: jnp.asarray(
            np.asarray(value) * scale
            if not name.startswith("norm")
            else rng.uniform(0.5, 1.5, value.shape),
            jnp.float32,
        )
        for name, value in params.items()
    }


@pytest.mark.parametrize("cfg", [LLAMA, QWEN3], ids=["llama", "qwen3"])
def test_gate_values_match_numpy(cfg):
    params = random_gates(cfg, seed=1, scale=6.0)
    rng = np.random.default_rng(2)
    shape = (2, cfg.num_kv_heads, 7, cfg.head_dim)
    k_unrotated = rng.normal(size=shape).astype(np.float32)
    k = rng.normal(size=shape).astype(np.float32)
    for layer_index in range(cfg.num_layers):
        layer = jax.tree.map(lambda x, i=layer_index: x[i], params)
        got = wgkv.write_gate_values(layer, jnp.asarray(k_unrotated), jnp.asarray(k))
        assert got.dtype == jnp.float32 and got.shape == shape[:3]
        layer64 = {name: np.asarray(value, np.float64) for name, value in layer.items()}
        np.testing.assert_allclose(
            np.asarray(got), numpy_gate(layer64, k_unrotated, k), rtol=1e-5, atol=1e-6
        )
    assert float(jnp.std(got)) > 0.05  # the scaled weights spread the gate values


def test_gate_is_clamped_and_bf16_keys_read_in_f32():
    params = wgkv.init_write_gates(LLAMA, jax.random.PRNGKey(0))
    layer = jax.tree.map(lambda x: x[0], params)
    layer["b2"] = jnp.full_like(layer["b2"], -50.0)
    keys = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 5, 8))
    np.testing.assert_array_equal(
        np.asarray(wgkv.write_gate_values(layer, keys, keys)), np.float32(1e-3)
    )
    layer = jax.tree.map(lambda x: x[1], params)
    bf16 = keys.astype(jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(wgkv.write_gate_values(layer, bf16, bf16)),
        np.asarray(wgkv.write_gate_values(layer, bf16.astype(jnp.float32), bf16)),
    )


def test_init_shapes_and_ranges():
    params = wgkv.init_write_gates(LLAMA, jax.random.PRNGKey(0))
    width = 4 * LLAMA.head_dim
    assert {n: v.shape for n, v in params.items()} == {
        "norm_unrotated": (3, 8),
        "norm_rotated": (3, 8),
        "w1": (3, 2, 16, width),
        "b1": (3, 2, width),
        "w2": (3, 2, width),
        "b2": (3, 2),
    }
    assert all(v.dtype == jnp.float32 for v in params.values())
    np.testing.assert_array_equal(np.asarray(params["norm_rotated"]), 1.0)
    for name, fan_in in (("w1", 16), ("b1", 16), ("w2", width), ("b2", width)):
        bound = 1 / math.sqrt(fan_in)
        values = np.asarray(params[name])
        assert np.abs(values).max() <= bound and np.abs(values).max() > 0.8 * bound
    assert wgkv.init_write_gates(QWEN3, jax.random.PRNGKey(0))["w1"].shape[-1] == 24
    assert wgkv.init_write_gates(LLAMA, jax.random.PRNGKey(0), expand=1.5)["w1"].shape[-1] == 12
    with pytest.raises(ValueError, match="expand"):
        wgkv.init_write_gates(LLAMA, jax.random.PRNGKey(0), expand=1.1)
    with pytest.raises(ValueError, match="expand"):
        wgkv.init_write_gates(LLAMA, jax.random.PRNGKey(0), expand=0)


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (dict(num_layers=4), "layers 3 vs the model's 4"),
        (dict(num_kv_heads=4), "KV heads 2 vs the model's 4"),
        (dict(head_dim=16), "head dim 8 vs the model's 16"),
    ],
)
def test_check_names_the_mismatch(other, message):
    params = wgkv.init_write_gates(LLAMA, jax.random.PRNGKey(0))
    wgkv.check_write_gates(params, LLAMA)
    cfg = dataclasses.replace(LLAMA, **other)
    with pytest.raises(ValueError, match=message):
        wgkv.check_write_gates(params, cfg)


def test_check_rejects_missing_keys_and_wrong_dtype():
    params = wgkv.init_write_gates(LLAMA, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="keys"):
        wgkv.check_write_gates({k: v for k, v in params.items() if k != "b2"}, LLAMA)
    with pytest.raises(ValueError, match="float32"):
        wgkv.check_write_gates({**params, "w2": params["w2"].astype(jnp.bfloat16)}, LLAMA)
    with pytest.raises(ValueError, match="b1"):
        wgkv.check_write_gates({**params, "b1": params["b1"][:, :, :-1]}, LLAMA)


@pytest.mark.parametrize("name", ["gates.safetensors", "gates_orbax"])
def test_save_load_round_trip(tmp_path, name):
    params = random_gates(LLAMA, seed=5)
    wgkv.save_write_gates(params, tmp_path / name)
    loaded = wgkv.load_write_gates(tmp_path / name, LLAMA)
    assert set(loaded) == set(params)
    for key, value in params.items():
        np.testing.assert_array_equal(np.asarray(loaded[key]), np.asarray(value))
    other = dataclasses.replace(LLAMA, num_layers=2)
    with pytest.raises(ValueError, match="layers"):
        wgkv.load_write_gates(tmp_path / name, other)
    with pytest.raises(FileNotFoundError):
        wgkv.load_write_gates(tmp_path / "missing.safetensors", LLAMA)
