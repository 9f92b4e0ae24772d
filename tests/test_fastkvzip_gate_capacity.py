"""The gate-capacity benchmark: its BCE bounds and overlap by hand, a probe that learns a
learnable target, the rows it writes, bad layers refused."""

import json

import jax
import numpy as np
import pytest

from jaxkv.benchmarks import fastkvzip_gate_capacity as capacity
from jaxkv.gates import fastkvzip as gate
from jaxkv.models.configs import Family
from jaxkv.train import fastkvzip as training
from tests.tiny_models import tiny_config

CONFIG = tiny_config(Family.LLAMA, hidden_size=32, intermediate_size=64, head_dim=8)


def test_bounds_and_overlap_by_hand():
    targets = np.array([[0.5, 0.1], [0.9, 0.25]], np.float32)
    clipped = np.clip(targets, 1e-6, 1 - 1e-6)
    entropy = -(clipped * np.log(clipped) + (1 - clipped) * np.log1p(-clipped)).mean()
    assert training.entropy_bce(targets) == pytest.approx(entropy, rel=1e-5)
    ranked = np.arange(10.0).reshape(5, 2)
    assert training.top_share(ranked, ranked) == 1.0
    assert training.top_share(-ranked, ranked) == 0.0
    assert training.top_share(ranked, ranked, ratio=0.5) == 1.0


def _targets_file(path, rng, tokens, layers=2, heads=2, width=32):
    """h ~ N(0, 1) and targets a sigmoid of a fixed projection of the normed h: learnable."""
    direction = rng.standard_normal((layers, width, heads)).astype(np.float32)

    def split(n):
        h = rng.standard_normal((n, layers, width)).astype(np.float32)
        normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True))
        logits = np.einsum("nld,ldk->nlk", normed, direction) - 2.0
        return h.astype(np.float16), (1 / (1 + np.exp(-logits))).astype(np.float32)

    (train_h, train_t), (val_h, val_t) = split(tokens), split(tokens // 4)
    np.savez(
        path, train_h=train_h, train_targets=train_t, validation_h=val_h, validation_targets=val_t
    )


def test_a_probe_learns_what_the_hidden_state_holds(tmp_path):
    targets = tmp_path / "targets.npz"
    _targets_file(targets, np.random.default_rng(0), tokens=2048)
    gates = tmp_path / "gates.safetensors"
    gate.save_safetensors(gate.init_params(CONFIG, jax.random.PRNGKey(0)), gates)
    argv = ["--targets", str(targets), "--gates", str(gates), "--layers", "1", "--hidden", "8"]
    report = capacity.main(
        [
            *argv,
            "--steps",
            "300",
            "--batch-tokens",
            "256",
            "--learning-rate",
            "0.03",
            "--out",
            str(tmp_path),
        ]
    )
    untrained, probe = report["rows"]
    assert (untrained["predictor"], probe["predictor"]) == ("sink-attention gates", "mlp-8")
    assert untrained["layer"] == probe["layer"] == 1
    assert probe["parameters"] == 32 + 2 * 32 * 8 + 8 * 2 + 2
    assert untrained["parameters"] == sum(
        int(np.size(v)) for v in gate.layer_slice(gate.load_safetensors(gates), 1).values()
    )
    assert probe["entropy_bce"] < probe["validation_bce"] < probe["constant_bce"]
    assert probe["explained"] > 0.5 and probe["top30_overlap"] > 0.7
    assert untrained["explained"] < probe["explained"]
    saved = json.loads((tmp_path / "gate_capacity.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert (tmp_path / "gate_capacity.md").read_text().count("| 1 |") == 2
    with pytest.raises(ValueError, match=r"--layers \[2\]: the targets hold layers 0..1"):
        capacity.main([*argv[:5], "2", "--out", str(tmp_path)])
