"""Presses that change how a scorer's ranking becomes a kept set, with the semantics of NVIDIA
kvpress 0.5.5's ChunkKVPress, ChunkPress and BlockPress. Each wraps a scoring eviction policy
(`inner`: its registered name or the policy) and keeps what it chooses in the paged cache.

  chunkkv  the inner scores, summed over a layer's KV heads and averaged over chunks of
           `chunk_length` tokens, choose whole chunks, the same for every head: the share
           `budget` of the chunks (at least one);
  chunk    each chunk of `chunk_length` tokens is scored on its own and keeps `budget` of its
           tokens (at least one) per head: the kept tokens spread evenly over the prompt;
  block    the prompt is read in blocks of `block_size` tokens after the first budget-many:
           each block with the tokens kept so far is scored on its own and the best budget-many
           kept (KeyDiff's block-wise compression, over a prefill already done).

ChunkKV's scores are the inner compression's, its protected tokens (sinks, observation window)
scoring one above the row's best, as kvpress pads them. `chunk` and `block` score runs of the
cache, so their inner scorer reads the cache alone (`Scorer.cache_only`: Knorm, KeyDiff, LagKV,
CUR, Random). Papers (docs/references.md): ChunkKV "ChunkKV: Semantic-Preserving KV Cache
Compression for Efficient Long-Context LLM Inference" (arXiv:2502.00299); FINCH "FINCH: Prompt-
guided Key-Value Cache Compression" (TACL 2024), whose chunked compression ChunkPress follows;
KeyDiff (arXiv:2504.15364) for the blocks.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, keep_top_per_head
from jaxkv.policies import base
from jaxkv.policies.eviction import (
    EvictionPolicy,
    InnerScoredCompression,
    LayerView,
    ScoredCompression,
    Scorer,
    map_layers,
    protected_on_top,
)
from jaxkv.step.parts import PrefillObservations

THRESHOLD_NAMES = ("ratio",)  # the budget's share, which each chunk applies in jit


def kept_share(obs: PrefillObservations) -> jax.Array:
    """f32 [B]: the share of the tokens (or chunks) kept, from the policy's thresholds."""
    return obs.thresholds[:, THRESHOLD_NAMES.index("ratio")]


def share_of(count, share) -> jax.Array | np.ndarray:
    """max(1, floor(count * share)) in float32, on the host and in jit alike (so a plan on the
    host and a keep-mask in jit agree); 0 for an empty count."""
    product = np.float32(count) * np.float32(share) if isinstance(count, np.ndarray) else None
    if product is not None:
        return np.where(count > 0, np.maximum(1, np.floor(product)), 0).astype(np.int32)
    kept = jnp.maximum(1, jnp.floor(count.astype(jnp.float32) * share))
    return jnp.where(count > 0, kept, 0).astype(jnp.int32)


def layer_share_of(lengths, share, protected: int) -> jax.Array | np.ndarray:
    """`share_of` the prompt lengths, or the whole prompt where that is fewer than the tokens
    every head protects (as `base.keep_short_prompts_whole`); on the host and in jit alike."""
    tokens = share_of(lengths, share)
    where = np.where if isinstance(tokens, np.ndarray) else jnp.where
    return where(tokens < protected, lengths, tokens).astype(tokens.dtype)


@dataclasses.dataclass(frozen=True)
class SpreadShareBudget:
    """The budget part of a policy that keeps a share of all its KV pairs but lets its data (a
    layer's composite scores, a profiled curve) spread it over layers and heads: `share_of`
    each prompt per head on average; one head may keep its whole prompt, so the pool plans the
    whole prompt.

    Attributes:
      owner: the policy's name, for errors.
      share: the share kept, in (0, 1] (static: it compiles into the compression).
    """

    owner: str
    share: float | None

    columns: ClassVar[tuple[str, ...]] = ()

    def tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        if self.share is None:
            raise ValueError(f"policy {self.owner!r} needs ratio= in (0, 1]")
        return share_of(np.asarray(prompt_lengths, np.int64), self.share)

    def ratio(self, batch: int) -> np.ndarray:
        return np.zeros((batch,), np.float32)

    def planned(self, budget_tokens, prompt_lengths) -> tuple[np.ndarray, str]:
        del budget_tokens
        return np.asarray(prompt_lengths), "spread by the data: planned at the whole prompt"


def chunked_counts(prompt_lengths, chunk_length: int):
    """(whole chunks, tokens in the partial last one) of each prompt."""
    return prompt_lengths // chunk_length, prompt_lengths % chunk_length


