"""ThinK as NVIDIA kvpress 0.5.5's ThinKPress implements it: after prefill, each KV head zeroes
the key channels (dimensions) least used by the prompt's last `window` queries.

A channel's score is the mean over the window's queries (post-RoPE, averaged over the head's
query group) of their squared value, times the mean over the cached keys of theirs; the
floor(ratio x head_dim) lowest-scoring channels of each head are set to zero in every key the
prompt left. Decode keys are written whole (kvpress prunes at prefill only).

What it saves: nothing, in jaxkv's paged cache as in kvpress, whose keys keep their shape. A
page stores all head_dim channels of its tokens ([P, p, H]); keeping only the unpruned channels
would need pages of another width per head and a kernel that gathers the query's channels, and
would save at most ratio / 2 of the KV bytes (keys only). ThinK here is the paper's quality
effect, measurable beside the token-evicting presses. Paper (docs/references.md): "ThinK:
Thinner Key Cache by Query-Driven Pruning" (arXiv:2407.21018).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv.cache import KVState
from jaxkv.cache.eviction import rank_descending
from jaxkv.policies import base
from jaxkv.policies.eviction import LayerView, map_layers
from jaxkv.step.parts import PrefillObservations


def channel_scores(view: LayerView) -> jax.Array:
    """f32 [B, K, H]: each key channel's mean squared observed query (valid queries only,
    averaged over the KV head's query group) times its mean squared held key."""
    queries = view.queries.astype(jnp.float32)  # [B, N, w, H]
    valid = (view.query_positions >= 0)[:, None, :, None]
    count = jnp.maximum(jnp.sum(valid, axis=2), 1)
    query_energy = jnp.sum(jnp.where(valid, jnp.square(queries), 0.0), axis=2) / count
    b, n, h = query_energy.shape
    k = view.keys.shape[1]
    query_energy = query_energy.reshape(b, k, n // k, h).mean(axis=2)
    held = view.held[..., None]
    keys = jnp.where(held, jnp.square(view.keys.astype(jnp.float32)), 0.0)
    key_energy = jnp.sum(keys, axis=2) / jnp.maximum(jnp.sum(held, axis=2), 1)
    return query_energy * key_energy


def lowest_channels(scores: jax.Array, pruned: int) -> jax.Array:
    """bool [..., H]: the `pruned` lowest scores of each head (ties: the lower channel)."""
    return rank_descending(-scores) < pruned


def zero_key_channels(kv: KVState, pruned: jax.Array) -> KVState:
    """`kv` with the channels `pruned` (bool [L, B, K, H]) of each head's keys set to 0 in
    every page it names (its key bounds too)."""
    pool, h = kv.pool, pruned.shape[-1]
    owners = jnp.broadcast_to(pruned[..., None, :], (*kv.page_table.shape, h))  # [L, B, K, M, H]
    index = jnp.where(kv.page_table >= 0, kv.page_table, pool.num_pages).reshape(-1)
    keep = jnp.ones((pool.num_pages, h), jnp.bool_)
    keep = keep.at[index].set(~owners.reshape(-1, h), mode="drop")
    zeroed = {"k_pages": jnp.where(keep[:, None, :], pool.k_pages, 0).astype(pool.k_pages.dtype)}
    if pool.key_min is not None:
        zeroed["key_min"] = jnp.where(keep, pool.key_min, 0.0)
        zeroed["key_max"] = jnp.where(keep, pool.key_max, 0.0)
    return dataclasses.replace(kv, pool=dataclasses.replace(pool, **zeroed))


@dataclasses.dataclass(frozen=True)
class KeyChannelPruning(base.PromptCompressionPart):
    """ThinK's prompt compression: every token kept, the floor(ratio x head_dim) lowest-scoring
    key channels of each head zeroed (module docstring)."""

    window: int
    ratio: float

    @property
    def observation_window(self) -> int:
        return self.window

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        pruned = int(kv.pool.k_pages.shape[-1] * self.ratio)  # kvpress's count
        if pruned == 0:
            return kv
        scores = map_layers(kv, obs, model, channel_scores)  # [L, B, K, H]
        return zero_key_channels(kv, lowest_channels(scores, pruned))


@base.register
@dataclasses.dataclass(frozen=True)
class ThinK(base.Policy):
    """ThinKPress: each head's least-used key channels zeroed after prefill; every token kept
    (module docstring: what it saves in a paged cache).

    Attributes:
      key_channel_ratio: the share of each head's key channels pruned, in [0, 1) (kvpress's
        `key_channel_compression_ratio`).
      window: the last prompt queries that score the channels (kvpress's default 32).
    """

    name: ClassVar[str] = "think"
    primary_knob: ClassVar[str] = "key_channel_ratio"
    key_channel_ratio: float = 0.0
    window: int = 32

    def _check(self) -> None:
        super()._check()
        if not 0.0 <= self.key_channel_ratio < 1.0:
            raise ValueError(f"key_channel_ratio={self.key_channel_ratio} must be in [0, 1)")
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")

    def _parts(self) -> dict:
        return {"prompt_compression": KeyChannelPruning(self.window, self.key_channel_ratio)}
