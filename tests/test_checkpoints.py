"""Checkpoint writing (read back by transformers and by us), dtypes, and bad checkpoints."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.flax import load_file, save_file

from jaxkv.models import forward, load_hf_checkpoint, save_hf_checkpoint
from tests import hf_models


@pytest.mark.parametrize("case", sorted(hf_models.CASES))
def test_saved_checkpoint_loads_in_transformers(case, tmp_path):
    hf = hf_models.build(case, seed=2)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_checkpoint(tmp_path / "hf", dtype="float32")
    save_hf_checkpoint(ours, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, hf.config.vocab_size, (1, 40)))
    with torch.no_grad():
        np.testing.assert_allclose(
            reloaded(tokens).logits.numpy(), hf(tokens).logits.numpy(), atol=1e-5, rtol=1e-5
        )


def test_sharded_round_trip_is_exact(tmp_path):
    hf = hf_models.build("qwen3-qknorm-untied")
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_checkpoint(tmp_path / "hf", dtype="float32")
    save_hf_checkpoint(ours, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = load_hf_checkpoint(tmp_path / "sharded")
    assert again.config == ours.config
    jax.tree.map(np.testing.assert_array_equal, again.params, ours.params)


def test_bfloat16_load_and_forward(tmp_path):
    hf = hf_models.build("llama3-rope-scaling-untied")
    hf.save_pretrained(tmp_path)
    f32 = load_hf_checkpoint(tmp_path, dtype="float32")
    bf16 = load_hf_checkpoint(tmp_path, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.params))
    tokens = np.arange(24)[None] % hf.config.vocab_size
    diff = np.abs(np.asarray(forward(bf16, tokens)) - np.asarray(forward(f32, tokens)))
    assert diff.max() < 0.1, diff.max()
    save_hf_checkpoint(bf16, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_hf_checkpoint(tmp_path / "bf16").dtype == jnp.bfloat16  # the stored dtype


@pytest.fixture()
def checkpoint(tmp_path):
    hf_models.build("llama2-tied").save_pretrained(tmp_path)
    return tmp_path


def _edit_tensors(directory, edit):
    tensors = dict(load_file(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def test_missing_tensor_is_named(checkpoint):
    _edit_tensors(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(checkpoint)


def test_mismatched_tensor_names_both_shapes(checkpoint):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = jnp.zeros((16, 64))

    _edit_tensors(checkpoint, shrink)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        load_hf_checkpoint(checkpoint)


def test_unknown_model_type_and_dtype(checkpoint):
    with pytest.raises(ValueError, match="dtype='int4'"):
        load_hf_checkpoint(checkpoint, dtype="int4")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(KeyError, match="model_type='gpt2'.*llama, qwen2, qwen3"):
        load_hf_checkpoint(checkpoint)


def test_missing_weights_file(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(hf_models.build("llama2-tied").config.to_dict())
    )
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)
