"""A new user's first hour (issue 17), below the CLI: sampler settings, `policies.get`,
checkpoint errors that name the file, the shipped gate directories, training twice."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxkv
from jaxkv import bundled, cli, policies
from jaxkv.cache import geometry
from jaxkv.gates.wgkv import init_write_gates, load_write_gates, save_write_gates
from jaxkv.models import byte_tokenizer, init_model, load_hf_checkpoint, save_hf_checkpoint
from jaxkv.models.configs import preset
from jaxkv.train import trainer


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (dict(temperature=math.nan), r"temperature=nan: allowed are finite numbers >= 0"),
        (dict(temperature=math.inf), r"temperature=inf: allowed are finite numbers >= 0"),
        (dict(temperature=1.0, top_p=math.nan), r"top_p=nan: allowed are numbers in \(0, 1\]"),
        (dict(temperature=1.0, top_p=0.0), r"top_p=0.0: allowed are numbers in \(0, 1\]"),
        (dict(temperature=1.0, top_k=0), r"top_k=0: allowed are integers >= 1, or None"),
        (dict(temperature=1.0, top_k=2.5), r"top_k=2.5: allowed are integers >= 1"),
    ],
)
def test_sampler_rejects_nan_inf_and_out_of_range_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.Sampler(**settings)


def test_sampler_accepts_numpy_scalars():
    sampler = jaxkv.Sampler(temperature=np.float32(0.5), top_k=np.int64(3), top_p=1.0)
    assert not sampler.greedy


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("full", dict(budget=0.3), r"policy 'full' takes no budget"),
        ("wgkv", dict(budget=256), r"policy 'wgkv' takes no budget"),
        ("kvzip", dict(budget=256), r"policy 'kvzip' takes its budget as a ratio .*ratio="),
        ("confkv", dict(budget=0.3), r"policy 'confkv' takes no single budget.*tight= and loose="),
        ("snapkv", dict(budgt=0.3), r"policy 'snapkv' has no field 'budgt'.*budget, sinks"),
    ],
)
def test_get_turns_bad_keywords_into_named_value_errors(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        policies.get(name, **kwargs)


def test_get_maps_budget_to_ratio_for_kvzip_and_fastkvzip():
    assert policies.get("kvzip", budget=0.3).ratio == 0.3
    assert policies.get("fastkvzip", budget=0.1).ratio == 0.1
    assert policies.get("full", budget=None) == policies.get("full")


def _checkpoint(directory: Path) -> Path:
    save_hf_checkpoint(init_model(preset("tiny-random"), seed=0), directory)
    byte_tokenizer().save(directory)
    return directory


def test_truncated_config_names_the_file(tmp_path):
    config = _checkpoint(tmp_path) / "config.json"
    config.write_text(config.read_text()[:60])
    with pytest.raises(ValueError, match=rf"{config} is not valid JSON \(truncated or corrupt\?\)"):
        load_hf_checkpoint(tmp_path)


def test_missing_config_field_names_the_file_and_the_field(tmp_path):
    config = _checkpoint(tmp_path) / "config.json"
    fields = json.loads(config.read_text())
    del fields["num_attention_heads"]
    config.write_text(json.dumps(fields))
    with pytest.raises(
        ValueError, match=rf"{config} lacks the required field 'num_attention_heads'"
    ):
        load_hf_checkpoint(tmp_path)


def test_directory_without_safetensors_names_the_directory(tmp_path):
    (_checkpoint(tmp_path) / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=rf"checkpoint directory {tmp_path} holds neither"):
        load_hf_checkpoint(tmp_path)


def test_index_listing_a_missing_shard_names_it(tmp_path):
    _checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_load_write_gates_accepts_the_shipped_directory():
    cfg = load_hf_checkpoint(bundled.REFERENCE_MODEL).config
    directory = bundled.WGKV_GATES / "lambda-0.08"
    from_directory = load_write_gates(directory, cfg)
    from_file = load_write_gates(directory / "gates.safetensors", cfg)
    for name, value in from_file.items():
        np.testing.assert_array_equal(from_directory[name], value)


def test_load_write_gates_still_reads_orbax_directories(tmp_path):
    cfg = preset("tiny-random")
    gates = init_write_gates(cfg, jax.random.PRNGKey(1))
    save_write_gates(gates, tmp_path / "orbax")
    np.testing.assert_array_equal(load_write_gates(tmp_path / "orbax", cfg)["w1"], gates["w1"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a .safetensors gates file nor an orbax"):
        load_write_gates(tmp_path / "empty", cfg)


def _quadratic_loss(params, batch):
    prediction = batch["x"] @ params["w"] + params["b"]
    return jnp.mean(prediction**2), {}


def _train(params, mesh):
    cfg = trainer.TrainConfig(steps=2, learning_rate=1e-2, warmup_steps=1, log_every=1)
    batch = {"x": np.ones((2, 4), np.float32)}
    return trainer.train(
        _quadratic_loss, params, lambda step: batch, cfg, mesh=mesh, progress=False
    )


def test_training_twice_from_the_same_params():
    params = {"w": jnp.ones((4, 8)), "b": jnp.zeros((8,))}
    mesh = trainer.make_mesh(jax.devices()[:1])
    first, _ = _train(params, mesh)
    second, _ = _train(params, mesh)  # the first run must not have deleted them
    assert float(params["w"][0, 0]) == 1.0
    np.testing.assert_array_equal(first.params["w"], second.params["w"])


def test_mesh_without_a_data_axis_is_a_named_error():
    params = {"w": jnp.ones((4, 8)), "b": jnp.zeros((8,))}
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("batch",))
    with pytest.raises(ValueError, match=r"mesh axes \('batch',\).*an axis named 'data'"):
        _train(params, mesh)


# Issue 29: numpy/jax scalars, overflowing budgets, a seed for a key, one int as stop tokens.
@pytest.mark.parametrize("budget", [np.float32(0.3), jnp.array(0.3), np.float64(0.3)])
def test_numpy_and_jax_scalar_ratios_are_budgets(budget):
    policy = policies.get("snapkv", budget=budget)
    assert policies.base.Budget.parse(budget).ratio == pytest.approx(0.3)
    assert policy.budget_tokens(np.array([1000]))[0] == 300


@pytest.mark.parametrize("budget", [np.int64(64), jnp.array(64, jnp.int32)])
def test_numpy_and_jax_scalar_counts_are_budgets(budget):
    assert policies.base.Budget.parse(budget).tokens == 64


@pytest.mark.parametrize("budget", [2**31, np.int64(2**40), 0, "0.3", True, np.array([0.3])])
def test_budgets_out_of_range_or_of_other_types_name_the_range(budget):
    with pytest.raises(ValueError, match=r"give a ratio in \(0, 1\] or a token count in \[1, "):
        policies.get("snapkv", budget=budget)


@pytest.fixture(scope="module")
def tiny():
    return init_model(preset("tiny-random"), seed=0)


def test_a_seed_for_a_key_is_a_named_error(tiny):
    with pytest.raises(ValueError, match=r"key=0: give a PRNG key, e.g. jax.random.PRNGKey\(0\)"):
        jaxkv.generate(tiny, [[1, 2, 3]], max_new_tokens=2, key=0)


def test_one_int_is_one_stop_token_and_bad_ids_are_named(tiny):
    prompt = [[5, 6, 7, 8]]
    first = int(jaxkv.generate(tiny, prompt, max_new_tokens=1, stop_tokens=()).tokens[0, 0])
    out = jaxkv.generate(tiny, prompt, max_new_tokens=6, stop_tokens=first)
    assert int(out.num_tokens[0]) == 1
    with pytest.raises(
        ValueError, match=r"stop_tokens holds 264: ids are in \[0, vocab_size=264\)"
    ):
        jaxkv.generate(tiny, prompt, max_new_tokens=2, stop_tokens=[264])
    with pytest.raises(ValueError, match=r"stop_tokens holds 'x': give token ids"):
        jaxkv.generate(tiny, prompt, max_new_tokens=2, stop_tokens=["x"])


def test_truncated_safetensors_names_the_file(tmp_path):
    save_hf_checkpoint(init_model(preset("tiny-random"), seed=0), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        load_hf_checkpoint(tmp_path)


# Issue 29, the rest: no silent byte-level tokenizer, ...
def _cli_error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_checkpoint_without_tokenizer_json_is_an_error_not_the_byte_tokenizer(tmp_path, capsys):
    (_checkpoint(tmp_path) / "tokenizer.json").unlink()
    assert cli.main(["generate", "--model", str(tmp_path), "--max-new-tokens", "2"]) == 2
    assert f"checkpoint directory {tmp_path} has no tokenizer.json" in _cli_error(capsys)


def test_large_pages_keep_a_short_prompts_pool_small(tiny):
    # 256 pages of 8192 tokens would be a 2M-token pool for a 252-token prompt.
    cache = jaxkv.CacheConfig(page_size=8192)
    out = jaxkv.generate(tiny, [list(range(1, 253))], max_new_tokens=2, cache=cache)
    heads = tiny.config.num_layers * tiny.config.num_kv_heads
    assert out.state.pool.num_pages == heads  # one page per (layer, KV head)
    assert geometry.min_pool_pages(16) == geometry.MIN_POOL_PAGES  # the default is unchanged


TINY_CLI = ["generate", "--model", "tiny-random", "--max-new-tokens", "2", "--page-size", "4"]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["--policy", "snapkv", "--budget", "0.5", "--policy-arg", "retrieval_share=0.5"],
            "--policy-arg 'retrieval_share=0.5': give KEY=VALUE with KEY one of the fields",
        ),
        (
            ["--policy", "duo_attention", "--gates", "heads.npy"]
            + ["--policy-arg", "retrieval_share=0.5"],
            "retrieval_share=0.5: duo_attention reads its retrieval heads from heads.npy",
        ),
        (
            ["--full-precision-window", "64"],
            "--full-precision-window: --storage model keeps every token in the kv dtype",
        ),
    ],
)
def test_options_the_policy_or_storage_would_ignore_are_refused(
    capsys, tmp_path, monkeypatch, argv, match
):
    monkeypatch.chdir(tmp_path)
    np.save("heads.npy", np.ones((2, 2), bool))  # --gates heads.npy exists: the conflict is said
    assert cli.main([*TINY_CLI, *argv]) == 2
    assert match in _cli_error(capsys)


def test_int8_storage_takes_a_full_precision_window(capsys):
    argv = [*TINY_CLI, "--storage", "int8", "--full-precision-window", "4", "--prompt", "x" * 40]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{") :])["storage"] == "int8"


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([[[1, 2, 3]]], r"prompt_ids\[0\] holds list entries where token ids belong"),
        ([[1, 2], [[3]]], r"prompt_ids\[1\] holds list entries where token ids belong"),
        ([np.ones((2, 3), int)], r"prompt_ids\[0\] holds ndarray entries where token ids belong"),
        ([[1, 2], 3], r"prompt_ids\[1\] is 3, beside lists"),
    ],
)
def test_prompts_nested_too_deep_name_the_allowed_shapes(tiny, prompts, match):
    with pytest.raises(ValueError, match=match + r".*token ids \[T\] or a batch .* \[B\]\[T\]"):
        jaxkv.generate(tiny, prompts, max_new_tokens=2)


def test_an_o_proj_bias_is_named_as_unsupported(tmp_path):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_bias=True,  # q, k, v and o_proj biases
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.self_attn.o_proj.bias': o_proj biases are not supported "
        r"\(Qwen2-style q/k/v biases are\)",
    ):
        load_hf_checkpoint(tmp_path)


def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(cli.registered_commands(cli.BENCH_GROUP)))
def test_every_benchmark_help_names_its_jaxkv_command(capsys, name):
    assert _help(capsys, ["bench", name, "-h"]).startswith(f"usage: jaxkv bench {name} ")


def test_bench_help_describes_every_benchmark_in_a_line(capsys):
    lines = _help(capsys, ["bench", "-h"]).splitlines()
    for name in cli.registered_commands(cli.BENCH_GROUP):
        (line,) = [line for line in lines if line.split()[:1] == [name]]
        assert len(line.split()) > 4, line
    assert any("End-to-end system benchmark" in line for line in lines)


def test_generate_help_names_the_policies_without_a_budget(capsys):
    text = " ".join(_help(capsys, ["generate", "-h"]).split())
    no_budget = [name for name in policies.registered() if not policies.spec.takes_budget(name)]
    assert {"full", "wgkv", "confkv", "gvote"} <= set(no_budget)
    assert f"{', '.join(no_budget)} take no --budget" in text
    ratios_only = [name for name in policies.registered() if policies.spec.takes_ratio_only(name)]
    assert {"fastkvzip", "kvzip"} <= set(ratios_only)
    assert f"{', '.join(ratios_only)} take ratios only" in text


def test_an_empty_prompt_is_refused_by_the_cli_as_by_the_api(capsys):
    assert cli.main(["generate", "--prompt", "", "--max-new-tokens", "2"]) == 2
    assert "--prompt is empty" in capsys.readouterr().err


def test_an_unknown_policy_is_the_same_error_everywhere_and_empty_field_lists_read_well():
    with pytest.raises(ValueError, match="policy='nosuch': registered policies are adakv, "):
        policies.get("nosuch")
    with pytest.raises(ValueError, match="takes no budget .*; it has no fields$"):
        policies.get("full", budget=0.3)
    with pytest.raises(ValueError, match="has no field 'window': it has no fields$"):
        policies.get("full", window=3)


def test_a_row_too_short_for_the_window_keeps_its_whole_prompt_as_budget():
    # SnapKV's 64-token window: 30 tokens of 100 and 36 of 40 are too few, 120 of 400 are not.
    budget = policies.get("snapkv", budget=0.3).budget_tokens(np.array([400, 100]))
    np.testing.assert_array_equal(budget, [120, 100])
    budget = policies.get("snapkv", budget=0.9).budget_tokens(np.array([400, 40]))
    np.testing.assert_array_equal(budget, [360, 40])
