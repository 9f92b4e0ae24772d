"""KVzap as NVIDIA kvpress 0.5.5's KVzapPress implements it: a small surrogate per layer reads
each token's attention input (the normed hidden state) and predicts one importance score per KV
head; each head keeps its highest-scoring tokens (the shared keep-top-k eviction).

The surrogate ("KVzap: Fast, Adaptive and Faithful KV Cache Pruning", arXiv:2601.07891) is
`linear` (h W + b, [D] -> [K]) or `mlp` (a GELU layer of M units between); it is meant to
predict KVzip's scores without KVzip's replay. kvpress loads surrogates NVIDIA trained from the
Hugging Face hub; jaxkv takes them as the policy's parameters (`SurrogateParams`), computes the
scores as each token is written (the policy's gate part, as Fast KVzip's) and ranks the stored
scores at the end of prefill.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy
from jaxkv.policies.qfilter import WrittenScores

SURROGATES = ("linear", "mlp")


def params_file(surrogate: str) -> str:
    """The file a directory of surrogates holds `surrogate`'s parameters in (`jaxkv train
    kvzap` writes both)."""
    return f"{surrogate}.npz"


# The arrays of each surrogate, with the logical axes of their dimensions.
AXES = {
    "linear": {"weight": ("layers", "embed", "kv_heads"), "bias": ("layers", "kv_heads")},
    "mlp": {
        "w_in": ("layers", "embed", "gate"),
        "b_in": ("layers", "gate"),
        "w_out": ("layers", "gate", "kv_heads"),
        "b_out": ("layers", "kv_heads"),
    },
}
HIGHEST = jax.lax.Precision.HIGHEST


def surrogate_scores(layer_params: dict, h: jax.Array) -> jax.Array:
    """f32 [B, K, C]: one layer's surrogate on attention inputs h [B, C, D] (`linear` params
    weight [D, K], bias [K]; `mlp` params w_in [D, M], b_in [M], w_out [M, K], b_out [K])."""
    x = h.astype(jnp.float32)
    if "weight" in layer_params:
        out = jnp.einsum("bcd,dk->bck", x, layer_params["weight"], precision=HIGHEST)
        out = out + layer_params["bias"]
    else:
        hidden = jnp.einsum("bcd,dm->bcm", x, layer_params["w_in"], precision=HIGHEST)
        hidden = jax.nn.gelu(hidden + layer_params["b_in"], approximate=False)
        out = jnp.einsum("bcm,mk->bck", hidden, layer_params["w_out"], precision=HIGHEST)
        out = out + layer_params["b_out"]
    return jnp.swapaxes(out, 1, 2)


@dataclasses.dataclass(frozen=True)
class SurrogateGate:
    """The gate part: each written token scored by its layer's surrogate."""

    def write_scores(self, layer_params, *, h, q, k_unrotated, k, v, positions):
        del k_unrotated, k, positions, q, v
        return surrogate_scores(layer_params, h)


@dataclasses.dataclass(frozen=True)
class SurrogateParams(base.LearnedParams):
    """KVzap's surrogates (module docstring), saved as `linear.npz` or `mlp.npz`.

    Attributes:
      surrogate: "linear" or "mlp".
      hidden: M, the MLP's units, for untrained parameters (`init`).
    """

    kind: ClassVar[str] = "kvzap"
    description: ClassVar[str] = "the surrogates' weights (an .npz of per-layer arrays)"
    surrogate: str
    hidden: int = 64

    def init(self, model_config, key):
        """Small random weights of the surrogate's shapes (untrained; plans use their shapes)."""
        cfg = model_config
        d, k, layers = cfg.hidden_size, cfg.num_kv_heads, cfg.num_layers
        shapes = {
            "linear": {"weight": (layers, d, k), "bias": (layers, k)},
            "mlp": {
                "w_in": (layers, d, self.hidden),
                "b_in": (layers, self.hidden),
                "w_out": (layers, self.hidden, k),
                "b_out": (layers, k),
            },
        }[self.surrogate]
        keys = jax.random.split(key, len(shapes))
        return {
            name: 0.02 * jax.random.normal(part, shape, jnp.float32)
            for part, (name, shape) in zip(keys, shapes.items(), strict=True)
        }

    def load(self, path, model_config):
        """`path`: a surrogate .npz file or a directory holding `params_file(surrogate)`."""
        what = (
            f"KVzap {self.surrogate} surrogates (an .npz of {', '.join(AXES[self.surrogate])}, "
            "`jaxkv train kvzap`)"
        )
        with np.load(self.saved_file(path, params_file(self.surrogate), what)) as saved:
            params = {name: jnp.asarray(saved[name]) for name in saved.files}
        self.check(params, model_config)
        return params

    def check(self, params, model_config) -> None:
        cfg = model_config
        names = tuple(AXES[self.surrogate])
        if not isinstance(params, dict) or tuple(sorted(params)) != tuple(sorted(names)):
            got = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(
                f"policy 'kvzap' ({self.surrogate}) needs policy_params {list(names)}, got {got}"
            )
        sizes = {"layers": cfg.num_layers, "embed": cfg.hidden_size, "kv_heads": cfg.num_kv_heads}
        units = params["w_in"].shape[-1] if self.surrogate == "mlp" else None
        for name, axes in AXES[self.surrogate].items():
            expected = tuple(units if axis == "gate" else sizes[axis] for axis in axes)
            if tuple(np.shape(params[name])) != expected:
                raise ValueError(
                    f"policy 'kvzap' ({self.surrogate}): policy_params[{name!r}] has shape "
                    f"{tuple(np.shape(params[name]))}, not {expected} ({', '.join(axes)})"
                )

    def axes(self, params):
        del params
        return AXES[self.surrogate]


@base.register
@dataclasses.dataclass(frozen=True)
class KVzap(EvictionPolicy):
    """Keep the tokens a learned surrogate of the attention input scores highest (module
    docstring); policy_params: the surrogates (`SurrogateParams`).

    Attributes:
      surrogate: "mlp" (kvpress's default) or "linear".
    """

    name: ClassVar[str] = "kvzap"
    surrogate: str = "mlp"

    def _check(self) -> None:
        super()._check()
        if self.surrogate not in SURROGATES:
            raise ValueError(f"surrogate={self.surrogate!r} must be one of {SURROGATES}")

    def _scorer(self) -> WrittenScores:
        return WrittenScores()

    def _parts(self) -> dict:
        return super()._parts() | {
            "gate": SurrogateGate(),
            "params": SurrogateParams(self.surrogate),
        }
