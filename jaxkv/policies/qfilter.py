"""Q-Filters as NVIDIA kvpress 0.5.5's QFilterPress implements it: each key is scored by its
projection on one fixed direction per (layer, KV head), the filter, and each head keeps its
highest-scoring keys (the shared keep-top-k eviction, as Knorm).

The filter comes from the model, not the prompt ("Q-Filters: Leveraging QK Geometry for
Efficient KV Cache Compression", arXiv:2503.02812): queries of a head are strongly anisotropic,
most of them pointing along one direction, so a key's dot product with that direction predicts
the attention it gets from most queries. `query_filters` finds it from calibration queries (the
first right singular vector of each query head's queries, oriented so that most queries project
positively on it, negated as kvpress stores it, averaged over the KV head's query group);
`jaxkv train qfilter` computes it on a corpus (the queries after RoPE, as the keys it scores)
and writes the f32 [L, K, H] array the policy's `params` load. A key's score is
-(filter . key), the key after RoPE, computed as it is written (the policy's gate part) and
ranked at the end of prefill from the stored scores.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, LayerView, Scorer

FILTERS_FILE = "filters.npy"


@dataclasses.dataclass(frozen=True)
class FilterGate:
    """The gate part: each written key scored -(filter . key) (its layer's filters [K, H])."""

    def write_scores(self, layer_params, *, h, q, k_unrotated, k, v, positions):
        del h, k_unrotated, positions, q, v
        filters = layer_params["filters"].astype(jnp.float32)
        keys = k.astype(jnp.float32)  # [B, K, C, H]
        return -jnp.einsum("kh,bkch->bkc", filters, keys, precision=jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class WrittenScores(Scorer):
    """The scores the gate wrote with each token (`token_scores`)."""

    cache_only: ClassVar[bool] = True

    def layer_scores(self, view: LayerView) -> jax.Array:
        return view.token_scores


@dataclasses.dataclass(frozen=True)
class QueryFilters(base.LearnedParams):
    """Q-Filters' filters: {"filters": f32 [L, K, H]}, saved as `filters.npy` (`jaxkv train
    qfilter` writes it)."""

    kind: ClassVar[str] = "qfilter"
    description: ClassVar[str] = "the f32 [L, K, H] filters (`jaxkv train qfilter` writes them)"

    def init(self, model_config, key):
        """Unit filters of random directions (untrained; plans use their shapes)."""
        cfg = model_config
        shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        filters = jax.random.normal(key, shape, jnp.float32)
        return {"filters": filters / jnp.linalg.norm(filters, axis=-1, keepdims=True)}

    def load(self, path, model_config):
        """`path`: a filters .npy file or a directory holding `filters.npy`."""
        what = "Q-Filters (an f32 [L, K, H] .npy, `jaxkv train qfilter` writes one)"
        params = {"filters": jnp.asarray(np.load(self.saved_file(path, FILTERS_FILE, what)))}
        self.check(params, model_config)
        return params

    def check(self, params, model_config) -> None:
        cfg = model_config
        expected = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        filters = params.get("filters") if isinstance(params, dict) else None
        if filters is None or tuple(np.shape(filters)) != expected:
            got = None if filters is None else tuple(np.shape(filters))
            raise ValueError(
                f"policy 'qfilter' needs policy_params {{'filters': f32 [L, K, H] = {expected}}}, "
                f"got {got if got is not None else params!r}"
            )
        if not jnp.issubdtype(jnp.result_type(filters), jnp.floating):
            raise ValueError(f"qfilter filters must be floating point, got {filters.dtype}")

    def axes(self, params):
        del params
        return {"filters": ("layers", "kv_heads", "head_dim")}


@base.register
@dataclasses.dataclass(frozen=True)
class QFilter(EvictionPolicy):
    """Keep the keys with the highest -(filter . key) per head (module docstring);
    policy_params: the filters (`QueryFilters`)."""

    name: ClassVar[str] = "qfilter"

    def _scorer(self) -> WrittenScores:
        return WrittenScores()

    def _parts(self) -> dict:
        return super()._parts() | {"gate": FilterGate(), "params": QueryFilters()}


def query_filters(queries: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """One layer's filters f32 [K, H] from its calibration queries [N, T, H] (N query heads, T
    tokens): per query head the first right singular vector v of its queries, oriented so that
    most queries project positively on it and negated (the filter is -v: a key's score
    -(filter . key) = v . key), averaged over each KV head's group of N / K query heads."""
    queries = np.asarray(queries, np.float64)
    u, _, vh = np.linalg.svd(queries, full_matrices=False)  # u [N, T, r], vh [N, r, H]
    most_positive = np.mean(u[..., 0] > 0, axis=-1) > 0.5  # [N]
    direction = np.where(most_positive[:, None], vh[:, 0], -vh[:, 0])
    n, h = direction.shape
    return (-direction).reshape(num_kv_heads, n // num_kv_heads, h).mean(axis=1).astype(np.float32)
