"""FINCH as NVIDIA kvpress 0.5.5's FinchPress implements it: the prompt is a context followed by
a question of `window` tokens; the question's queries score the context as SnapKV's window does,
each query's attention weighted by its position (kvpress's normalisation by the keys it sees),
without pooling; the question is always kept, and the kept keys are rotated to consecutive
positions (`rerotation`).

kvpress finds the question by a delimiter token it adds to the tokenizer; jaxkv takes its
length (`window`) instead, the same split without a new token. kvpress's optional
`chunk_length` (the top-k taken chunk by chunk) is not offered. Paper (docs/references.md):
"FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models" (TACL 2024).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, LayerView, Scorer, group_mean
from jaxkv.policies.rerotation import RerotatedCompression


@dataclasses.dataclass(frozen=True)
class QuestionAttentionScores(Scorer):
    """FINCH's scores: the mean over the question's `window` queries of their attention to each
    context key (with `normalize`, each query's weighted by its position), averaged over the KV
    head's query group; the question's own keys score 0 (they are always kept)."""

    window: int
    normalize: bool

    @property
    def observation_window(self) -> int:
        return self.window

    def layer_scores(self, view: LayerView) -> jax.Array:
        probs = view.window_probabilities()  # [B, N, w, S]
        if self.normalize:
            weights = jnp.maximum(view.query_positions, 0).astype(jnp.float32)  # [B, w]
            probs = probs * weights[:, None, :, None]
        mean = probs.sum(axis=2) / self.window  # [B, N, S]
        context = view.held & (view.positions < view.prompt_lengths[:, None, None] - self.window)
        group = mean.shape[1] // view.positions.shape[1]
        mean = jnp.where(jnp.repeat(context, group, axis=1), mean, 0.0)
        return group_mean(mean, view.keys.shape[1])


@base.register
@dataclasses.dataclass(frozen=True)
class Finch(EvictionPolicy):
    """FinchPress: the question's attention to the context, the question kept, the kept keys
    rerotated (module docstring).

    Attributes:
      window: the question's length in tokens (the prompt's last `window` tokens).
      normalize_scores: weight each question query's attention by its position (kvpress's
        default).
      rerotate_keys: rotate the kept keys to consecutive positions (kvpress's default).
    """

    name: ClassVar[str] = "finch"
    window: int = 64
    normalize_scores: bool = True
    rerotate_keys: bool = True

    def _check(self) -> None:
        super()._check()
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1 (the question's tokens)")

    def _scorer(self) -> QuestionAttentionScores:
        return QuestionAttentionScores(self.window, self.normalize_scores)

    def _parts(self) -> dict:
        parts = super()._parts()
        if self.rerotate_keys:
            parts["prompt_compression"] = RerotatedCompression(parts["prompt_compression"])
        return parts
