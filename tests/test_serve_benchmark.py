"""`jaxkv bench serve` at toy sizes: one row per (pool size, policy), a learned policy with
its parameters, the plot over pool sizes, provenance."""

from __future__ import annotations

import argparse
import json

import jax
import pytest

from jaxkv import policies
from jaxkv.benchmarks import serve
from jaxkv.gates.wgkv import save_write_gates
from jaxkv.models.configs import MODEL_SHAPES, preset

TOY = [
    "--model",
    "tiny-random",
    "--requests",
    "3",
    "--rate",
    "1000",
    "--min-prompt",
    "40",
    "--max-prompt",
    "60",
    "--min-new",
    "2",
    "--max-new",
    "4",
    "--max-slots",
    "3",
]


def test_a_sweep_over_pool_sizes_writes_a_row_each_and_the_plot(tmp_path):
    gates = tmp_path / "gates.safetensors"
    wgkv = policies.get("wgkv")
    save_write_gates(wgkv.params.init(preset("tiny-random"), jax.random.PRNGKey(0)), gates)
    argv = [*TOY, "--policies", "full", "wgkv", "--pool-requests", "1", "2"]
    report = serve.main([*argv, "--params", f"wgkv={gates}", "--out", str(tmp_path)])
    rows = [(row["pool_requests"], row["policy"], row["max_prefills"]) for row in report["rows"]]
    assert rows == [(1, "full", 4), (1, "wgkv", 4), (2, "full", 4), (2, "wgkv", 4)]
    assert all(row["requests"] == 3 for row in report["rows"])
    saved = json.loads((tmp_path / "tiny-random" / "serve.json").read_text())
    assert saved["provenance"]["command"].startswith("jaxkv bench serve --model tiny-random")
    assert (tmp_path / "tiny-random" / "serve.png").stat().st_size > 0
    assert "serve.png" in (tmp_path / "tiny-random" / "serve.md").read_text()


def test_a_run_per_count_of_prefill_rows_over_the_same_trace_on_a_mesh(tmp_path):
    argv = [*TOY, "--policies", "snapkv:0.5", "--max-slots", "2", "--max-prefills", "2", "4"]
    argv += ["--mesh", "2x1"]
    report = serve.main([*argv, "--max-batched-tokens", "200", "--out", str(tmp_path)])
    assert [row["max_prefills"] for row in report["rows"]] == [2, 4]
    for row in report["rows"]:
        assert row["requests"] == 3 and row["too_large"] == 0
        assert row["prompt_tokens_per_second"] > 0
        # the warm-up compiled every width a step reads (arrivals staggered: 1 or 2 rows a lane)
        assert row["compile_seconds"] == 0.0


def test_a_learned_policy_without_shipped_parameters_names_params(tmp_path):
    with pytest.raises(ValueError, match="ships no trained parameters of it for --model tiny"):
        serve.main([*TOY, "--policies", "wgkv", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--pool-requests"):
        serve.main([*TOY, "--pool-requests", "0", "--out", str(tmp_path)])


def test_random_weights_take_a_public_models_shape_with_byte_level_tokens():
    args = argparse.Namespace(model="smollm2-135m-instruct", random_weights=True, seed=0)
    model, tokenizer = serve.served_model(args)
    assert model.config == MODEL_SHAPES["smollm2-135m-instruct"]
    ids = tokenizer.encode("a prompt of prose")
    assert ids and max(ids) < model.config.vocab_size
    with pytest.raises(ValueError, match="--model 'tiny-random' with --random-weights"):
        serve.served_model(argparse.Namespace(model="tiny-random", random_weights=True, seed=0))
