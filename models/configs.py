"""Model configurations: hashable data, presets by name, conversion from/to Hugging Face configs."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp


class Family(enum.Enum):
    """Architecture family; the decoder is one implementation driven by config flags."""

    LLAMA = "llama"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "llama3" or "linear" (Hugging Face `rope_type`)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling kind={self.kind!r}: supported are 'llama3', 'linear'")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor={self.factor} must be > 0")


SUPPORTED_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer configuration (Llama 2/3/3.1+, Qwen2/2.5, Qwen3).

    Attributes:
      family: architecture family (only used for naming and checkpoint export).
      vocab_size, hidden_size, intermediate_size, num_layers: usual sizes.
      num_heads, num_kv_heads, head_dim: query heads N, KV heads K (N % K == 0), head dim H.
      qkv_bias: q/k/v projections carry a bias (Qwen2, some Llama variants).
      qk_norm: RMSNorm over H on q and k before RoPE (Qwen3).
      tie_word_embeddings: the LM head reuses the embedding matrix.
      max_position_embeddings: longest sequence (prompt + generation) the model accepts.
    """

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.num_heads // self.num_kv_heads


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Reads RoPE settings from either the v5 `rope_parameters` or the v4 `rope_scaling` form."""
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(scaling["factor"]))
    raise ValueError(
        f"rope_type={kind!r} in config.json is not supported: use default, llama3, linear"
    )


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def _required_int(hf: dict[str, Any], name: str, source: str) -> int:
    """A positive integer field of config.json; a ValueError naming the file and the field."""
    if name not in hf or hf[name] is None:
        raise ValueError(f"{source} lacks the required field {name!r}")
    value = hf[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: field {name!r} is {value!r}, expected an integer >= 1")
    return value


def from_hf_config(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Builds a ModelConfig from a Hugging Face `config.json` dictionary.

    source: what errors call the dictionary (the loader passes the file's path).
    """
    if not isinstance(hf, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    try:
        family = Family(model_type)
    except ValueError:
        allowed = ", ".join(f.value for f in Family)
        raise KeyError(f"model_type={model_type!r} in {source}: supported are {allowed}") from None
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r}: only 'silu' is supported")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if hf.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=True (Qwen2 sliding layers) is not supported")
    required = {
        name: _required_int(hf, name, source)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
    }
    theta, scaling = _rope_from_hf(hf)
    num_heads = required["num_attention_heads"]
    head_dim = hf.get("head_dim") or required["hidden_size"] // num_heads
    qkv_bias = family is Family.QWEN2 or bool(hf.get("attention_bias", False))
    return ModelConfig(
        family=family,
        vocab_size=required["vocab_size"],
        hidden_size=required["hidden_size"],
        intermediate_size=required["intermediate_size"],
        num_layers=required["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        qk_norm=family is Family.QWEN3,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_as_tuple(hf.get("eos_token_id")),
    )


def to_hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` dictionary for `cfg`, in the form both transformers v4 and v5 read."""
    architectures = {
        Family.LLAMA: "LlamaForCausalLM",
        Family.QWEN2: "Qwen2ForCausalLM",
        Family.QWEN3: "Qwen3ForCausalLM",
    }
    hf: dict[str, Any] = {
        "architectures": [architectures[cfg.family]],
        "model_type": cfg.family.value,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) or None,
        "torch_dtype": dtype,
    }
    if cfg.family is not Family.QWEN2:
        hf["attention_bias"] = cfg.qkv_bias
    elif not cfg.qkv_bias:
        raise ValueError("Qwen2 checkpoints always have q/k/v biases: qkv_bias must be True")
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling: dict[str, Any] = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            scaling.update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
        hf["rope_scaling"] = scaling
    return hf


PRESETS: dict[str, ModelConfig] = {
    # The demo model of the README until the bundled reference model lands: random weights.
    "tiny-random": ModelConfig(
        family=Family.QWEN3,
        vocab_size=264,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=100000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
}


# Shapes of public models, without weights: for plans from abstract shapes (`jaxkv bench plan`),
# never `--model` choices of `jaxkv generate` (random weights at these sizes are tens of GB).
MODEL_SHAPES: dict[str, ModelConfig] = {
    # Llama-3.1-8B's config.json.
    "llama-3.1-8b": ModelConfig(
        family=Family.LLAMA,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(kind="llama3", factor=8.0),
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    # SmolLM2-135M-Instruct as its GGUF describes it (`jaxkv fetch smollm2-135m-instruct`; the
    # shapes its shipped gates are checked against without the file).
    "smollm2-135m-instruct": ModelConfig(
        family=Family.LLAMA,
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=9.999999747378752e-06,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}


def model_shape(name: str) -> ModelConfig:
    """The configuration of a preset or of a public model's shapes (MODEL_SHAPES)."""
    if name in PRESETS:
        return PRESETS[name]
    if name not in MODEL_SHAPES:
        raise KeyError(
            f"model={name!r}: known shapes are {sorted(MODEL_SHAPES)} and presets {sorted(PRESETS)}"
        )
    return MODEL_SHAPES[name]


def preset(name: str) -> ModelConfig:
    """A named configuration from PRESETS."""
    if name not in PRESETS:
        raise KeyError(f"preset={name!r}: known presets are {sorted(PRESETS)}")
    return PRESETS[name]


def dtype_from_name(name: str):
    """Maps a dtype name to the jnp dtype, with a clear error for unsupported names."""
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={name!r}: supported are {sorted(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[name]
