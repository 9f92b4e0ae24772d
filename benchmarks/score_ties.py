"""Ties at a scoring policy's cut: per layer and KV head, the prompt tokens whose score is
within a relative tolerance of the lowest score the head keeps, and how many of them it keeps.

Where a head holds more such tokens than it keeps, which of them stay is decided by the sort's
tie-break (or by float rounding), which jaxkv (XLA) and kvpress (`torch.topk`) resolve
differently: a kept set that differs from kvpress's there is no difference of the algorithm.
`jaxkv bench ruler --kept TASK:INDEX` reports it for every policy that ranks tokens with a
`Scorer` (the score-and-evict policies: `ScoredCompression`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

import jaxkv
from jaxkv.policies.eviction import (
    InnerScorer,
    LayerView,
    ScoredCompression,
    protected_slots,
)

# Scores this close to the cut, relative to it, are ties (float32 sums in different orders).
TIE_TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class RecordingScorer(InnerScorer):
    """`inner`'s scores, each layer's also handed to `record(layer, scores [B, K, S],
    positions [B, K, S])` on the host as it is computed."""

    record: Callable = dataclasses.field(compare=False, hash=False)

    def layer_scores(self, view: LayerView) -> jax.Array:
        scores = self.inner.layer_scores(view)
        jax.debug.callback(self.record, view.layer, scores, view.positions, ordered=True)
        return scores


def recording(policy, record: Callable):
    """`policy` with its scorer's scores handed to `record` (`RecordingScorer`), or None for
    a policy whose prompt compression ranks tokens otherwise."""
    compression = policy.prompt_compression
    if not isinstance(compression, ScoredCompression):
        return None
    wrapped = dataclasses.replace(compression, scorer=RecordingScorer(compression.scorer, record))

    class Recording(type(policy)):
        def _parts(self):
            return {**super()._parts(), "prompt_compression": wrapped}

    settings = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init}
    return Recording(**settings)


def ties_at_cut(model, policy, params, prompt: list[int]) -> list[dict] | None:
    """The heads of `policy` compressing `prompt` whose cut is decided among ties: per such
    (layer, head), the score at the cut, the ranked tokens within `TIE_TOLERANCE` of it
    (relative) and how many of those it keeps, and the ranked tokens scoring exactly 0; None
    for a policy without a `Scorer`."""
    layers: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def record(layer, scores, positions):
        layers[int(layer)] = (np.asarray(scores)[0], np.asarray(positions)[0])

    recorder = recording(policy, record)
    if recorder is None:
        return None
    state = jaxkv.compress_prompt(model, [prompt], recorder, policy_params=params)
    kept = np.asarray(state.positions())[:, 0]  # [L, K, S] after compression
    lengths = np.array([len(prompt)])
    found = []
    for layer, (scores, positions) in sorted(layers.items()):
        protected = protected_slots(policy.prompt_compression, positions[None], lengths)[0]
        for head in range(scores.shape[0]):
            row = head_ties(scores[head], positions[head], kept[layer, head], protected[head])
            if row is not None:
                found.append({"layer": layer, "head": head, **row})
    return found


def head_ties(scores, positions, kept_positions, protected) -> dict | None:
    """One head's tie at its cut (`ties_at_cut`), or None where the cut is no tie: scores and
    positions [S] before compression, kept_positions [S] after (-1 padded), protected bool [S]
    the slots kept whatever their scores (`protected_slots`), so not ranked."""
    ranked = (positions >= 0) & ~protected & np.isfinite(scores)
    kept = ranked & np.isin(positions, kept_positions[kept_positions >= 0])
    if not kept.any() or kept.sum() == ranked.sum():
        return None
    cut = float(scores[kept].min())
    tied = ranked & np.isclose(scores, cut, rtol=TIE_TOLERANCE, atol=0.0)
    if tied.sum() <= (tied & kept).sum():
        return None
    return {
        "cut": cut,
        "tied": int(tied.sum()),
        "tied_kept": int((tied & kept).sum()),
        "zeros": int((ranked & (scores == 0)).sum()),
        "ranked": int(ranked.sum()),
    }
