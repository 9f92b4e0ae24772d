"""One prefill, several compressions: a prompt read once, then compressed by each of several
policies, or by one policy at each of several budgets.

A sweep over compression ratios (`jaxkv bench ruler`: kvpress's 0.25, 0.5, 0.75 and 0.875) and
over policies would otherwise read the same prompt once per ratio and policy, and on a long
prompt the forward pass is most of the cost. For policies whose prefills read the prompt alike
(none reads its budget during prefill: no chunk eviction, no admission; the parts the forward
pass reads, a gate, attention scoring, page selection, equal), the chunks' forward pass is the
same for each and what each compression reads is part of what the union records
(`observations.observed_by`), so `prefill_each` runs them once (`start_chunked_prefill`,
`prefill_next_chunk`) and each compression from a copy of the prefilled state
(`finish_chunked_prefill`) with what its policy would have observed alone (`carry_seen_by`); a
policy's budgets side by side compress in one program vmapped over the budgets
(`compress_at_budgets`), so what does not read the budget (KVzip's replay) runs once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import resolve_backend
from jaxkv.cache import CacheConfig
from jaxkv.cache.config import check_count
from jaxkv.generation.mesh import MODEL, POLICY_PARAMS, ROWS, SAME, SHARD, program
from jaxkv.generation.observations import PrefillCarry, carry_seen_by, observed_by
from jaxkv.generation.prefill import (
    compress_observed,
    finish_chunked_prefill,
    prefill_next_chunk,
    start_chunked_prefill,
)
from jaxkv.generation.request import PromptIds, checked_key, resolved_policy, set_up
from jaxkv.generation.session import Session, prefilled_session
from jaxkv.models.decoder import Model
from jaxkv.policies import Policy
from jaxkv.policies.base import PolicyParams, with_budget

# The parts of a policy that its prefill's forward pass reads (besides admission and chunk
# eviction, which read the budget): policies that share a prefill must have them equal.
FORWARD_PARTS = ("gate", "attention_scoring", "selection")


def budget_read_in_prefill(policy: Policy) -> str | None:
    """What of `policy`'s prefill reads its budget (chunk eviction, admission), None if nothing
    does (its budget enters only the prompt compression)."""
    parts = (("chunk eviction", policy.chunk_eviction), ("admission", policy.admission))
    reads = [name for name, part in parts if part is not None]
    if not reads:
        return None
    parts_read = " and ".join(reads)
    return f"policy {policy.name!r} has {parts_read} during prefill, which depends on its budget"


def check_budget_free_prefill(policy: Policy) -> None:
    """Raises ValueError unless `policy`'s prefill reads no budget (`budget_read_in_prefill`)."""
    reason = budget_read_in_prefill(policy)
    if reason is not None:
        raise ValueError(f"{reason}: prefill it at each budget (jaxkv.prefill)")


def one_prefill_refusal(policies: Sequence[Policy], policy_params: Sequence) -> str | None:
    """Why one prefill cannot serve each of `policies` as its own does (None when it can): one
    reads its budget during prefill, their `FORWARD_PARTS` differ, a gate would read different
    learned parameters, or they record query moments from different positions."""
    for policy in policies:
        reason = budget_read_in_prefill(policy)
        if reason is not None:
            return reason
    first = policies[0].static()
    for policy, params in zip(policies[1:], policy_params[1:], strict=True):
        for part in FORWARD_PARTS:
            if getattr(policy.static(), part) != getattr(first, part):
                return (
                    f"policies {first.name!r} and {policy.name!r} differ in their {part}, which "
                    "prefill's forward pass reads"
                )
        if first.gate is not None and params is not policy_params[0]:
            return (
                f"policies {first.name!r} and {policy.name!r} gate with different learned "
                "parameters, which prefill's forward pass reads"
            )
    starts = {observed_by(policy).query_moments_from for policy in policies} - {None}
    if len(starts) > 1:
        return f"policies record query moments from different positions {sorted(starts)}"
    return None


