"""Non-causal chunked attention as NVIDIA kvpress 0.5.5's NonCausalAttnPress implements it (the
attention half of Compactor): each token is scored by the attention it receives from every
query of its block of `block_size` prompt positions, the block attending without a causal mask.

Per query head, inside each block the logits are q . k unscaled (no 1/sqrt(d)) and softmaxed
over the block's keys; a token's score is the sum over the block's queries of the probability
it gets, averaged over the KV head's query heads, times its value's norm, then averaged with
its two neighbours (a width-3 mean over positions, zeros past the ends, as kvpress's
avg_pool1d). kvpress pads the prompt to whole blocks and its padding leaks into the last block:
a padded key's logit is -1e-9 (not -inf: valid queries give it weight), and a padded query's
logits are 0 over the block's valid keys (it gives each of them 1/block_size). jaxkv does the
same, so that the ranking is kvpress's. (kvpress's z-normalisation over each layer does not
change the ranking within a head, so it is left out.)

The block sums are computed as the prompt is written (the policy's gate part, from the
chunk's queries, keys and values) and stored with each token; blocks start at each prefill
chunk's first position, so a prompt longer than its chunk needs a chunk of whole blocks
(`check_prefill`). Tokens read later (a session's questions, decode steps) score their own
blocks; only the prompt's scores rank. Paper (docs/references.md): Compactor (arXiv:2507.08143).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, LayerView, Scorer

_PADDED_KEY_LOGIT = -1e-9  # kvpress's fill for a padded key (not a mask)
DEFAULT_BLOCK = 256


def _softmax_with_padding(logits: jax.Array, padding: int) -> jax.Array:
    """softmax over the last axis as if `padding` (static) more keys of logit -1e-9 stood
    there, without them: kvpress's padded keys past the chunk's own."""
    if padding:
        extra = jnp.full(logits.shape[:-1] + (1,), _PADDED_KEY_LOGIT + np.log(padding))
        return jax.nn.softmax(jnp.concatenate([logits, extra], axis=-1), axis=-1)[..., :-1]
    return jax.nn.softmax(logits, axis=-1)


def block_attention_sums(q: jax.Array, k: jax.Array, valid: jax.Array, block: int) -> jax.Array:
    """f32 [B, N, C]: per query head, the probability each position gets summed over the
    queries of its block (module docstring). q [B, N, C, H], k [B, K, C, H] after RoPE; valid
    bool [B, C]. A chunk shorter than a block (a decode step, a short prompt) is one block whose
    padding past the chunk is accounted for, not formed: a decode step costs [1 x 1] logits."""
    b, n, c, h = q.shape
    group = n // k.shape[1]
    width = min(block, c)
    padded = -(-c // width) * width
    virtual = block - width  # kvpress's padding past a chunk shorter than a block
    along_positions = ((0, 0), (0, 0), (0, padded - c), (0, 0))
    q = jnp.pad(q.astype(jnp.float32), along_positions)
    k = jnp.pad(jnp.repeat(k.astype(jnp.float32), group, axis=1), along_positions)
    valid = jnp.pad(valid, ((0, 0), (0, padded - c)))
    blocks = padded // width
    q = q.reshape(b, n, blocks, width, h)
    k = k.reshape(b, n, blocks, width, h)
    valid = valid.reshape(b, 1, blocks, width)
    logits = jnp.einsum("bnjqh,bnjkh->bnjqk", q, k, precision="highest")
    logits = jnp.where(valid[..., :, None], logits, 0.0)  # padded queries: 0 everywhere
    logits = jnp.where(valid[..., None, :], logits, _PADDED_KEY_LOGIT)
    received = jnp.sum(_softmax_with_padding(logits, virtual), axis=-2)  # [B, N, blocks, width]
    if virtual:  # each padded query past the chunk gives what a padded query row does
        padded_row = jnp.where(valid, 0.0, _PADDED_KEY_LOGIT)  # [B, 1, blocks, width]
        received = received + virtual * _softmax_with_padding(padded_row, virtual)
    return received.reshape(b, n, padded)[..., :c]


@dataclasses.dataclass(frozen=True)
class BlockAttentionGate:
    """The gate part: each written token's block attention sum (group mean) times its value
    norm, stored with it (module docstring)."""

    block: int

    def write_scores(self, layer_params, *, h, q, k_unrotated, k, v, positions):
        del layer_params, h, k_unrotated
        num_kv = k.shape[1]
        sums = block_attention_sums(q, k, positions >= 0, self.block)  # [B, N, C]
        b, n, c = sums.shape
        per_kv_head = sums.reshape(b, num_kv, n // num_kv, c).mean(axis=2)
        return per_kv_head * jnp.linalg.norm(v.astype(jnp.float32), axis=-1)


@dataclasses.dataclass(frozen=True)
class NeighbourMeanScores(Scorer):
    """The stored scores averaged with their two neighbours' (slots in position order, zeros
    past the held ones: kvpress's avg_pool1d of width 3)."""

    def layer_scores(self, view: LayerView) -> jax.Array:
        stored = jnp.where(view.held, view.token_scores, 0.0)
        padded = jnp.pad(stored, ((0, 0), (0, 0), (1, 1)))
        return (padded[..., :-2] + padded[..., 1:-1] + padded[..., 2:]) / 3.0


@base.register
@dataclasses.dataclass(frozen=True)
class NonCausalAttention(EvictionPolicy):
    """NonCausalAttnPress: each head keeps its tokens of most non-causal block attention times
    value norm, neighbour-averaged (module docstring).

    Attributes:
      block_size: positions per block (kvpress's chunk_size, 256).
    """

    name: ClassVar[str] = "noncausal_attention"
    block_size: int = DEFAULT_BLOCK

    def _check(self) -> None:
        super()._check()
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(f"block_size={self.block_size!r} must be an integer >= 1")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")

    def _scorer(self) -> NeighbourMeanScores:
        return NeighbourMeanScores()

    def _parts(self) -> dict:
        return super()._parts() | {"gate": BlockAttentionGate(self.block_size)}

    def check_prefill(self, prompt_lengths: np.ndarray, chunk: int) -> None:
        longest = int(np.max(prompt_lengths, initial=0))
        if longest > chunk and chunk % self.block_size:
            raise ValueError(
                f"prefill_chunk={chunk} must be a multiple of block_size={self.block_size} for "
                f"prompts longer than one chunk (the longest has {longest} tokens): the blocks "
                "start at each chunk's first position"
            )
