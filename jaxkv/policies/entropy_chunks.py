"""EntropyGatedChunkKV as NVIDIA kvpress 0.5.5's EntropyGatedChunkKVPress implements it: ChunkKV's
chunks (an inner scorer's scores summed over a layer's KV heads, one choice for every head),
taken best mean score first while the budget lasts, except that a chunk scoring at least the
median chunk score with a within-chunk entropy below the median entropy keeps only its best
`low_entropy_length` tokens; budget left once every chunk is seen goes to the best tokens not
yet kept. A head keeps exactly share x T tokens (at least one).

The entropy of a chunk is that of its token scores (shifted to be non-negative where any is
negative) as a distribution, over log(chunk size); medians are the lower middle value, as
torch's. Paper (docs/references.md): ChunkKV (arXiv:2502.00299).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, rank_descending
from jaxkv.policies import base
from jaxkv.policies.eviction import (
    EvictionPolicy,
    InnerScoredCompression,
    protected_on_top,
)
from jaxkv.policies.structure import (
    THRESHOLD_NAMES,
    ChunkedBudget,
    kept_share,
    pad_slots,
    ratio_budget,
    scoring_compression,
    share_of,
)
from jaxkv.step.parts import PrefillObservations

_EPS = 1e-8  # kvpress's


def lower_median(x: jax.Array, valid: jax.Array) -> jax.Array:
    """The lower middle of the valid entries of x [..., C] (torch.median's)."""
    ordered = jnp.sort(jnp.where(valid, x, jnp.inf), axis=-1)
    middle = (jnp.sum(valid, axis=-1, keepdims=True) - 1) // 2
    return jnp.take_along_axis(ordered, jnp.maximum(middle, 0), axis=-1)


def chunk_entropy(chunks: jax.Array, sizes: jax.Array) -> jax.Array:
    """f32 [..., C]: each chunk's normalised entropy of its token scores [..., C, c], the
    first `sizes` [..., C] tokens of each counted (0 for a chunk of one token)."""
    valid = jnp.arange(chunks.shape[-1]) < sizes[..., None]
    low = jnp.min(jnp.where(valid, chunks, jnp.inf), axis=-1, keepdims=True)
    shifted = jnp.where(valid, chunks - jnp.minimum(low, 0.0), 0.0)
    p = shifted / (jnp.sum(shifted, axis=-1, keepdims=True) + _EPS)
    h = -jnp.sum(jnp.where(valid, p * jnp.log(p + _EPS), 0.0), axis=-1)
    norm = jnp.log(jnp.maximum(sizes, 2).astype(jnp.float32))
    return jnp.where(sizes > 1, jnp.clip(h / norm, 0.0, 1.0), 0.0)


def gated_row_keep(scores, count, share, chunk_length: int, low_length: int) -> jax.Array:
    """bool [S]: one row's kept slots for token scores f32 [S] of which the first `count`
    are held (module docstring)."""
    c, s = chunk_length, scores.shape[0]
    padded = pad_slots(scores, c, 0, 0.0).reshape(-1, c)  # [C, c]
    starts = jnp.arange(padded.shape[0]) * c
    sizes = jnp.clip(count - starts, 0, c)
    real = sizes > 0
    valid = jnp.arange(c) < sizes[:, None]
    means = jnp.sum(jnp.where(valid, padded, 0.0), -1) / jnp.maximum(sizes, 1)
    entropy = chunk_entropy(padded, sizes)
    gated = (means >= lower_median(means, real)) & (entropy < lower_median(entropy, real))
    ranks = rank_descending(jnp.where(valid, padded, -jnp.inf))  # within each chunk

    def take_chunk(carry, chunk):
        budget, keep = carry
        n = jnp.minimum(sizes[chunk], budget)
        n = jnp.where(gated[chunk], jnp.minimum(n, low_length), n)
        taken = (ranks[chunk] < n) & valid[chunk]
        keep = jax.lax.dynamic_update_slice(keep, taken, (chunk * c,))
        return (budget - n, keep), None

    order = jnp.argsort(jnp.where(real, -means, jnp.inf), stable=True)
    budget = share_of(count, share)
    carry = collectives.varying_like((budget, jnp.zeros(padded.size, bool)), scores, ranks)
    (budget, keep), _ = jax.lax.scan(take_chunk, carry, order)
    keep, held = keep[:s], jnp.arange(s) < count
    leftover = rank_descending(jnp.where(held & ~keep, scores, -jnp.inf)) < budget
    return keep | (leftover & held & ~keep)


@dataclasses.dataclass(frozen=True)
class EntropyGatedChunkCompression(InnerScoredCompression):
    """EntropyGatedChunkKV's prompt compression of an inner `ScoredCompression`."""

    chunk_length: int
    low_entropy_length: int

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        scores, held, protected = self._inner_scores(kv, obs, model)
        share = kept_share(obs)

        def keep(scores, held, protected):  # over every KV head of a layer
            scores = protected_on_top(scores, held, protected)
            summed = jnp.sum(jnp.where(held, scores, 0.0), axis=2)  # [L, B, S]
            counts = jnp.max(jnp.sum(held, axis=-1, dtype=jnp.int32), axis=-1)  # [L, B]
            shares = jnp.broadcast_to(share, counts.shape)

            def row(scores, count, share):
                return gated_row_keep(
                    scores, count, share, self.chunk_length, self.low_entropy_length
                )

            kept = jax.vmap(jax.vmap(row))(summed, counts, shares)
            return kept[:, :, None, :] & held

        return compact(kv, collectives.over_all_heads(keep, scores, held, protected, axis=2))


@base.register
@dataclasses.dataclass(frozen=True)
class EntropyGatedChunkKV(base.Policy):
    """EntropyGatedChunkKVPress: ChunkKV whose spiky high-scoring chunks keep only their best
    tokens, the budget freed going to further chunks (module docstring).

    Attributes:
      budget: the share of the tokens each head keeps, in (0, 1].
      inner: the scoring eviction policy (or its name; SnapKV by default, as ChunkKV's).
      chunk_length: tokens per chunk (kvpress's default 10).
      low_entropy_length: tokens a gated chunk keeps (kvpress's default 4), under chunk_length.
    """

    name: ClassVar[str] = "entropy_chunkkv"
    request_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    budget: base.Budget | float | None = None
    inner: EvictionPolicy | str = "snapkv"
    chunk_length: int = 10
    low_entropy_length: int = 4

    def _check(self) -> None:
        super()._check()
        if self.budget is not None:
            object.__setattr__(self, "budget", ratio_budget(self.name, self.budget))
        if not 1 <= self.low_entropy_length < self.chunk_length:
            raise ValueError(
                f"low_entropy_length={self.low_entropy_length} must be in "
                f"[1, chunk_length={self.chunk_length})"
            )

    def _parts(self) -> dict:
        compression = scoring_compression(self.name, self.inner)
        share = None if self.budget is None else self.budget.ratio
        gated = EntropyGatedChunkCompression(
            compression, self.chunk_length, self.low_entropy_length
        )
        return {
            "prompt_compression": gated,
            # share_of(T) tokens per head: ChunkKV's rule with chunks of one token.
            "budget_rule": ChunkedBudget(self.name, share, 1, whole_chunks=True),
            "threshold_set": base.ThresholdSet(
                self.name, THRESHOLD_NAMES, None if share is None else (share,)
            ),
        }