def _reading(request) -> tuple:
    """What a set-up request's prefill reads into: its chunks and its empty state's arrays."""
    arrays = jax.tree.map(lambda a: (a.shape, a.dtype), request.kv)
    return request.prompts.chunk, request.prompts.num_chunks, jax.tree.structure(request.kv), arrays


def prefill_each(
    model: Model,
    prompt_ids: PromptIds,
    policies: Sequence[Policy | str],
    *,
    reserve_tokens: int = 0,
    cache: CacheConfig | None = None,
    prefill_chunk: int | None = None,
    key: jax.Array | None = None,
    backend: str = "auto",
    policy_params: Sequence[PolicyParams | None] | None = None,
) -> Iterator[Session]:
    """Each of `policies`' session over `prompt_ids`, each what `prefill(model, prompt_ids,
    policy, ...)` makes (the same kept tokens), the prompts read once (module docstring).

    The prompts are read at the call; each session is compressed from a copy of that prefill
    state when the iterator reaches it (the last alone from the state itself), so a caller that
    decodes each session and lets it go holds one prefill state and one session at a time; a
    policy at several budgets side by side in `policies` is compressed at all of them in one
    program (its scores computed once). `policy_params`: one per policy (None where it has
    none). One device.

    Raises ValueError, before compiling, for policies that do not read the prompts alike
    (`one_prefill_refusal`, or different prefill states) and for bad values."""
    resolved = [resolved_policy(policy) for policy in policies]
    if not resolved:
        raise ValueError("policies is empty: give at least one policy")
    params = [None] * len(resolved) if policy_params is None else list(policy_params)
    if len(params) != len(resolved):
        raise ValueError(
            f"policy_params has {len(params)} entries for {len(resolved)} policies: give one "
            "per policy (None where it has none)"
        )
    refusal = one_prefill_refusal(resolved, params)
    if refusal is not None:
        raise ValueError(f"{refusal}: prefill them separately (jaxkv.prefill)")
    observed = observed_by(*resolved)
    backend = resolve_backend(backend)
    reserve_tokens = check_count("reserve_tokens", reserve_tokens, 0)
    key = jax.random.PRNGKey(0) if key is None else checked_key(key)
    # The prefill is driven by a policy whose query moments it records, if any (the forward
    # pass is every policy's; the moments' first position is that policy's).
    records_moments = [observed_by(policy).query_moments_from is not None for policy in resolved]
    driver = records_moments.index(True) if any(records_moments) else 0
    requests, reading = [], None
    for index, (policy, own_params) in enumerate(zip(resolved, params, strict=True)):
        request = set_up(
            model,
            prompt_ids,
            policy,
            reserve_tokens=reserve_tokens,
            positions_after_prompt=reserve_tokens,
            cache=cache,
            prefill_chunk=prefill_chunk,
            policy_params=own_params,
        )
        if reading is None:
            reading = _reading(request)
        elif _reading(request) != reading:
            raise ValueError(
                f"policies {resolved[0].name!r} and {policy.name!r} set up different prefill "
                "states (chunks, pool or cache): prefill them separately"
            )
        # Only the driver's prefill state is read into: the others' pools go at once.
        requests.append(request if index == driver else dataclasses.replace(request, kv=None))
    driving = requests[driver]
    prefill = start_chunked_prefill(model, driving, observed)
    while not prefill.done:
        prefill = prefill_next_chunk(model, driving, prefill, driving.policy_params, backend)
    return _compressed_each(model, requests, prefill, key, backend)