def pad_slots(x: jax.Array, multiple: int, axis: int, value) -> jax.Array:
    """`x` padded with `value` along `axis` to a multiple of `multiple`."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -x.shape[axis] % multiple)
    return jnp.pad(x, pad, constant_values=value)


@dataclasses.dataclass(frozen=True)
class ChunkedBudget:
    """The budget part of `chunkkv` and `chunk`: the tokens a head keeps at most for a kept
    share of chunks (`whole_chunks`) or of each chunk's tokens; the share travels to jit as the
    threshold `ratio`.

    Attributes:
      owner: the policy's name, for errors.
      share: the share kept, in (0, 1]; None in the copy jit sees.
      chunk_length: tokens per chunk.
      whole_chunks: ChunkKV's rule (a share of the chunks) instead of ChunkPress's.
    """

    owner: str
    share: float | None
    chunk_length: int
    whole_chunks: bool

    columns: ClassVar[tuple[str, ...]] = ()

    def tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        if self.share is None:
            raise ValueError(f"policy {self.owner!r} needs budget= (a ratio in (0, 1])")
        lengths = np.asarray(prompt_lengths, np.int64)
        whole, rest = chunked_counts(lengths, self.chunk_length)
        if self.whole_chunks:
            chunks = share_of(whole + (rest > 0), self.share)
            kept = np.minimum(chunks * self.chunk_length, lengths)
            return np.where(whole == 0, share_of(lengths, self.share), kept).astype(np.int32)
        per_chunk = share_of(np.full_like(lengths, self.chunk_length), self.share)
        return (whole * per_chunk + share_of(rest, self.share)).astype(np.int32)

    def ratio(self, batch: int) -> np.ndarray:
        return np.zeros((batch,), np.float32)

    def planned(self, budget_tokens, prompt_lengths) -> tuple[np.ndarray, str]:
        return base.within_budget(budget_tokens, prompt_lengths)


@dataclasses.dataclass(frozen=True)
class ChunkKVCompression(InnerScoredCompression):
    """ChunkKV's prompt compression of an inner `ScoredCompression` (module docstring)."""

    chunk_length: int

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        scores, held, protected = self._inner_scores(kv, obs, model)
        share = kept_share(obs)

        def keep(scores, held, protected):  # over every KV head of a layer
            return self._keep(scores, held, protected, share)

        return compact(kv, collectives.over_all_heads(keep, scores, held, protected, axis=2))

    def _keep(self, scores, held, protected, share) -> jax.Array:
        """bool [L, B, K, S]: the kept slots, the protected ones scoring the row's best + 1."""
        scores = protected_on_top(scores, held, protected)
        counts = jnp.max(jnp.sum(held, axis=-1, dtype=jnp.int32), axis=-1)  # [L, B]
        chunks = self._chunks_kept(scores, held, counts, share)
        # A prompt shorter than a chunk: the inner's top share per head (kvpress delegates).
        budgets = jnp.broadcast_to(share_of(counts, share)[..., None], held.shape[:3])
        single = keep_top_per_head(scores, budgets, held, jnp.zeros_like(held))
        whole, _ = chunked_counts(counts, self.chunk_length)
        return jnp.where((whole == 0)[..., None, None], single, chunks)

    def _chunks_kept(self, scores, held, counts, share) -> jax.Array:
        """bool [L, B, K, S]: the slots of the best share of chunks (head-summed mean scores)."""
        c = self.chunk_length
        s = scores.shape[-1]
        summed = jnp.sum(jnp.where(held, scores, 0.0), axis=2)  # [L, B, S]
        sums = pad_slots(summed, c, -1, 0.0).reshape(*summed.shape[:2], -1, c).sum(-1)
        whole, rest = chunked_counts(counts, c)
        index = jnp.arange(sums.shape[-1])
        sizes = jnp.where(index < whole[..., None], c, 0)
        sizes = jnp.where(index == whole[..., None], rest[..., None], sizes)
        chunk_scores = jnp.where(sizes > 0, sums / jnp.maximum(sizes, 1), -jnp.inf)
        order = jnp.argsort(-chunk_scores, axis=-1, stable=True)
        ranks = jnp.argsort(order, axis=-1)
        kept_chunks = share_of(whole + (rest > 0), share[None])
        chunk_kept = ranks < kept_chunks[..., None]  # [L, B, C]
        slot_kept = jnp.repeat(chunk_kept, c, axis=-1)[..., :s]
        return slot_kept[:, :, None, :] & held


