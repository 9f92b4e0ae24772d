"""Quest: query-aware page selection at read time (nothing is evicted).

Each page keeps per-channel bounds of its keys. At every decode step a page's score is, for the
best of the KV head's query heads, sum_d max(q_d * kmax_d, q_d * kmin_d): an upper bound of any
of its keys' logits. A head reads its top ceil(budget / page size) pages plus its partial last
page; the current token always attends to itself.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.eviction import rank_descending
from jaxkv.policies import base


def page_scores(q: jax.Array, key_min: jax.Array, key_max: jax.Array) -> jax.Array:
    """f32 [B, K, M]: Quest's bound per page for one query per head.

    q [B, N, H]; key_min, key_max [B, K, M, H] bounds of each page's keys.
    """
    b, n, h = q.shape
    num_kv_heads = key_min.shape[1]
    qg = q.reshape(b, num_kv_heads, n // num_kv_heads, 1, h).astype(jnp.float32)
    bound = jnp.maximum(qg * key_max[:, :, None], qg * key_min[:, :, None])  # [B, K, G, M, H]
    return jnp.max(jnp.sum(bound, axis=-1), axis=2)


@dataclasses.dataclass(frozen=True)
class PageBoundSelection:
    """Quest's selection part: each head reads its pages of highest bound (`page_scores`) within
    the read budget, plus its partial last page."""

    def select_pages(self, q, pool, page_table, lengths, read_budget) -> jax.Array:
        p = pool.page_size
        max_pages = page_table.shape[-1]
        pages = jnp.maximum(page_table, 0)
        scores = page_scores(q[:, :, 0], pool.key_min[pages], pool.key_max[pages])
        page_index = jnp.arange(max_pages)
        held = page_index < (-(-lengths // p))[..., None]
        partial_last = (page_index == (lengths // p)[..., None]) & (lengths % p != 0)[..., None]
        ranked = jnp.where(held & ~partial_last, scores, -jnp.inf)
        wanted = (-(-read_budget // p))[:, None, None]
        return (held & (rank_descending(ranked) < wanted)) | partial_last


@dataclasses.dataclass(frozen=True)
class ReadBudget:
    """Quest's budget part: tokens per head read at each decode step (a ratio of the prompt or
    a count); every token stays. None in the copy jit sees."""

    budget: base.Budget | None

    columns: ClassVar[tuple[str, ...]] = ()

    def tokens(self, prompt_lengths: np.ndarray) -> np.ndarray:
        if self.budget is None:
            raise ValueError("policy 'quest' needs budget= (a ratio or a token count)")
        return self.budget.tokens_for(prompt_lengths)

    def ratio(self, batch: int) -> np.ndarray:
        return np.zeros((batch,), np.float32)

    def planned(self, budget_tokens, prompt_lengths):
        del budget_tokens
        return np.asarray(prompt_lengths), "the whole prompt (Quest reads a budget of pages)"


@base.register
@dataclasses.dataclass(frozen=True)
class Quest(base.Policy):
    """Read-time page selection with a per-head budget in tokens (ratio of the prompt or count):
    the record of a `PageBoundSelection` and a `ReadBudget`.

    Attributes:
      budget: tokens per head read at each decode step (rounded up to whole pages).
    """

    name: ClassVar[str] = "quest"
    request_knobs: ClassVar[tuple[str, ...]] = ("budget",)
    budget: base.Budget | float | int | None = None

    def _check(self) -> None:
        super()._check()
        if self.budget is not None:
            object.__setattr__(self, "budget", base.Budget.parse(self.budget))

    def _parts(self) -> dict:
        return {"selection": PageBoundSelection(), "budget_rule": ReadBudget(self.budget)}