def compress_observed_at_budgets(
    model,
    tokens,
    lengths,
    budget_tokens,
    prompt_share,
    thresholds,
    kv,
    carry: PrefillCarry,
    key,
    policy_params,
    *,
    policy,
    int8_window,
):
    """`compress_observed` at each of budget_tokens int32 [n, B] (or [n, B, c]) and
    prompt_share f32 [n, B], from one prefilled state: what does not read the budget (KVzip's
    replay, a scorer's scores) runs once, the choice of the kept tokens once per budget.
    Returns (kv, last_hidden), every leaf stacked [n, ...]; does not donate `kv`."""

    at_budget = functools.partial(  # the budgets positional, everything else bound
        compress_observed,
        model,
        tokens,
        lengths,
        thresholds=thresholds,
        kv=kv,
        carry=carry,
        key=key,
        policy_params=policy_params,
        policy=policy,
        int8_window=int8_window,
    )
    return jax.vmap(at_budget)(budget_tokens, prompt_share)


# One device (`jaxkv.prefill_each`): the budgets' axis is not the rows'.
compress_at_budgets = program(
    static=("policy", "int8_window"),
    model=MODEL,
    tokens=ROWS,
    lengths=ROWS,
    budget_tokens=SAME,
    prompt_share=SAME,
    thresholds=ROWS,
    kv=SHARD,
    carry=SHARD,
    key=SAME,
    policy_params=POLICY_PARAMS,
)(compress_observed_at_budgets)


def _compressed_each(model, requests, prefill, key, backend) -> Iterator[Session]:
    """`prefill_each`'s sessions: each request's compression of the prefilled state, a run of
    requests of one policy at several budgets compressed together (`compress_at_budgets`: its
    scores computed once)."""
    runs = [list(run) for _, run in itertools.groupby(requests, key=_same_compression)]
    for number, run in enumerate(runs):
        first = run[0]
        own = prefill.replace(carry=carry_seen_by(prefill.carry, first.policy))
        if len(run) == 1:  # the compression donates: the last run reads the state itself
            last = number == len(runs) - 1
            kv = prefill.kv if last else jax.tree.map(jnp.copy, prefill.kv)
            compressed = [finish_chunked_prefill(model, first, own.replace(kv=kv), key)]
        else:
            compressed = _at_budgets(model, run, own, key)
        for request, (kv, last_hidden) in zip(run, compressed, strict=True):
            kv.check()
            yield prefilled_session(request, kv, last_hidden, backend)


def _same_compression(request) -> tuple:
    """What requests compressed together share: the policy but its budget, the int8 window,
    the learned parameters (by identity) and the thresholds (one program reads one set:
    ChunkKV's kept share is one of them)."""
    thresholds = np.asarray(request.thresholds)
    return (
        request.policy.static(),
        request.cache.int8_window,
        id(request.policy_params),
        thresholds.shape,
        thresholds.tobytes(),
    )


def _at_budgets(model, run, prefill, key) -> Iterator[tuple]:
    """(kv, last_hidden) of each of `run` (requests of one policy at several budgets), from
    one compression program over the prefilled state."""
    first = run[0]
    stacked_kv, stacked_hidden = compress_at_budgets(
        first.placement,
        model=model,
        tokens=first.prompts.tokens,
        lengths=first.prompts.lengths,
        budget_tokens=jnp.stack([jnp.asarray(r.budget_tokens) for r in run]),
        prompt_share=jnp.stack([r.policy.prompt_share(len(r.prompts.lengths)) for r in run]),
        thresholds=first.thresholds,
        kv=prefill.kv,
        carry=prefill.carry,
        key=key,
        policy_params=first.policy_params,
        policy=first.policy.static(),
        int8_window=first.cache.int8_window,
    )
    for index in range(len(run)):
        yield jax.tree.map(operator.itemgetter(index), stacked_kv), stacked_hidden[index]


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
    each = [with_budget(policy, budget) for budget in budgets]
    return list(
        prefill_each(
            model,
            prompt_ids,
            each,
            reserve_tokens=reserve_tokens,
            cache=cache,
            prefill_chunk=prefill_chunk,
            key=key,
            backend=backend,
            policy_params=[policy_params] * len(each),
        )
    )
