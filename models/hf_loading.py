"""Offline reading and writing of Hugging Face checkpoint directories.

A directory holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. Tensors are checked by name and shape against the config before
anything is converted: a missing tensor is a KeyError naming it, a wrong shape a ValueError naming
the tensor and both shapes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from jaxkv.models.configs import ModelConfig, dtype_from_name, from_hf_config, to_hf_config
from jaxkv.models.decoder import Model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], Callable, Callable]]:
    """Per-layer parameter -> (HF suffix, HF shape, HF->ours, ours->HF)."""
    d, n, k, h, f = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    same = (lambda w: w, lambda w: w)

    def in_proj(heads):  # torch Linear [heads*H, D] <-> ours [D, heads, H]
        return (lambda w: w.T.reshape(d, heads, h), lambda w: w.reshape(d, heads * h).T)

    def bias(heads):
        return (lambda b: b.reshape(heads, h), lambda b: b.reshape(heads * h))

    transpose = (lambda w: w.T, lambda w: w.T)
    table = {
        "attn_norm": ("input_layernorm.weight", (d,), *same),
        "wq": ("self_attn.q_proj.weight", (n * h, d), *in_proj(n)),
        "wk": ("self_attn.k_proj.weight", (k * h, d), *in_proj(k)),
        "wv": ("self_attn.v_proj.weight", (k * h, d), *in_proj(k)),
        "wo": (
            "self_attn.o_proj.weight",
            (d, n * h),
            lambda w: w.T.reshape(n, h, d),
            lambda w: w.reshape(n * h, d).T,
        ),
        "mlp_norm": ("post_attention_layernorm.weight", (d,), *same),
        "w_gate": ("mlp.gate_proj.weight", (f, d), *transpose),
        "w_up": ("mlp.up_proj.weight", (f, d), *transpose),
        "w_down": ("mlp.down_proj.weight", (d, f), *transpose),
    }
    if cfg.qkv_bias:
        table["bq"] = ("self_attn.q_proj.bias", (n * h,), *bias(n))
        table["bk"] = ("self_attn.k_proj.bias", (k * h,), *bias(k))
        table["bv"] = ("self_attn.v_proj.bias", (k * h,), *bias(k))
    if cfg.qk_norm:
        table["q_norm"] = ("self_attn.q_norm.weight", (h,), *same)
        table["k_norm"] = ("self_attn.k_norm.weight", (h,), *same)
    return table


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint for `cfg` must hold, with its shape."""
    names = {
        "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": (cfg.hidden_size,),
    }
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_layers):
        for suffix, shape, _, _ in _layer_tensors(cfg).values():
            names[f"model.layers.{i}.{suffix}"] = shape
    return names


