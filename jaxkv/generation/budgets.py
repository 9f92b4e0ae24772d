"""One prefill, several budgets: a prompt read once, then compressed at each budget.

A sweep over compression ratios (`jaxkv bench ruler`: kvpress's 0.25, 0.5, 0.75 and 0.875)
would otherwise read the same prompt once per ratio, and on a long prompt the forward pass is
most of the cost. For a policy whose prefill does not read its budget (no chunk eviction, no
admission: the budget enters only its prompt compression), the chunks' forward pass and what
it observes are the same at every budget, so `prefill_at_budgets` runs them once
(`start_chunked_prefill`, `prefill_next_chunk`) and the compression once per budget from a copy
of the prefilled state (`finish_chunked_prefill`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxkv.attention import resolve_backend
from jaxkv.cache import CacheConfig
from jaxkv.cache.config import check_count
from jaxkv.generation.prefill import (
    finish_chunked_prefill,
    prefill_next_chunk,
    start_chunked_prefill,
)
from jaxkv.generation.request import PromptIds, checked_key, resolved_policy, set_up
from jaxkv.generation.session import Session, prefilled_session
from jaxkv.models.decoder import Model
from jaxkv.policies import Policy
from jaxkv.policies.base import PolicyParams, with_budget


def check_budget_free_prefill(policy: Policy) -> None:
    """Raises ValueError unless `policy`'s prefill reads no budget (its budget enters only the
    prompt compression)."""
    parts = (("chunk eviction", policy.chunk_eviction), ("admission", policy.admission))
    reads = [name for name, part in parts if part is not None]
    if reads:
        raise ValueError(
            f"policy {policy.name!r} has {' and '.join(reads)} during prefill, which depends on "
            "its budget: prefill it at each budget (jaxkv.prefill)"
        )


def prefill_at_budgets(
    model: Model,
    prompt_ids: PromptIds,
    policy: Policy | str,
    budgets: Sequence[float | int],
    *,
    reserve_tokens: int = 0,
    cache: CacheConfig | None = None,
    prefill_chunk: int | None = None,
    key: jax.Array | None = None,
    backend: str = "auto",
    policy_params: PolicyParams | None = None,
) -> list[Session]:
    """A session per budget, each `prefill(model, prompt_ids, with_budget(policy, budget),
    ...)`'s, the prompts read once (module docstring). `budgets`: as `budget=` takes them (a
    ratio of the prompt in (0, 1] or a token count; KVzip's `ratio=`). One device.

    Raises ValueError for a policy whose prefill reads its budget (chunk eviction, admission)
    and for bad values, before compiling."""
    policy = resolved_policy(policy)
    check_budget_free_prefill(policy)
    if not budgets:
        raise ValueError("budgets is empty: give at least one budget")
    backend = resolve_backend(backend)
    reserve_tokens = check_count("reserve_tokens", reserve_tokens, 0)
    key = jax.random.PRNGKey(0) if key is None else checked_key(key)
    requests = []
    for budget in budgets:
        request = set_up(
            model,
            prompt_ids,
            with_budget(policy, budget),
            reserve_tokens=reserve_tokens,
            positions_after_prompt=reserve_tokens,
            cache=cache,
            prefill_chunk=prefill_chunk,
            policy_params=policy_params,
        )
        # Only the first budget's prefill state is read into: the others' pools go at once.
        requests.append(request if not requests else dataclasses.replace(request, kv=None))
    first = requests[0]
    prefill = start_chunked_prefill(model, first)
    while not prefill.done:
        prefill = prefill_next_chunk(model, first, prefill, first.policy_params, backend)
    sessions = []
    for index, request in enumerate(requests):
        last = index == len(requests) - 1  # the compression donates: the others read a copy
        own = prefill if last else prefill.replace(kv=jax.tree.map(jnp.copy, prefill.kv))
        kv, last_hidden = finish_chunked_prefill(model, request, own, key)
        kv.check()
        sessions.append(prefilled_session(request, kv, last_hidden, backend))
    return sessions
