"""GVote: the budget comes from the request itself, by voting of sampled future queries.

After prefill, per layer and query head: the last query's attention fixes a step budget b (the
number of keys holding `nucleus` of its mass). Hidden states h ~ N(mu, sigma) are sampled from
per-channel statistics of the layer's attention input over the prompt, projected to queries and
rotated with cos/sin averaged over the next `future_positions` positions; each sampled query of
each query head votes for its top-b keys by logit; a KV head keeps the union of its group's
votes. Budgets differ per request, layer and head, and the pages they leave are freed.

Two choices differ from the paper's listing, both to follow the model: the sampled queries go
through the model's own projection (with its bias and Qwen3's q-norm) and its own RoPE layout
(half-split, not interleaved).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import collectives
from jaxkv.cache import KVState
from jaxkv.cache.eviction import compact, rank_descending
from jaxkv.policies import base
from jaxkv.policies.eviction import LayerView, map_layers
from jaxkv.step.parts import PrefillObservations


def nucleus_budget(probs: jax.Array, nucleus: float) -> jax.Array:
    """int32 [...]: how many of the largest probabilities [..., S] reach `nucleus` of the mass."""
    sorted_probs = jnp.sort(probs, axis=-1)[..., ::-1]
    return jnp.sum(jnp.cumsum(sorted_probs, axis=-1) < nucleus, axis=-1) + 1


def vote(queries: jax.Array, keys: jax.Array, held: jax.Array, step_budget: jax.Array):
    """bool [B, K, S]: each sampled query of each query head votes for its top-b keys by logit
    q . k (b = its head's step budget); a KV head keeps the union of its group's votes.

    queries [B, N, X, H] (X samples), keys [B, K, S, H], held bool [B, K, S], step_budget [B, N].
    """
    b, num_kv, s, h = keys.shape
    num_samples = queries.shape[2]
    group = queries.shape[1] // num_kv
    qg = queries.reshape(b, num_kv, group, num_samples, h)
    logits = jnp.einsum("bkgxh,bksh->bkgxs", qg, keys, preferred_element_type=jnp.float32)
    logits = jnp.where(held[:, :, None, None, :], logits, -jnp.inf)
    votes = rank_descending(logits) < step_budget.reshape(b, num_kv, group)[..., None, None]
    return jnp.any(votes, axis=(2, 3)) & held


def sample_hidden_states(key, mean, var, num_samples: int) -> jax.Array:
    """[B, S, D] draws of N(mean, var) with mean, var [B, D]; row b's noise is drawn with
    `fold_in(key, b)` (b: the row in the whole request, so a mesh draws the same samples)."""

    def row_noise(row):
        shape = (num_samples, mean.shape[1])
        return jax.random.normal(jax.random.fold_in(key, row), shape, jnp.float32)

    noise = jax.vmap(row_noise)(collectives.global_rows(mean.shape[0]))
    return mean[:, None] + jnp.sqrt(var)[:, None] * noise


@dataclasses.dataclass(frozen=True)
class VoteCompression(base.PromptCompressionPart):
    """GVote's prompt compression part: in each layer, queries from sampled future hidden
    states vote for the keys of their nucleus, and each head keeps the union of its votes.

    Attributes: as `GVote`'s.
    """

    nucleus: float
    num_samples: int
    future_positions: int

    observation_window: ClassVar[int] = 1
    needs_input_stats: ClassVar[bool] = True

    def compress(self, kv: KVState, obs: PrefillObservations, model) -> KVState:
        keep = map_layers(kv, obs, model, lambda view: self._votes(view, model.config))
        return compact(kv, keep)

    def _votes(self, view: LayerView, cfg) -> jax.Array:
        """bool [B, K, S]: the union of the votes of one layer."""
        # models builds on jaxkv, so it is imported here rather than at module load.
        from jaxkv.models.decoder import project_queries
        from jaxkv.models.layers import rope_cos_sin

        step_budget = nucleus_budget(view.window_probabilities()[:, :, 0], self.nucleus)  # [B, N]
        hidden = sample_hidden_states(view.key, view.input_mean, view.input_var, self.num_samples)
        future = view.prompt_lengths[:, None] + jnp.arange(self.future_positions)
        cos, sin = rope_cos_sin(cfg, future)
        cos = jnp.broadcast_to(cos.mean(axis=1, keepdims=True), (*hidden.shape[:2], cos.shape[-1]))
        sin = jnp.broadcast_to(sin.mean(axis=1, keepdims=True), cos.shape)
        hidden = hidden.astype(view.keys.dtype)
        queries = project_queries(view.params, cfg, hidden, cos, sin)  # [B, N, S_samples, H]
        return vote(queries, view.keys, view.held, step_budget)


@dataclasses.dataclass(frozen=True)
class VotedBudget:
    """GVote's budget part: none to set, the votes decide how much each head keeps, so every
    prompt's budget is the prompt and a plan can only assume the whole prompt."""

    columns: ClassVar[tuple[str, ...]] = ()

    def tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        return np.asarray(prompt_lengths, np.int32)

    def ratio(self, batch: int) -> np.ndarray:
        return np.zeros((batch,), np.float32)

    def planned(self, budget_tokens, prompt_lengths):
        del budget_tokens
        return np.asarray(prompt_lengths), "data-dependent: planned at the whole prompt"


@base.register
@dataclasses.dataclass(frozen=True)
class GVote(base.Policy):
    """Adaptive-budget eviction by Gaussian-sampled query voting (no budget to set): the record
    of a `VoteCompression`.

    Attributes:
      nucleus: attention mass the step budget covers (p_nuc).
      num_samples: sampled future hidden states S.
      future_positions: n_f positions after the prompt whose RoPE is averaged.
    """

    name: ClassVar[str] = "gvote"
    nucleus: float = 0.95
    num_samples: int = 8
    future_positions: int = 16

    def _check(self) -> None:
        super()._check()
        if not 0.0 < self.nucleus <= 1.0:
            raise ValueError(f"nucleus={self.nucleus} must be in (0, 1]")
        if self.num_samples < 1:
            raise ValueError(f"num_samples={self.num_samples} must be >= 1")
        if self.future_positions < 1:
            raise ValueError(f"future_positions={self.future_positions} must be >= 1")

    def _parts(self) -> dict:
        return {
            "prompt_compression": VoteCompression(
                self.nucleus, self.num_samples, self.future_positions
            ),
            "budget_rule": VotedBudget(),
        }
