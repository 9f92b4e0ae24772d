"""KVzap surrogate training: KVzip+ targets equal the formula written over `transformers`' eager
attention weights; ridge regression meets its optimality conditions; a short run on a tiny
model writes surrogates the policy loads and a record of how they were made."""

import json

import jax
import numpy as np
import pytest
import torch

from jaxkv.models import byte_tokenizer, init_model
from jaxkv.models.configs import Family
from jaxkv.policies.kvzap import SurrogateParams
from jaxkv.policies.spec import from_spec
from jaxkv.train import kvzap as training
from tests import hf_models
from tests.tiny_models import tiny_config

BYTES = byte_tokenizer()


def torch_kvzip_plus(hf, tokens: np.ndarray, context: slice, replay: slice):
    """Per layer, the attention inputs of the context tokens [B, C, D] and their KVzip+ log
    scores [B, K, C], from transformers' eager attention weights and its own projections."""
    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    with torch.no_grad():
        out = hf(torch.as_tensor(tokens), output_attentions=True, output_hidden_states=True)
        per_layer = []
        for index, layer in enumerate(hf.model.layers):
            h = layer.input_layernorm(out.hidden_states[index])  # [B, T, D]
            v = layer.self_attn.v_proj(h).unflatten(-1, (kv_heads, head_dim))  # [B, T, K, Hd]
            wo = layer.self_attn.o_proj.weight.T.unflatten(0, (heads, head_dim))  # [N, Hd, D]
            v_per_head = v.repeat_interleave(heads // kv_heads, dim=2)  # [B, T, N, Hd]
            written = torch.einsum("btnh,nhd->bntd", v_per_head, wo).norm(dim=-1)  # [B, N, T]
            weights = out.attentions[index][:, :, replay, context]  # [B, N, R, C]
            weights = weights / h[:, replay].norm(dim=-1)[:, None, :, None]
            scores = weights.amax(dim=2) * written[:, :, context]  # [B, N, C]
            scores = scores.unflatten(1, (kv_heads, -1)).amax(dim=2)
            per_layer.append((h[:, context].numpy(), scores.log().numpy()))
    return per_layer


@pytest.mark.parametrize("case", ["llama2-tied", "qwen2-bias-tied"])
def test_kvzip_plus_targets_equal_the_formula_over_transformers_attention(case, tmp_path):
    hf, ours = hf_models.build_and_load(case, tmp_path, scale=0.3)
    rng = np.random.default_rng(0)
    prefix, context, repeat = 2, 14, 3
    body = rng.integers(0, hf.config.vocab_size, (2, prefix + context + repeat))
    tokens = np.concatenate([body, body[:, prefix : prefix + context]], axis=1)
    h, scores = training.kvzip_plus_targets(
        ours, tokens, context_start=prefix, context_end=prefix + context
    )
    replay = slice(tokens.shape[1] - context, None)
    expected = torch_kvzip_plus(hf, tokens, slice(prefix, prefix + context), replay)
    for layer, (expected_h, expected_scores) in enumerate(expected):
        np.testing.assert_allclose(h[layer], expected_h, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(scores[layer], expected_scores, rtol=0, atol=1e-4)
    assert np.ptp(np.asarray(scores)) > 1.0  # the scores tell tokens apart


def test_ridge_meets_its_optimality_conditions_and_recovers_a_linear_map():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((400, 2, 6))
    weight, bias = rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 3))
    targets = np.einsum("nld,ldk->nlk", h, weight) + bias + 0.1 * rng.standard_normal((400, 2, 3))
    fitted = training.fit_ridge(h.astype(np.float16), targets, alpha=5.0)
    x = h.astype(np.float16).astype(np.float64)
    for layer in range(2):
        residual = targets[:, layer] - x[:, layer] @ fitted["weight"][layer] - fitted["bias"][layer]
        # d/dw: X^T r = alpha w; d/db: sum r = 0 (the intercept is not penalised)
        np.testing.assert_allclose(
            x[:, layer].T @ residual, 5.0 * fitted["weight"][layer], atol=2e-3
        )
        np.testing.assert_allclose(residual.sum(axis=0), 0.0, atol=2e-3)
    np.testing.assert_allclose(fitted["weight"], weight, atol=0.05)
    np.testing.assert_allclose(fitted["bias"], bias, atol=0.05)


def test_a_short_run_writes_surrogates_the_policy_loads(tmp_path, monkeypatch):
    config = tiny_config(Family.LLAMA, vocab_size=512, max_position_embeddings=512)
    model = init_model(config, seed=0, scale=0.3)
    monkeypatch.setattr(training, "load_model", lambda *args, **kwargs: (model, BYTES))
    targets, out = tmp_path / "targets.npz", tmp_path / "surrogates"
    built = ["--contexts", "3", "--validation-contexts", "1", "--length", "96"]
    built += ["--tokens-per-context", "40", "--text", "source"]
    argv = ["--targets", str(targets), *built, "--steps", "40", "--warmup", "2"]
    argv += ["--hidden", "8", "--batch-tokens", "32", "--out", str(out)]
    summary = training.main(argv)

    data = np.load(targets)
    assert data["train_h"].shape == (120, 2, 64) and data["train_targets"].shape == (120, 2, 2)
    assert data["validation_h"].shape == (40, 2, 64)
    assert np.all(np.isfinite(data["train_targets"]))
    assert summary["command"] == "jaxkv train kvzap " + " ".join(argv)
    assert summary["commit"] and summary["date"] and summary["machine"]["host"]  # provenance
    assert summary["targets"]["length"] == 96 and summary["targets"]["text"] == "source"
    assert json.loads((out / "run.json").read_text()) == summary
    validation = summary["validation"]
    # Ridge fits the train tokens at least as well as their mean (a linear map with bias 0).
    train_fit = training.fit_report(
        training.predictions(
            {k: np.asarray(v) for k, v in np.load(out / "linear.npz").items()},
            data["train_h"],
        ),
        data["train_targets"],
    )
    assert train_fit["mse_mean"] < float(np.var(data["train_targets"], axis=0).mean())
    assert set(validation) == {"linear", "mlp", "train_mean"}
    for report in validation.values():
        assert len(report["r2"]) == 2 and 0 <= report["top30_overlap_mean"] <= 1
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validation_mse = [m["val_mse"] for m in logged if "val_mse" in m]
    assert len(validation_mse) == 10 and validation_mse[-1] < validation_mse[0]
    assert validation["mlp"]["mse_mean"] == pytest.approx(validation_mse[-1], rel=1e-4)

    for surrogate in ("linear", "mlp"):
        params = SurrogateParams(surrogate).load(out, config)
        assert jax.tree.structure(params) == jax.tree.structure(
            SurrogateParams(surrogate, hidden=8).init(config, jax.random.PRNGKey(0))
        )
    policy = from_spec("kvzap:0.5")
    assert policy.params.load(out, config)["w_in"].shape == (2, 64, 8)

    with pytest.raises(ValueError, match=r"--length=128 \(built with 96\)"):
        training.main(["--targets", str(targets), "--length", "128", "--out", str(out)])


@pytest.mark.parametrize(
    ("option", "value"),
    [("--tokens-per-context", "0"), ("--hidden", "0"), ("--ridge-alpha", "0")],
)
def test_bad_options_are_refused_by_name_before_loading_a_model(option, value, tmp_path):
    with pytest.raises(ValueError, match=option):
        training.main(["--targets", str(tmp_path / "t.npz"), option, value])
