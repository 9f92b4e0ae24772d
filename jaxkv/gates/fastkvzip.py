"""Fast KVzip's sink-attention gate: a per-token keep score from the layer's attention input.

Fast KVzip: "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction",
arXiv:2601.17668 (docs/fastkvzip.md). For each KV head k, its G query heads j and a token's
attention input h [D]:
  q_j = RMSNorm_q(W_q h + b_q)_j  [D'],   key = RMSNorm_k(W_k h)_k  [D']  (RMSNorm over D'),
  logit_j = q_j . key / sqrt(D') + b_{k,j}  (the bias added once),
  sink_{j,r} = q_j . sink_{k,r} / sqrt(D')  for the S learned sink keys (not normalised),
  score_{k,j} = 1 / (1 + sum_r exp(sink_{j,r} - logit_j)) = sigmoid(logit_j - logsumexp_r sink),
  score_k = mean_j score_{k,j}.
The token "attends" to its own key against S sinks: a high score means the token's KV pair is
worth keeping. Parameters are a separate tree, every leaf stacked on a leading [L] axis
(einsum letters: L layers, D hidden, K KV heads, G group, E = D' gate dim, S sinks):

  wq [L, D, K, G, E]; bq [L, K, G, E]; q_norm [L, E]; wk [L, D, K, E]; k_norm [L, E];
  sinks [L, K, S, E]; bias [L, K, G].
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models.configs import ModelConfig

GATE_DIM = 16
NUM_SINKS = 16
NORM_EPS = 1e-6
# The gates: name -> array, every leaf stacked [L, ...] (layout in the module docstring).
GateParams = dict[str, jax.Array]


def param_shapes(
    model_config: ModelConfig, gate_dim: int = GATE_DIM, num_sinks: int = NUM_SINKS
) -> dict[str, tuple[int, ...]]:
    """Shapes of every gate parameter for `model_config` (layout in the module docstring)."""
    cfg = model_config
    n_layers, d, k, g = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.group_size
    return {
        "wq": (n_layers, d, k, g, gate_dim),
        "bq": (n_layers, k, g, gate_dim),
        "q_norm": (n_layers, gate_dim),
        "wk": (n_layers, d, k, gate_dim),
        "k_norm": (n_layers, gate_dim),
        "sinks": (n_layers, k, num_sinks, gate_dim),
        "bias": (n_layers, k, g),
    }


# Logical axis names of every gate parameter (`jaxkv.sharding`: a mesh splits KV heads).
PARAM_AXES = {
    "wq": ("layers", "embed", "kv_heads", "gate", "gate"),
    "bq": ("layers", "kv_heads", "gate", "gate"),
    "q_norm": ("layers", "gate"),
    "wk": ("layers", "embed", "kv_heads", "gate"),
    "k_norm": ("layers", "gate"),
    "sinks": ("layers", "kv_heads", "gate", "gate"),
    "bias": ("layers", "kv_heads", "gate"),
}


def init_params(
    model_config: ModelConfig, key: jax.Array, gate_dim: int = GATE_DIM, num_sinks: int = NUM_SINKS
) -> GateParams:
    """f32 gate parameters: projections N(0, 1/D), sinks N(0, 1), unit norms, zero biases."""
    shapes = param_shapes(model_config, gate_dim, num_sinks)
    keys = dict(zip(shapes, jax.random.split(key, len(shapes)), strict=True))
    fan_in = model_config.hidden_size**-0.5
    params = {}
    for name, shape in shapes.items():
        if name.endswith("norm"):
            params[name] = jnp.ones(shape, jnp.float32)
        elif name in ("bq", "bias"):
            params[name] = jnp.zeros(shape, jnp.float32)
        elif name == "sinks":
            params[name] = jax.random.normal(keys[name], shape, jnp.float32)
        else:
            params[name] = fan_in * jax.random.normal(keys[name], shape, jnp.float32)
    return params


def check_params(params: GateParams, model_config: ModelConfig) -> None:
    """Raises ValueError unless `params` is a gate tree for `model_config` (any E and S)."""
    if not isinstance(params, dict) or set(params) != set(param_shapes(model_config)):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(
            f"policy_params must be a Fast KVzip gate dict with keys "
            f"{sorted(param_shapes(model_config))}, got {got}"
        )
    gate_dim = np.shape(params["q_norm"])[-1]
    num_sinks = np.shape(params["sinks"])[-2] if np.ndim(params["sinks"]) == 4 else 0
    expected = param_shapes(model_config, gate_dim, num_sinks)
    for name, shape in expected.items():
        if tuple(np.shape(params[name])) != shape:
            raise ValueError(
                f"gate parameter {name!r} has shape {tuple(np.shape(params[name]))}: the model "
                f"(L={model_config.num_layers}, D={model_config.hidden_size}, "
                f"K={model_config.num_kv_heads}, G={model_config.group_size}) needs {shape}"
            )


def _rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * weight


def head_scores(layer_params: GateParams, h: jax.Array) -> jax.Array:
    """f32 [B, K, G, C] per-query-head scores score_{k,j} of one layer for h [B, C, D]."""
    p = layer_params
    h = h.astype(jnp.float32)
    scale = p["q_norm"].shape[-1] ** -0.5
    q = _rms_norm(jnp.einsum("bcd,dkge->bkgce", h, p["wq"]) + p["bq"][:, :, None], p["q_norm"])
    key = _rms_norm(jnp.einsum("bcd,dke->bkce", h, p["wk"]), p["k_norm"])
    logit = jnp.einsum("bkgce,bkce->bkgc", q, key) * scale + p["bias"][..., None]
    sinks = jnp.einsum("bkgce,kse->bkgcs", q, p["sinks"]) * scale
    return jax.nn.sigmoid(logit - jax.nn.logsumexp(sinks, axis=-1))


def gate_scores(layer_params: GateParams, h: jax.Array) -> jax.Array:
    """f32 [B, K, C]: the gate's keep score of every token, averaged over the group."""
    return jnp.mean(head_scores(layer_params, h), axis=2)


def layer_slice(params: GateParams, layer: int) -> GateParams:
    """One layer's parameters (the leaves' [L] axis indexed)."""
    return jax.tree.map(lambda x: x[layer], params)


# --- persistence ---------------------------------------------------------------------------


def save_safetensors(params: GateParams, path: str | Path, metadata: dict | None = None) -> None:
    """Writes the gate tree as f32 tensors named like its keys (plus string metadata)."""
    from safetensors.numpy import save_file

    tensors = {name: np.asarray(value, np.float32) for name, value in params.items()}
    meta = {name: json.dumps(value) for name, value in (metadata or {}).items()}
    meta["format"] = "jaxkv-fastkvzip-gates"
    save_file(tensors, str(path), metadata=meta)


def load_safetensors(path: str | Path, model_config: ModelConfig | None = None) -> GateParams:
    """Reads a gate tree written by `save_safetensors`; checked against `model_config` if given."""
    from safetensors.numpy import load_file

    params = {name: jnp.asarray(value) for name, value in load_file(str(path)).items()}
    if model_config is not None:
        check_params(params, model_config)
    return params


def save_orbax(params: GateParams, directory: str | Path) -> None:
    """Writes the gate tree as an orbax checkpoint at `directory` (must not exist)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(Path(directory).absolute(), params)


def load_orbax(directory: str | Path, model_config: ModelConfig) -> GateParams:
    """Reads an orbax gate checkpoint, checked against `model_config`."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(Path(directory).absolute())
    check_params(params, model_config)
    return params
