"""Scorers that rank the cache from its keys and values alone, with the semantics of NVIDIA
kvpress 0.5.5's presses: KeyDiff, LagKV, CUR (CurDKV) and Random.

They see the cache as kvpress's presses do: each head's tokens in cache order (slot order; the
prompt's positions when nothing was evicted before), so LagKV's partitions and CUR's windows
are runs of slots. None observes a query, so each also scores a part of the cache
(`cache_only`: ChunkPress and BlockPress of `jaxkv.policies.structure` score runs of it).
Papers (docs/references.md): KeyDiff "KeyDiff: Key Similarity-Based KV Cache Eviction for
Long-Context LLM Inference in Resource-Constrained Environments" (arXiv:2504.15364); LagKV
"LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important"
(arXiv:2504.04704); CurDKV "Value-Guided KV Compression for LLMs via Approximated CUR
Decomposition" (arXiv:2509.15038).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp

from jaxkv import collectives
from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, LayerView, Scorer

# torch.nn.functional's epsilons (cosine_similarity, normalize).
_COSINE_EPS = 1e-8
_NORMALIZE_EPS = 1e-12


def held_counts(view: LayerView) -> jax.Array:
    """int32 [B, K, 1] tokens each head holds (its held slots come first)."""
    return jnp.sum(view.held, axis=-1, keepdims=True, dtype=jnp.int32)


def slot_indices(view: LayerView) -> jax.Array:
    """int32 [S] the slots' indices."""
    return jnp.arange(view.positions.shape[-1], dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class KeyDiffScores(Scorer):
    """KeyDiff's scores: minus each key's cosine similarity to the mean of the head's unit keys
    (the more distinct a key, the higher it ranks)."""

    cache_only: ClassVar[bool] = True

    def layer_scores(self, view: LayerView) -> jax.Array:
        keys = view.keys.astype(jnp.float32)
        held = view.held[..., None]
        norms = jnp.linalg.norm(keys, axis=-1, keepdims=True)
        unit = keys / jnp.maximum(norms, _NORMALIZE_EPS)
        anchor = jnp.sum(jnp.where(held, unit, 0.0), axis=2, keepdims=True) / jnp.maximum(
            held_counts(view)[..., None], 1
        )
        anchor_norm = jnp.linalg.norm(anchor, axis=-1, keepdims=True)
        dots = jnp.sum(keys * anchor, axis=-1, keepdims=True)
        cosine = dots / jnp.maximum(norms, _COSINE_EPS) / jnp.maximum(anchor_norm, _COSINE_EPS)
        return -cosine[..., 0]


@base.register
@dataclasses.dataclass(frozen=True)
class KeyDiff(EvictionPolicy):
    """Keep the keys least similar to the head's mean key direction (KeyDiff; its block-wise
    form is `block` with `inner="keydiff"`)."""

    name: ClassVar[str] = "keydiff"

    def _scorer(self) -> KeyDiffScores:
        return KeyDiffScores()


@dataclasses.dataclass(frozen=True)
class LagScores(Scorer):
    """LagKV's scores. After `sinks` slots the cache splits into partitions of `lag_size`
    slots; each token of a partition is scored against the next partition (its reference):
    keys and values min-max scaled by the reference's per-channel range, the standard deviation
    over channels, softmaxed over the partition, key and value scores averaged, then (unless
    `cross_scoring`) replaced by their rank within the partition / lag_size. The sinks, the
    last whole partition and what follows it score 1 (kept first). A head holding fewer than
    sinks + 2 lag_size tokens keeps its sinks and then its newest tokens.
    """

    sinks: int
    lag_size: int
    cross_scoring: bool

    cache_only: ClassVar[bool] = True
    reads_values: ClassVar[bool] = True

    def layer_scores(self, view: LayerView) -> jax.Array:
        held = held_counts(view)
        slots = slot_indices(view)
        recency = (slots - self.sinks) / jnp.maximum(held - self.sinks, 1)
        short = jnp.where(slots < self.sinks, 1.0, recency)
        partitions = (view.positions.shape[-1] - self.sinks) // self.lag_size
        if partitions < 2:  # no head holds enough slots to score a partition
            return short
        lagged = self._partition_scores(view, partitions)
        # Partitions 0 .. P-2 of a head with P whole ones are scored; the rest scores 1.
        whole = (held - self.sinks) // self.lag_size
        partition = (slots - self.sinks) // self.lag_size
        scored = (slots >= self.sinks) & (partition <= whole - 2)
        return jnp.where(held < self.sinks + 2 * self.lag_size, short, jnp.where(scored, lagged, 1))

    def _partition_scores(self, view: LayerView, partitions: int) -> jax.Array:
        """f32 [B, K, S] every partition's scores against the next one (1 where none is)."""
        b, k, s, _ = view.keys.shape
        end = self.sinks + partitions * self.lag_size

        def states_score(states):
            blocks = states[:, :, self.sinks : end].astype(jnp.float32)
            blocks = blocks.reshape(b, k, partitions, self.lag_size, -1)
            low = jnp.min(blocks[:, :, 1:], axis=3, keepdims=True)
            high = jnp.max(blocks[:, :, 1:], axis=3, keepdims=True)
            scaled = (blocks[:, :, :-1] - low) / (high - low)
            return jax.nn.softmax(jnp.std(scaled, axis=-1, ddof=1), axis=-1)  # [B, K, P-1, lag]

        score = (states_score(view.keys) + states_score(view.values)) / 2
        if not self.cross_scoring:
            ranks = jnp.argsort(jnp.argsort(score, axis=-1), axis=-1)
            score = ranks.astype(jnp.float32) / self.lag_size
        flat = score.reshape(b, k, (partitions - 1) * self.lag_size)
        ones = jnp.ones((b, k, s), jnp.float32)
        return jax.lax.dynamic_update_slice(ones, flat, (0, 0, self.sinks))


@base.register
@dataclasses.dataclass(frozen=True)
class LagKV(EvictionPolicy):
    """LagKV: each partition of `lag_size` tokens scored by its keys' and values' spread
    relative to the next partition (`LagScores`); the first `sinks` tokens always kept.

    Attributes:
      lag_size: tokens per partition (>= 2).
      cross_scoring: rank by the raw scores across partitions instead of within each.
    """

    name: ClassVar[str] = "lagkv"
    sinks: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    def _check(self) -> None:
        super()._check()
        if self.lag_size < 2:
            raise ValueError(f"lag_size={self.lag_size} must be >= 2")

    def _scorer(self) -> LagScores:
        return LagScores(self.sinks, self.lag_size, self.cross_scoring)


LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")


@dataclasses.dataclass(frozen=True)
class CURScores(Scorer):
    """CurDKV's approximate leverage scores: each token's squared key norm (k2) and value norm
    (v2), each as a share of its window of `local_window` slots (0: not windowed), combined
    as `leverage_type` says, as a share of the head's total; the first `sinks` slots score 1."""

    sinks: int
    leverage_type: Literal["key", "value", "kv_avg", "kv_product"]
    local_window: int

    cache_only: ClassVar[bool] = True
    reads_values: ClassVar[bool] = True

    def layer_scores(self, view: LayerView) -> jax.Array:
        held = view.held
        k2 = self._local_share(jnp.sum(jnp.square(view.keys.astype(jnp.float32)), -1), held)
        v2 = self._local_share(jnp.sum(jnp.square(view.values.astype(jnp.float32)), -1), held)
        scores = {
            "key": k2,
            "value": v2,
            "kv_avg": (k2 + v2) / 2,
            "kv_product": k2 * v2,
        }[self.leverage_type]
        scores = scores / jnp.sum(jnp.where(held, scores, 0.0), axis=-1, keepdims=True)
        return jnp.where(slot_indices(view) < self.sinks, 1.0, scores)

    def _local_share(self, squares: jax.Array, held: jax.Array) -> jax.Array:
        """[B, K, S]: each held value as a share of its window's sum (unchanged without one)."""
        squares = jnp.where(held, squares, 0.0)
        w = self.local_window
        if w == 0:
            return squares
        b, k, s = squares.shape
        padded = jnp.pad(squares, ((0, 0), (0, 0), (0, -s % w))).reshape(b, k, -1, w)
        shares = padded / jnp.sum(padded, axis=-1, keepdims=True)
        return shares.reshape(b, k, -1)[..., :s]


@base.register
@dataclasses.dataclass(frozen=True)
class CUR(EvictionPolicy):
    """CurDKV: keep the tokens of highest approximate CUR leverage (`CURScores`); the first
    `sinks` tokens always kept. kvpress's optional random projection of the keys and values
    (`use_random_leverage`) is not offered.

    Attributes:
      leverage_type: "kv_product" (default), "kv_avg", "key" or "value".
      local_window: slots per normalising window (0: the whole head at once).
    """

    name: ClassVar[str] = "cur"
    sinks: int = 4
    leverage_type: str = "kv_product"
    local_window: int = 16

    def _check(self) -> None:
        super()._check()
        if self.leverage_type not in LEVERAGE_TYPES:
            raise ValueError(f"leverage_type={self.leverage_type!r}: one of {LEVERAGE_TYPES}")
        if self.local_window < 0:
            raise ValueError(f"local_window={self.local_window} must be >= 0 (0: no window)")

    def _scorer(self) -> CURScores:
        return CURScores(self.sinks, self.leverage_type, self.local_window)


@dataclasses.dataclass(frozen=True)
class RandomScores(Scorer):
    """Uniform random scores from the layer's key (the prefill's key: a request's seed), each
    row's index in the request and each token's original position: a token's score does not
    depend on where the cache holds it (the page table's width differs between `generate` and
    the engine), so the same request keeps the same tokens in both."""

    cache_only: ClassVar[bool] = True

    def layer_scores(self, view: LayerView) -> jax.Array:
        # One draw per (request row, global KV head, position): a mesh draws what one device
        # does and any table width the same scores.
        b, k, _ = view.positions.shape
        heads = collectives.local_heads(jnp.arange(k * collectives.head_shards()), axis=0)

        def score(row, head, position):
            key = jax.random.fold_in(jax.random.fold_in(view.key, row), head)
            return jax.random.uniform(jax.random.fold_in(key, jnp.maximum(position, 0)))

        per_head = jax.vmap(score, (None, None, 0))
        per_row = jax.vmap(per_head, (None, 0, 0))
        return jax.vmap(per_row, (0, None, 0))(collectives.global_rows(b), heads, view.positions)


@base.register
@dataclasses.dataclass(frozen=True)
class Random(EvictionPolicy):
    """Keep a uniformly random share of each head (the baseline every scorer should beat);
    reproducible from the request's key."""

    name: ClassVar[str] = "random"

    def _scorer(self) -> RandomScores:
        return RandomScores()
