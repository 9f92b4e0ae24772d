"""Teacher-forced decode, one step at a time, exposing what a decode-time policy saw and did.

Each step writes one given token (as `generate`'s decode step does), reads its next-token
logits, then runs the policy's `on_decode`. The numpy references of the decode-time rules
(Conf-KV's budget schedule, Scissorhands' persistence counts) check every step against the
state before and after the hook.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.models.decoder import logits_from_hidden
from jaxkv.step.forward import forward_cached
from jaxkv.step.parts import DecodeContext
from jaxkv.step.rows import Rows, row_keys


@dataclasses.dataclass
class Step:
    """One decode step: logits f32 [V] of the sequence; positions and token_scores [L, K, S]
    of the cache after the write (before the hook) and positions after the hook."""

    position: int
    logits: np.ndarray
    written_positions: np.ndarray
    written_scores: np.ndarray
    kept_positions: np.ndarray


@functools.partial(jax.jit, static_argnames="policy")
def _step(model, kv, token, position, prompt_length, budget_tokens, thresholds, policy):
    hidden, kv, _ = forward_cached(
        model,
        token[None, None],
        position[None, None],
        kv,
        policy=policy,
        thresholds=thresholds,
    )
    logits = logits_from_hidden(model.params, model.config, hidden[:, 0])
    ctx = DecodeContext(
        prompt_lengths=prompt_length[None],
        budget_tokens=budget_tokens,
        budget_ratio=jnp.zeros((1,), jnp.float32),
        thresholds=thresholds,
        positions=position[None],
        logits=logits,
        keys=jax.random.PRNGKey(0)[None],
        group_size=model.config.group_size,
    )
    return kv, policy.decode_eviction.on_decode(kv, ctx), logits[0]


def teacher_forced_steps(model, prompt: list[int], policy, continuation: list[int], page_size=4):
    """The prompt's compressed state and one `Step` per continuation token (one sequence)."""
    kv = jaxkv.compress_prompt(
        model,
        [prompt],
        policy,
        cache=jaxkv.CacheConfig(page_size=page_size),
        reserve_tokens=len(continuation),
    )
    prompt_state = kv
    length = np.array([len(prompt)], np.int32)
    budget_tokens = jnp.asarray(policy.budget_tokens(length))
    steps = []
    for i, token in enumerate(continuation):
        position = len(prompt) + i
        written, kv, logits = _step(
            model,
            kv,
            jnp.int32(token),
            jnp.int32(position),
            jnp.int32(len(prompt)),
            budget_tokens,
            jnp.asarray(policy.thresholds(1)),
            policy.static(),
        )
        steps.append(
            Step(
                position=position,
                logits=np.asarray(logits, np.float64),
                written_positions=np.asarray(written.positions())[:, 0],
                written_scores=np.asarray(written.token_scores(), np.float64)[:, 0],
                kept_positions=np.asarray(kv.positions())[:, 0],
            )
        )
    return prompt_state, steps


def policy_rows(policy, lengths, steps=None) -> Rows:
    """The greedy decode state (`Rows`, key 0) of `policy` over prompts of `lengths` (int [B])
    that have sampled `steps` tokens (default none)."""
    lengths = np.asarray(lengths, np.int32)
    return Rows.start(
        prompt_lengths=lengths,
        budget_tokens=policy.budget_tokens(lengths),
        budget_ratio=policy.budget_ratio(len(lengths)),
        thresholds=policy.thresholds(len(lengths)),
        keys=row_keys(jax.random.PRNGKey(0), np.arange(len(lengths))),
        sampling=jaxkv.Sampler().rows(len(lengths)),
        steps=steps,
    )