def _read_json_object(file: Path) -> dict:
    """A JSON file's top-level object; errors name the file (truncated, invalid, not an object)."""
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{file} is not valid JSON (truncated or corrupt?): {error.msg} (line "
            f"{error.lineno}, column {error.colno})"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not UTF-8 text (is it a JSON file?)") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def _opened(file: Path):
    """`safe_open(file)`; a ValueError naming the file if it is not a readable safetensors file."""
    try:
        return safe_open(file, framework="flax")
    except SafetensorError as error:
        raise ValueError(
            f"{file} is not a readable safetensors file (truncated or corrupt?): {error}"
        ) from None


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    if (path / INDEX_FILE).exists():
        weight_map = _read_json_object(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / INDEX_FILE} lacks the required field 'weight_map'")
        files = {name: path / file for name, file in weight_map.items()}
        absent = sorted({str(file) for file in files.values() if not file.exists()})
        if absent:
            raise FileNotFoundError(f"{path / INDEX_FILE} lists {absent[0]}, which does not exist")
        return files
    if (path / SINGLE_FILE).exists():
        with _opened(path / SINGLE_FILE) as f:
            return dict.fromkeys(f.keys(), path / SINGLE_FILE)
    others = sorted(p.name for p in path.glob("*.safetensors"))
    found = f" (it has {', '.join(others)})" if others else " (no .safetensors files at all)"
    raise FileNotFoundError(
        f"checkpoint directory {path} holds neither {SINGLE_FILE} nor {INDEX_FILE}{found}"
    )


def _read_tensors(files: dict[str, Path], names) -> dict:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    tensors = {}
    for file, file_names in by_file.items():
        with _opened(file) as f:
            for name in file_names:
                tensors[name] = f.get_tensor(name)
    return tensors


def _checkpoint_dtype(hf_config: dict, dtype):
    if dtype is not None:
        return dtype_from_name(dtype) if isinstance(dtype, str) else jnp.dtype(dtype)
    stored = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    return dtype_from_name(stored)


def _unexpected_tensor_error(path: Path, name: str, cfg: ModelConfig) -> ValueError:
    """The error for a tensor the config does not use; a bias the model cannot hold is named as
    such (Llama's attention_bias=True also puts one on o_proj)."""
    module, _, kind = name.rpartition(".")
    projection = module.rpartition(".")[2]
    if kind == "bias" and projection not in ("q_proj", "k_proj", "v_proj"):
        return ValueError(
            f"checkpoint {path} has tensor {name!r}: {projection} biases are not supported "
            "(Qwen2-style q/k/v biases are)"
        )
    return ValueError(
        f"checkpoint {path} has tensor {name!r} that the config ({cfg.family.value}) does not use"
    )


def load_hf_checkpoint(path: str | os.PathLike, dtype=None) -> Model:
    """Loads a Hugging Face checkpoint directory offline.

    Args:
      path: directory with config.json and safetensors weights (single file or sharded).
      dtype: "float32", "bfloat16", "float16" or a jnp dtype; default the checkpoint's own.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist (or is a file)")
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} does not exist")
    hf_config = _read_json_object(config_file)
    cfg = from_hf_config(hf_config, source=str(config_file))
    dtype = _checkpoint_dtype(hf_config, dtype)
    files = _weight_files(path)
    expected = expected_tensors(cfg)
    missing = [name for name in expected if name not in files]
    if missing:
        raise KeyError(
            f"checkpoint {path} lacks tensor {missing[0]!r} ({len(missing)} missing in all)"
        )
    unexpected = [
        name
        for name in files
        if name not in expected
        and not name.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_word_embeddings and name == "lm_head.weight")
    ]
    if unexpected:
        raise _unexpected_tensor_error(path, unexpected[0], cfg)
    tensors = _read_tensors(files, expected)
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                f"the config implies {shape}"
            )
    return Model(config=cfg, params=_to_params(cfg, tensors, dtype))


def _to_params(cfg: ModelConfig, tensors: dict, dtype) -> dict:
    def cast(x):
        return jnp.asarray(x).astype(dtype)

    layers = {}
    for ours, (suffix, _, to_ours, _) in _layer_tensors(cfg).items():
        per_layer = [
            to_ours(cast(tensors[f"model.layers.{i}.{suffix}"])) for i in range(cfg.num_layers)
        ]
        layers[ours] = jnp.stack(per_layer)
    params = {
        "embed": cast(tensors["model.embed_tokens.weight"]),
        "final_norm": cast(tensors["model.norm.weight"]),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = cast(tensors["lm_head.weight"]).T
    return params


def _to_hf_tensors(model: Model) -> dict:
    cfg, params = model.config, model.params
    tensors = {
        "model.embed_tokens.weight": params["embed"],
        "model.norm.weight": params["final_norm"],
    }
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = params["lm_head"].T
    for ours, (suffix, _, _, to_hf) in _layer_tensors(cfg).items():
        for i in range(cfg.num_layers):
            tensors[f"model.layers.{i}.{suffix}"] = to_hf(params["layers"][ours][i])
    # safetensors needs contiguous buffers; transposed views are materialised here.
    return {name: jnp.asarray(np.ascontiguousarray(np.asarray(t))) for name, t in tensors.items()}


def save_hf_checkpoint(
    model: Model, path: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> None:
    """Writes config.json and safetensors weights that `transformers` and this loader read.

    With `max_shard_bytes`, weights are split into shards plus a `model.safetensors.index.json`.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype_name = jnp.dtype(model.dtype).name
    (path / "config.json").write_text(
        json.dumps(to_hf_config(model.config, dtype_name), indent=2) + "\n"
    )
    tensors = _to_hf_tensors(model)
    if max_shard_bytes is None:
        save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})
        return
    shards: list[dict] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        if shards[-1] and shard_bytes + tensor.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += tensor.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.nbytes for t in tensors.values())
    (path / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
