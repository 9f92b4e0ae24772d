"""WG-KV write gate: per layer, per KV head, a small MLP on the token's key scores its admission.

WG-KV: "Learning What to Write: Write-Gated KV for Efficient Long-Context Inference",
arXiv:2512.17452 (docs/wgkv.md). For token j of KV head k in layer l:
  x = [RMSNorm_a(k_unrotated_j); RMSNorm_b(k_rotated_j)]            (2H, f32, eps 1e-6)
  g = sigmoid(w2_k . GELU_exact(x @ W1_k + b1_k) + b2_k)  clamped to >= 1e-3.
The two RMSNorm weights [H] are shared by the layer's heads; the MLP weights are per KV head.

Parameters are a tree separate from the backbone, every leaf stacked on a leading [L] axis
(E = hidden width = expand * H):
  norm_unrotated, norm_rotated [L, H]; w1 [L, K, 2H, E]; b1 [L, K, E]; w2 [L, K, E]; b2 [L, K].
`write_gate_values` takes one layer's slice (what the decoder's layer scan hands a policy).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models.configs import Family, ModelConfig

GateParams = dict[str, jax.Array]

GATE_NORM_EPS = 1e-6
MIN_GATE = 1e-3
DEFAULT_EXPAND = {Family.LLAMA: 4.0, Family.QWEN2: 4.0, Family.QWEN3: 1.5}
PARAM_NAMES = ("norm_unrotated", "norm_rotated", "w1", "b1", "w2", "b2")


def hidden_width(model_config: ModelConfig, expand: float | None = None) -> int:
    """E = expand * H (default by family: Llama/Qwen2 4, Qwen3 1.5); must be a whole number."""
    if expand is None:
        expand = DEFAULT_EXPAND[model_config.family]
    if expand <= 0:
        raise ValueError(f"expand={expand} must be > 0")
    width = expand * model_config.head_dim
    if width != int(width):
        raise ValueError(
            f"expand={expand} times head_dim={model_config.head_dim} = {width} "
            "must be a whole number of hidden units"
        )
    return int(width)


def init_write_gates(
    model_config: ModelConfig, key: jax.Array, *, expand: float | None = None
) -> GateParams:
    """Fresh gates: linear weights and biases uniform(+-1/sqrt(fan_in)), norm weights 1, f32."""
    num_layers, heads, dim = (
        model_config.num_layers,
        model_config.num_kv_heads,
        model_config.head_dim,
    )
    width = hidden_width(model_config, expand)
    keys = jax.random.split(key, 4)

    def uniform(k, shape, fan_in):
        bound = 1.0 / math.sqrt(fan_in)
        return jax.random.uniform(k, shape, jnp.float32, -bound, bound)

    return {
        "norm_unrotated": jnp.ones((num_layers, dim), jnp.float32),
        "norm_rotated": jnp.ones((num_layers, dim), jnp.float32),
        "w1": uniform(keys[0], (num_layers, heads, 2 * dim, width), 2 * dim),
        "b1": uniform(keys[1], (num_layers, heads, width), 2 * dim),
        "w2": uniform(keys[2], (num_layers, heads, width), width),
        "b2": uniform(keys[3], (num_layers, heads), width),
    }


def _rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    return weight * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + GATE_NORM_EPS)


def write_gate_logits(layer_params: GateParams, k_unrotated: jax.Array, k: jax.Array) -> jax.Array:
    """Pre-sigmoid gate logits f32 [B, K, T] of one layer; keys [B, K, T, H] (any float dtype)."""
    features = jnp.concatenate(
        [
            _rms_norm(k_unrotated.astype(jnp.float32), layer_params["norm_unrotated"]),
            _rms_norm(k.astype(jnp.float32), layer_params["norm_rotated"]),
        ],
        axis=-1,
    )
    hidden = jnp.einsum("bktx,kxe->bkte", features, layer_params["w1"])
    hidden = jax.nn.gelu(hidden + layer_params["b1"][:, None], approximate=False)
    return jnp.einsum("bkte,ke->bkt", hidden, layer_params["w2"]) + layer_params["b2"][:, None]


def write_gate_values(layer_params: GateParams, k_unrotated: jax.Array, k: jax.Array) -> jax.Array:
    """Gate values g f32 [B, K, T] in [1e-3, 1) of one layer from its keys [B, K, T, H]."""
    return jnp.maximum(jax.nn.sigmoid(write_gate_logits(layer_params, k_unrotated, k)), MIN_GATE)


AXIS_NAMES = {
    "norm_unrotated": ("layers", "head dim"),
    "norm_rotated": ("layers", "head dim"),
    "w1": ("layers", "KV heads", "head dim (2H inputs)", "hidden width"),
    "b1": ("layers", "KV heads", "hidden width"),
    "w2": ("layers", "KV heads", "hidden width"),
    "b2": ("layers", "KV heads"),
}


# Logical axis names (`jaxkv.sharding`: a mesh splits the gates with their KV heads).
PARAM_AXES = {
    "norm_unrotated": ("layers", "head_dim"),
    "norm_rotated": ("layers", "head_dim"),
    "w1": ("layers", "kv_heads", "gate", "gate"),
    "b1": ("layers", "kv_heads", "gate"),
    "w2": ("layers", "kv_heads", "gate"),
    "b2": ("layers", "kv_heads"),
}


def expected_shapes(model_config: ModelConfig, width: int) -> dict[str, tuple[int, ...]]:
    """The shape of every gate parameter for this model and hidden width E."""
    num_layers, heads, dim = (
        model_config.num_layers,
        model_config.num_kv_heads,
        model_config.head_dim,
    )
    return {
        "norm_unrotated": (num_layers, dim),
        "norm_rotated": (num_layers, dim),
        "w1": (num_layers, heads, 2 * dim, width),
        "b1": (num_layers, heads, width),
        "w2": (num_layers, heads, width),
        "b2": (num_layers, heads),
    }


def check_write_gates(params: GateParams, model_config: ModelConfig) -> None:
    """Raises ValueError naming the mismatch (layers, KV heads, head dim, hidden width, dtype)
    when `params` are not write gates for this model."""
    if not isinstance(params, dict) or set(params) != set(PARAM_NAMES):
        found = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"write gate params must have keys {sorted(PARAM_NAMES)}, got {found}")
    w1_shape = tuple(np.shape(params["w1"]))
    if len(w1_shape) != 4:
        raise ValueError(f"write gate w1 has shape {w1_shape}: expected [L, K, 2H, E]")
    for name, shape in expected_shapes(model_config, w1_shape[3]).items():
        actual = tuple(np.shape(params[name]))
        if len(actual) != len(shape):
            raise ValueError(f"write gate {name} has shape {actual}: expected {shape}")
        for axis, what in enumerate(AXIS_NAMES[name]):
            if actual[axis] != shape[axis]:
                raise ValueError(
                    f"write gate {name} has shape {actual}, the model needs {shape}: "
                    f"{what} {actual[axis]} vs the model's {shape[axis]}"
                )
        dtype = jnp.result_type(params[name])
        if dtype != jnp.float32:
            raise ValueError(f"write gate {name} has dtype {dtype}: gates are float32")


def save_write_gates(params: GateParams, path: str | Path) -> None:
    """Writes gates to a `.safetensors` file, or (any other path) an orbax checkpoint directory."""
    path = Path(path)
    arrays = {name: np.asarray(params[name], np.float32) for name in PARAM_NAMES}
    if path.suffix == ".safetensors":
        from safetensors.numpy import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(arrays, str(path))
        return
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path.absolute(), arrays)


def _resolve_gates_path(path: Path) -> Path:
    """A gates file or orbax checkpoint as is; a directory holding `gates.safetensors` (as
    `assets/wgkv-gates/lambda-0.08/` does) or exactly one `.safetensors` file resolves to it."""
    if not path.is_dir() or (path / "_METADATA").exists():
        return path
    if (path / "gates.safetensors").exists():
        return path / "gates.safetensors"
    files = sorted(path.glob("*.safetensors"))
    if len(files) == 1:
        return files[0]
    if files:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"{path} holds several gate files ({names}): give one of them")
    raise FileNotFoundError(
        f"{path} holds neither a .safetensors gates file nor an orbax checkpoint (_METADATA)"
    )


def load_write_gates(path: str | Path, model_config: ModelConfig) -> GateParams:
    """Reads gates saved by `save_write_gates` (format by suffix) and checks them for the model.

    path: a `.safetensors` file, an orbax checkpoint directory, or a directory holding one
    `.safetensors` gates file (`assets/wgkv-gates/lambda-0.08`).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no write gates at {path}")
    path = _resolve_gates_path(path)
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        arrays = load_file(str(path))
    else:
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as checkpointer:
            arrays = checkpointer.restore(path.absolute())
    params = {name: jnp.asarray(value) for name, value in arrays.items()}
    check_write_gates(params, model_config)
    return params
