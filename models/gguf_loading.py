"""Reading llama.cpp GGUF files: the config, the (dequantised) weights, the tokenizer's metadata.

A GGUF file holds everything a local runner needs: hyperparameters under `<architecture>.*`
keys, the tokenizer under `tokenizer.ggml.*`, the chat template, and the weights, most of them
block-quantised. This module reads them with the `gguf` package (llama.cpp's own reader) and
turns them into a `Model` in this package's layout:
- the config from metadata, checked against the tensors' shapes;
- every tensor type `gguf` can dequantise, dequantised to f32 on the host, then cast to `dtype`;
- llama.cpp's row permutation of the Llama Q/K projections undone (its converter reorders the
  rows of each head so that ggml's interleaved RoPE equals Hugging Face's rotate-half RoPE;
  Qwen2/Qwen3 are stored unpermuted, as ggml runs them with the rotate-half "NEOX" RoPE).

The tokenizer (`jaxkv.models.tokenizer.gguf_tokenizer`) is built from the same metadata.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from jaxkv.models.configs import Family, ModelConfig, RopeScaling, dtype_from_name
from jaxkv.models.decoder import Model

ARCHITECTURES = {"llama": Family.LLAMA, "qwen2": Family.QWEN2, "qwen3": Family.QWEN3}
# Tensor types stored as plain floats; every other type must be one that `gguf` dequantises.
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
# The types llama.cpp writes for these architectures and this loader is tested on.
TESTED_TENSOR_TYPES = "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K".split()


class GGUFFile:
    """A GGUF file's metadata (as Python values) and tensors, read once; errors name the file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, OSError, IndexError, TypeError) as error:
            raise ValueError(
                f"{self.path} is not a readable GGUF file (truncated or another format?): {error}"
            ) from None
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value: a number, bool, string or list; `default` when the key is absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        if field.types[0] == GGUFValueType.ARRAY:
            item = field.types[-1]
            return [_scalar(field.parts[i], item) for i in field.data]
        return _scalar(field.parts[field.data[0]], field.types[0])

    def required(self, key: str) -> Any:
        value = self.value(key)
        if value is None:
            raise ValueError(f"{self.path} lacks the metadata key {key!r}")
        return value

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` as f32 in numpy (row-major) order, dequantised if needed."""
        tensor = self.tensors[name]
        kind = GGMLQuantizationType(tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if kind in _FLOAT_TYPES and kind is not GGMLQuantizationType.BF16:
            return np.asarray(tensor.data, np.float32).reshape(shape)
        try:
            values = dequantize(np.asarray(tensor.data), kind)
        except NotImplementedError:
            raise ValueError(
                f"{self.path}: tensor {name!r} has type {kind.name}, which the gguf package "
                f"cannot dequantise (tested: {', '.join(TESTED_TENSOR_TYPES)})"
            ) from None
        return np.asarray(values, np.float32).reshape(shape)


def _scalar(part: np.ndarray, kind: GGUFValueType) -> Any:
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    if kind == GGUFValueType.BOOL:
        return bool(part[0])
    value = part[0]
    return float(value) if kind in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) else int(value)


def architecture(file: GGUFFile) -> Family:
    """The model family named by `general.architecture`; a ValueError for any other."""
    name = file.required("general.architecture")
    if name not in ARCHITECTURES:
        raise ValueError(
            f"{file.path}: general.architecture={name!r} is not supported: "
            f"supported are {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[name]


def _uniform_count(file: GGUFFile, key: str) -> int:
    """A per-model count that some files store per layer (a list): all layers must agree."""
    value = file.required(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"{file.path}: {key} differs between layers ({value}): not supported")
        value = value[0]
    return int(value)


def _rope_scaling(file: GGUFFile, arch: str) -> RopeScaling | None:
    kind = file.value(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in file.tensors:
        raise ValueError(
            f"{file.path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1+ scaling) "
            "are not supported by the GGUF loader: convert the Hugging Face checkpoint instead"
        )
    if kind == "none":
        return None
    if kind == "linear":
        factor = float(file.required(f"{arch}.rope.scaling.factor"))
        return RopeScaling(kind="linear", factor=factor)
    raise ValueError(
        f"{file.path}: {arch}.rope.scaling.type={kind!r} is not supported: use none or linear"
    )


def _eos_token_ids(file: GGUFFile) -> tuple[int, ...]:
    """End of sequence and end of turn (chat models stop at either)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [file.value(f"tokenizer.ggml.{key}") for key in keys]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def config_from_gguf(file: GGUFFile) -> ModelConfig:
    """The ModelConfig that a GGUF file's metadata and tensor list describe."""
    family = architecture(file)
    arch = file.required("general.architecture")
    hidden = int(file.required(f"{arch}.embedding_length"))
    num_heads = _uniform_count(file, f"{arch}.attention.head_count")
    head_dim = int(file.value(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dims = int(file.value(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(
            f"{file.path}: {arch}.rope.dimension_count={rope_dims} rotates part of each head "
            f"(head dim {head_dim}): partial RoPE is not supported"
        )
    embed = file.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{file.path} lacks the tensor 'token_embd.weight'")
    tokens = file.value("tokenizer.ggml.tokens")
    vocab = int(file.value(f"{arch}.vocab_size", len(tokens) if tokens else embed.shape[-1]))
    return ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_uniform_count(file, f"{arch}.feed_forward_length"),
        num_layers=int(file.required(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=_uniform_count(file, f"{arch}.attention.head_count_kv")
        if file.value(f"{arch}.attention.head_count_kv") is not None
        else num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(file.value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(file.value(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(file, arch),
        qkv_bias=family is Family.QWEN2 or "blk.0.attn_q.bias" in file.tensors,
        qk_norm=family is Family.QWEN3,
        tie_word_embeddings="output.weight" not in file.tensors,
        max_position_embeddings=int(file.value(f"{arch}.context_length", 4096)),
        bos_token_id=file.value("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(file),
    )


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's Llama Q/K row order: per head, ggml keeps the two halves of each
    rotated pair interleaved (rows 0, H/2, 1, H/2+1, ...); Hugging Face keeps them in halves.

    weight: [heads * H, ...] (a projection's rows, or its bias).
    """
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], Callable]]:
    """Per-layer parameter -> (GGUF suffix, numpy shape, GGUF array -> ours)."""
    d, n, k, h, f = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    permuted = cfg.family is Family.LLAMA

    def in_proj(heads):  # [heads*H, D] -> [D, heads, H]
        order = (lambda w: unpermute_rope_rows(w, heads)) if permuted else (lambda w: w)
        return lambda w: order(w).T.reshape(d, heads, h)

    def bias(heads, rotated):
        order = (lambda b: unpermute_rope_rows(b, heads)) if permuted and rotated else None
        return lambda b: (order(b) if order else b).reshape(heads, h)

    keep = lambda w: w  # noqa: E731
    table = {
        "attn_norm": ("attn_norm.weight", (d,), keep),
        "wq": ("attn_q.weight", (n * h, d), in_proj(n)),
        "wk": ("attn_k.weight", (k * h, d), in_proj(k)),
        "wv": ("attn_v.weight", (k * h, d), lambda w: w.T.reshape(d, k, h)),
        "wo": ("attn_output.weight", (d, n * h), lambda w: w.T.reshape(n, h, d)),
        "mlp_norm": ("ffn_norm.weight", (d,), keep),
        "w_gate": ("ffn_gate.weight", (f, d), np.transpose),
        "w_up": ("ffn_up.weight", (f, d), np.transpose),
        "w_down": ("ffn_down.weight", (d, f), np.transpose),
    }
    if cfg.qkv_bias:
        table["bq"] = ("attn_q.bias", (n * h,), bias(n, rotated=True))
        table["bk"] = ("attn_k.bias", (k * h,), bias(k, rotated=True))
        table["bv"] = ("attn_v.bias", (k * h,), bias(k, rotated=False))
    if cfg.qk_norm:
        table["q_norm"] = ("attn_q_norm.weight", (h,), keep)
        table["k_norm"] = ("attn_k_norm.weight", (h,), keep)
    return table


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a GGUF file for `cfg` must hold, with its numpy shape."""
    names = {
        "token_embd.weight": (cfg.vocab_size, cfg.hidden_size),
        "output_norm.weight": (cfg.hidden_size,),
    }
    if not cfg.tie_word_embeddings:
        names["output.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_layers):
        for suffix, shape, _ in _layer_tensors(cfg).values():
            names[f"blk.{i}.{suffix}"] = shape
    return names


# Tensors llama.cpp may add that carry nothing this decoder uses.
_IGNORED = ("rope_freqs.weight",)


def _check_tensors(file: GGUFFile, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    expected = expected_tensors(cfg)
    missing = [name for name in expected if name not in file.tensors]
    if missing:
        raise ValueError(f"{file.path} lacks tensor {missing[0]!r} ({len(missing)} missing in all)")
    unexpected = [name for name in file.tensors if name not in expected and name not in _IGNORED]
    if unexpected:
        raise ValueError(
            f"{file.path} has tensor {unexpected[0]!r}, which a {cfg.family.value} model "
            "of this config does not use (an unsupported variant of the architecture)"
        )
    for name, shape in expected.items():
        stored = tuple(int(n) for n in reversed(file.tensors[name].shape))
        if stored != shape:
            raise ValueError(
                f"{file.path}: tensor {name!r} has shape {stored}, the metadata implies {shape}"
            )
    return expected


def load_gguf(path: str | os.PathLike, dtype: Any = "float32") -> Model:
    """Loads a Llama, Qwen2 or Qwen3 GGUF file (any tensor type `gguf` dequantises).

    Args:
      path: the `.gguf` file.
      dtype: "float32", "bfloat16", "float16" or a jnp dtype for the dequantised weights.
    """
    dtype = dtype_from_name(dtype) if isinstance(dtype, str) else jnp.dtype(dtype)
    file = GGUFFile(path)
    cfg = config_from_gguf(file)
    _check_tensors(file, cfg)

    def cast(array: np.ndarray):
        return jnp.asarray(array, dtype)

    layers = {
        ours: jnp.stack(
            [cast(to_ours(file.array(f"blk.{i}.{suffix}"))) for i in range(cfg.num_layers)]
        )
        for ours, (suffix, _, to_ours) in _layer_tensors(cfg).items()
    }
    params = {
        "embed": cast(file.array("token_embd.weight")),
        "final_norm": cast(file.array("output_norm.weight")),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = cast(file.array("output.weight").T)
    return Model(config=cfg, params=params)