@dataclasses.dataclass(frozen=True)
class ChunkCompression(base.PromptCompressionPart):
    """ChunkPress's prompt compression: each chunk of `chunk_length` slots scored alone by a
    cache-only scorer, keeping its share (at least one) per head."""

    scorer: Scorer
    chunk_length: int

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        c = self.chunk_length
        share = kept_share(obs)

        def layer_keep(view: LayerView) -> jax.Array:
            chunks = chunked_view(view, c)
            held = chunks.held  # [B * C, K, c]
            count = jnp.sum(held, axis=-1, dtype=jnp.int32)
            budget = share_of(count, jnp.repeat(share, held.shape[0] // share.shape[0])[:, None])
            keep = keep_top_per_head(
                self.scorer.layer_scores(chunks), budget, held, jnp.zeros_like(held)
            )
            return unchunked(keep, view.positions.shape)

        return compact(kv, map_layers(kv, obs, model, layer_keep, values=self.scorer.reads_values))


def chunked_view(view: LayerView, c: int) -> LayerView:
    """The view's slots in runs of `c` as rows of their own ([B, K, S] -> [B * ceil(S/c), K, c]),
    for a cache-only scorer."""

    def split(x, fill):
        x = pad_slots(x, c, 2, fill)
        b, k, s = x.shape[:3]
        x = x.reshape(b, k, s // c, c, *x.shape[3:])
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(b * (s // c), k, c, *x.shape[4:])

    chunks = -(-view.positions.shape[-1] // c)
    return view.replace(
        keys=split(view.keys, 0),
        values=None if view.values is None else split(view.values, 0),
        positions=split(view.positions, -1),
        token_scores=split(view.token_scores, 0.0),
        prompt_lengths=jnp.repeat(view.prompt_lengths, chunks),
    )


def unchunked(x: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
    """`chunked_view`'s inverse for a [B * C, K, c] array: [B, K, S]."""
    b, k, s = shape
    chunks, c = x.shape[0] // b, x.shape[-1]
    x = jnp.moveaxis(x.reshape(b, chunks, k, c), 1, 2)
    return x.reshape(b, k, chunks * c)[..., :s]


@dataclasses.dataclass(frozen=True)
class BlockCompression(base.PromptCompressionPart):
    """BlockPress's prompt compression: a head's first budget-many slots are kept, then each
    block of `block_size` slots is scored with the kept ones (kept first, in the order they were
    ranked, then the block) by a cache-only scorer, the best budget-many kept."""

    scorer: Scorer
    block_size: int

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        def layer_keep(view: LayerView) -> jax.Array:
            return self._layer_keep(view, obs.budget_tokens)

        return compact(kv, map_layers(kv, obs, model, layer_keep, values=self.scorer.reads_values))

    def _layer_keep(self, view: LayerView, budget_tokens: jax.Array) -> jax.Array:
        s = view.positions.shape[-1]
        slots = jnp.arange(s, dtype=jnp.int32)
        counts = jnp.sum(view.held, axis=-1, dtype=jnp.int32)[..., None]  # [B, K, 1]
        budget = jnp.minimum(budget_tokens[:, None, None], counts)

        def gather(x, index):
            return None if x is None else jnp.take_along_axis(x, index[..., None], 2)

        def one_block(block, kept):
            start = budget + block * self.block_size
            size = jnp.clip(counts - start, 0, self.block_size)
            candidates = jnp.where(slots < budget, kept, start + slots - budget)
            valid = slots < budget + size
            candidates = jnp.where(valid, candidates, 0)
            scored = view.replace(
                keys=gather(view.keys, candidates),
                values=gather(view.values, candidates),
                positions=jnp.where(valid, jnp.take_along_axis(view.positions, candidates, 2), -1),
                token_scores=jnp.take_along_axis(view.token_scores, candidates, 2),
            )
            scores = jnp.where(valid, self.scorer.layer_scores(scored), -jnp.inf)
            order = jnp.argsort(-scores, axis=-1, stable=True)
            ranked = jnp.take_along_axis(candidates, order, -1)
            return jnp.where(size > 0, ranked, kept)

        blocks = -(-s // self.block_size)
        first = collectives.varying_like(jnp.broadcast_to(slots, view.positions.shape), counts)
        kept = jax.lax.fori_loop(0, blocks, one_block, first)
        mask = jnp.zeros(kept.shape, bool)
        rows = jnp.arange(kept.shape[0])[:, None, None]
        heads = jnp.arange(kept.shape[1])[None, :, None]
        return mask.at[rows, heads, jnp.where(slots < budget, kept, s)].set(True, mode="drop")


def scoring_compression(owner: str, inner: EvictionPolicy | str) -> ScoredCompression:
    """The inner policy's `ScoredCompression` (refused for any other kind of policy), its scorer
    as a wrapper reads it (`Scorer.scores_only`: PyramidKV's scores without its layer budgets,
    as kvpress's wrapping presses read their inner press)."""
    policy = base.get(inner) if isinstance(inner, str) else inner
    compression = getattr(policy, "prompt_compression", None)
    if not isinstance(policy, EvictionPolicy) or type(compression) is not ScoredCompression:
        raise ValueError(
            f"policy {owner!r}: inner={inner!r} must be a scoring eviction policy (its prompt "
            "compression a ScoredCompression: knorm, keydiff, lagkv, cur, random, snapkv, ...)"
        )
    return dataclasses.replace(compression, scorer=compression.scorer.scores_only())


def cache_only_scorer(owner: str, inner: EvictionPolicy | str) -> Scorer:
    """The inner policy's scorer, refused unless it reads the cache alone."""
    scorer = scoring_compression(owner, inner).scorer
    if not scorer.cache_only:
        raise ValueError(
            f"policy {owner!r}: inner={inner!r} scores from queries or attention; {owner} scores "
            "runs of the cache alone, so inner must be cache-only (knorm, keydiff, lagkv, cur, "
            "random)"
        )
    return scorer


def ratio_budget(owner: str, value) -> base.Budget:
    """`value` as the budget of a policy that keeps a share (a ratio), never a token count."""
    parsed = base.Budget.parse(value)
    if parsed.ratio is None:
        raise ValueError(
            f"policy {owner!r} keeps a share: give budget= as a ratio in (0, 1], not a token "
            f"count (got {value!r})"
        )
    return parsed


@dataclasses.dataclass(frozen=True)
class _ChunkedPolicy(base.Policy):
    """The settings `chunkkv` and `chunk` share: a ratio budget, an inner policy, a chunk."""

    request_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    budget: base.Budget | float | None = None
    inner: EvictionPolicy | str = "keydiff"
    chunk_length: int = 20

    def _check(self) -> None:
        super()._check()
        if self.budget is not None:
            object.__setattr__(self, "budget", ratio_budget(self.name, self.budget))
        if self.chunk_length < 1:
            raise ValueError(f"chunk_length={self.chunk_length} must be >= 1")

    def _budget_parts(self, whole_chunks: bool) -> dict:
        share = None if self.budget is None else self.budget.ratio
        return {
            "budget_rule": ChunkedBudget(self.name, share, self.chunk_length, whole_chunks),
            "threshold_set": base.ThresholdSet(
                self.name, THRESHOLD_NAMES, None if share is None else (share,)
            ),
        }


@base.register
@dataclasses.dataclass(frozen=True)
class ChunkKV(_ChunkedPolicy):
    """ChunkKV: whole chunks of `chunk_length` tokens kept by their inner scores, the same
    chunks for every head of a layer (module docstring). `budget` is the share of the chunks.

    Attributes:
      inner: the scoring eviction policy (or its name) whose scores rank the chunks (SnapKV's
        by default, as the paper's).
      chunk_length: tokens per chunk (kvpress's default 20).
    """

    name: ClassVar[str] = "chunkkv"
    inner: EvictionPolicy | str = "snapkv"  # the paper's attention scores

    def _parts(self) -> dict:
        compression = scoring_compression(self.name, self.inner)
        return {
            "prompt_compression": ChunkKVCompression(compression, self.chunk_length),
            **self._budget_parts(whole_chunks=True),
        }


@base.register
@dataclasses.dataclass(frozen=True)
class Chunk(_ChunkedPolicy):
    """ChunkPress: each chunk of `chunk_length` tokens compressed on its own to `budget` of its
    tokens by a cache-only inner scorer (module docstring).

    Attributes:
      inner: the cache-only scoring policy (or its name; KeyDiff by default).
      chunk_length: tokens per chunk (kvpress's default 1024).
    """

    name: ClassVar[str] = "chunk"
    chunk_length: int = 1024

    def _parts(self) -> dict:
        scorer = cache_only_scorer(self.name, self.inner)
        return {
            "prompt_compression": ChunkCompression(scorer, self.chunk_length),
            **self._budget_parts(whole_chunks=False),
        }


@base.register
@dataclasses.dataclass(frozen=True)
class Block(base.Policy):
    """BlockPress: the prompt compressed block by block, as if prefilled in blocks of
    `block_size` tokens with the cache cut back to the budget after each (module docstring).

    Attributes:
      budget: tokens kept per head: a ratio of the prompt or a token count.
      inner: the cache-only scoring policy (or its name; KeyDiff by default, as its paper).
      block_size: tokens per block (kvpress's default 128).
    """

    name: ClassVar[str] = "block"
    request_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    budget: base.Budget | float | int | None = None
    inner: EvictionPolicy | str = "keydiff"
    block_size: int = 128

    def _check(self) -> None:
        super()._check()
        if self.budget is not None:
            object.__setattr__(self, "budget", base.Budget.parse(self.budget))
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")

    def _parts(self) -> dict:
        scorer = cache_only_scorer(self.name, self.inner)
        return {
            "prompt_compression": BlockCompression(scorer, self.block_size),
            "budget_rule": base.PromptBudget(self.name, self.budget),
        }
