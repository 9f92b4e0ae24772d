"""WG-KV's gate fitted to KVzip-style targets: the gate sees from a targets file's h exactly
what it sees in the model's own forward, a fit recovers a gate of its own form, and the fitted
gates load as WG-KV's parameters."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import policies
from jaxkv.benchmarks import wgkv_gate_capacity as capacity
from jaxkv.gates import wgkv as gate
from jaxkv.model_sources import load_model
from jaxkv.train import fastkvzip, wgkv
from tests import gguf_files

LENGTH = 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return gguf_files.write_tiny_qwen2(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def model(model_path):
    return load_model(model_path, dtype="float32")[0]


def _attention_inputs(model, contexts: int, seed: int) -> np.ndarray:
    """h [contexts * LENGTH, L, D] f16 of random token contexts, as a targets file holds it."""
    tokens = jax.random.randint(
        jax.random.PRNGKey(seed), (contexts, LENGTH), 0, model.config.vocab_size
    )
    h = fastkvzip.layer_inputs(model, tokens)  # [L, B, T, D]
    return np.asarray(
        h.transpose(1, 2, 0, 3).reshape(contexts * LENGTH, h.shape[0], -1), np.float16
    )


def test_gate_values_from_h_are_the_models_own_forward(model):
    """With the band over the whole row the gated forward is the dense one, so its gate values
    come from the keys `layer_inputs`' h gives."""
    gates = gate.init_write_gates(model.config, jax.random.PRNGKey(1))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, LENGTH), 0, model.config.vocab_size)
    _, expected = wgkv.decoder_hidden(model.params, model.config, tokens, gates, band=LENGTH)
    h = fastkvzip.layer_inputs(model, tokens)  # [L, B, T, D]
    for row in range(2):
        got = capacity.gate_values(gates, model, h[:, row].transpose(1, 0, 2), jnp.arange(LENGTH))
        want = expected[:, row].transpose(2, 0, 1)  # [T, L, K]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert float(jnp.std(want)) > 1e-3  # the gates say different things about tokens


def _targets_file(path, model, teacher) -> None:
    """h of random contexts and, as targets, a teacher gate's values on them: learnable by the
    gate's form."""
    arrays = {}
    for split, contexts, seed in (("train", 16, 3), ("validation", 4, 4)):
        h = _attention_inputs(model, contexts, seed)
        positions = jnp.arange(len(h)) % LENGTH
        arrays[f"{split}_h"] = h
        arrays[f"{split}_targets"] = np.asarray(
            capacity.gate_values(teacher, model, jnp.asarray(h), positions)
        )
    arrays["provenance"] = np.array(json.dumps({"length": LENGTH}))
    np.savez(path, **arrays)


def test_a_fit_recovers_a_gate_of_its_own_form_and_saves_wgkv_parameters(
    model_path, model, tmp_path
):
    teacher = gate.init_write_gates(model.config, jax.random.PRNGKey(5))
    # A decisive teacher (g from about 0.01 to 0.9) with most targets near 0.1, as KVzip's are.
    teacher = {**teacher, "w2": 10 * teacher["w2"], "b2": teacher["b2"] - 2.0}
    targets = tmp_path / "targets.npz"
    _targets_file(targets, model, teacher)
    distilled = tmp_path / "distilled.safetensors"
    gate.save_write_gates(gate.init_write_gates(model.config, jax.random.PRNGKey(6)), distilled)
    fitted = tmp_path / "fitted"
    argv = ["--model", str(model_path), "--targets", str(targets), "--gates", str(distilled)]
    options = ["--steps", "300", "--batch-tokens", "256", "--learning-rate", "0.01"]
    report = capacity.main([*argv, *options, "--save-gates", str(fitted), "--out", str(tmp_path)])

    rows = {(r["predictor"], r["layer"]): r for r in report["rows"]}
    layers = model.config.num_layers
    assert len(rows) == 2 * (layers + 1)
    for layer in [*range(layers), "all"]:
        assert rows["fitted", layer]["explained"] > 0.8
        assert rows["fitted", layer]["top30_overlap"] > 0.8
        assert rows["distilled", layer]["top30_overlap"] < rows["fitted", layer]["top30_overlap"]
    assert report["train_curve"][-1]["bce"] < report["train_curve"][0]["bce"]
    assert report["parameters"] == sum(int(np.size(leaf)) for leaf in jax.tree.leaves(teacher))

    loaded = policies.get("wgkv").params.load(fitted, model.config)
    assert jax.tree.structure(loaded) == jax.tree.structure(teacher)
    record = json.loads((fitted / "run.json").read_text())
    assert record["command"] == report["command"] and record["steps"] == 300
    assert record["admitted_validation"] == report["admitted_validation"]["fitted"]
    assert json.loads((tmp_path / "gate_capacity.json").read_text())["rows"] == report["rows"]
    assert (tmp_path / "gate_capacity.md").read_text().count("| all |") == 1


def test_targets_of_another_depth_and_bad_options_are_refused(model_path, model, tmp_path):
    targets = tmp_path / "targets.npz"
    h = np.zeros((LENGTH, model.config.num_layers + 1, model.config.hidden_size), np.float16)
    t = np.zeros((LENGTH, model.config.num_layers + 1, model.config.num_kv_heads), np.float32)
    np.savez(
        targets,
        train_h=h,
        train_targets=t,
        validation_h=h,
        validation_targets=t,
        provenance=np.array(json.dumps({"length": LENGTH})),
    )
    distilled = tmp_path / "distilled.safetensors"
    gate.save_write_gates(gate.init_write_gates(model.config, jax.random.PRNGKey(0)), distilled)
    argv = ["--model", str(model_path), "--targets", str(targets), "--gates", str(distilled)]
    argv += ["--save-gates", str(tmp_path / "fitted")]
    with pytest.raises(ValueError, match=r"holds 3 layers; --model .* has 2"):
        capacity.main(argv)
    with pytest.raises(ValueError, match="--batch-tokens 0 must be >= 1"):
        capacity.main([*argv, "--batch-tokens", "0"])
