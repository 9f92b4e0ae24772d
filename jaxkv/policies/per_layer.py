"""kvpress 0.5.5's PerLayerCompressionPress: an inner scoring eviction policy that keeps a share
of the prompt of its own in each layer (`per_layer:0.7,0.3:inner=keydiff`), instead of one
share for every layer. Each head of layer l keeps floor(shares[l] x T) of its T prompt tokens
past the inner policy's protected ones (`structure.layer_share_of`); the pool plans the mean
over the layers.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.policies import base
from jaxkv.policies.eviction import EvictionPolicy, InnerScorer
from jaxkv.policies.structure import layer_share_of, scoring_compression


@dataclasses.dataclass(frozen=True)
class PerLayerScores(InnerScorer):
    """An inner scorer's scores with a share of the prompt of its own per layer:
    floor(shares[l] x T) tokens per head in layer l (`layer_share_of`)."""

    shares: tuple[float, ...]
    protected: int

    def layer_budgets(self, obs, num_layers: int) -> jax.Array:
        del num_layers
        shares = jnp.asarray(self.shares, jnp.float32)[:, None]
        return layer_share_of(obs.prompt_lengths[None], shares, self.protected)


@dataclasses.dataclass(frozen=True)
class PerLayerBudget:
    """`per_layer`'s budget part: each head keeps `layer_share_of` tokens in its layer, so the
    pool plans their mean over the layers."""

    owner: str
    shares: tuple[float, ...]
    protected: int

    columns: ClassVar[tuple[str, ...]] = ()

    def tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        lengths = np.asarray(prompt_lengths, np.int64)
        per_layer = [layer_share_of(lengths, share, self.protected) for share in self.shares]
        return np.ceil(np.mean(per_layer, axis=0)).astype(np.int32)

    def ratio(self, batch: int) -> np.ndarray:
        return np.zeros((batch,), np.float32)

    def planned(self, budget_tokens, prompt_lengths) -> tuple[np.ndarray, str]:
        return base.within_budget(budget_tokens, prompt_lengths)


@base.register
@dataclasses.dataclass(frozen=True)
class PerLayer(base.Policy):
    """PerLayerCompressionPress: an inner scorer keeping its own share of the prompt in each
    layer (kvpress's `compression_ratios`, as shares kept: `budgets=0.7,0.3` for two layers).

    Attributes:
      budgets: the share of the prompt each layer keeps, one per layer, each in (0, 1].
      inner: the scoring eviction policy (or its name; Knorm by default).
    """

    name: ClassVar[str] = "per_layer"
    primary_knob: ClassVar[str] = "budgets"
    budgets: tuple[float, ...] = ()
    inner: EvictionPolicy | str = "knorm"

    def _check(self) -> None:
        super()._check()
        object.__setattr__(self, "budgets", tuple(float(b) for b in self.budgets))
        if not self.budgets or not all(0.0 < b <= 1.0 for b in self.budgets):
            raise ValueError(
                f"budgets={self.budgets}: give each layer's share of the prompt kept, in (0, 1] "
                "(budgets=0.7,0.3 for two layers)"
            )

    def _parts(self) -> dict:
        compression = scoring_compression(self.name, self.inner)
        protected = compression.sinks + compression.protected_recent
        scorer = PerLayerScores(compression.scorer, self.budgets, protected)
        return {
            "prompt_compression": dataclasses.replace(compression, scorer=scorer),
            "budget_rule": PerLayerBudget(self.name, self.budgets, protected),
        }

    def check_model(self, model_config) -> None:
        super().check_model(model_config)
        if len(self.budgets) != model_config.num_layers:
            raise ValueError(
                f"policy 'per_layer': budgets gives {len(self.budgets)} layers' shares, the model "
                f"has {model_config.num_layers} layers"
            )
