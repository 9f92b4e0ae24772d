"""The pages of the pool a request may hold in the engine, planned on the host from shapes
(as `jaxkv bench plan` plans a request): what `Engine.submit` refuses by, and what the scheduler
reserves for a prefill."""

from __future__ import annotations

import numpy as np

from jaxkv.generation.request import default_prefill_chunk, pad_prompts
from jaxkv.models.configs import ModelConfig
from jaxkv.policies import Policy


def heads(config: ModelConfig) -> int:
    """(layer, KV head) pairs of a model (or of one device's share)."""
    return config.num_layers * config.num_kv_heads


def prefill_peak_pages(
    policy: Policy, config: ModelConfig, prompt_length: int, chunk: int, page_size: int
) -> int:
    """The most pages of the pool a request holds from its first prompt chunk to its first
    decode step (host): every head's prompt and one token more, or a chunk eviction's bound
    (Fast KVzip: what it keeps plus a chunk) where that is lower. A policy that admits or
    compresses holds at most the whole prompt while it reads it."""
    full = heads(config) * -(-(prompt_length + 1) // page_size)
    if policy.chunk_eviction is None:
        return full
    lengths = np.array([prompt_length])
    return min(full, policy.chunk_eviction.prefill_pages(lengths, chunk, config, page_size, 1))


def engine_chunk(policy: Policy, prompt_length: int, prefill_chunk: int | None) -> int:
    """The chunk a prompt of `prompt_length` tokens is read in (`generate`'s)."""
    lengths = np.array([prompt_length])
    chunk = default_prefill_chunk(policy, lengths) if prefill_chunk is None else prefill_chunk
    return pad_prompts([[0] * prompt_length], lengths, chunk).chunk


def pages_needed_alone(
    policy: Policy,
    config: ModelConfig,
    prompt_length: int,
    max_new_tokens: int,
    page_size: int,
    prefill_chunk: int | None = None,
    device_config: ModelConfig | None = None,
) -> int:
    """The most pages of one device's pool a request holds in the engine, alone: its
    prefill's peak (`prefill_peak_pages`) or its decode's, whichever is larger. `config` is the
    model's; on a mesh `device_config` is one device's share (its KV heads), whose pool holds
    the request's pages of those heads (a budget shared across heads may all go to one device's:
    its decode is then planned at every head).

    At decode each of its layers x KV heads holds at most the policy's planned tokens after the
    prompt (`Policy.planned_tokens`: the budget; the whole prompt where what is kept depends on
    the data, e.g. WG-KV's gates or GVote's votes) and grows by max_new_tokens - 1 (the last
    token is sampled, never written), to its decode eviction's `decode_tokens_bound` where that
    is lower; admission asks room for one more token than the prompt holds. A plan below the
    whole prompt is an average that heads may split unevenly (a budget shared across heads,
    PyramidKV's layers): each head then rounds up to a page of its own.
    """
    device_config = config if device_config is None else device_config
    chunk = engine_chunk(policy, prompt_length, prefill_chunk)
    peak = prefill_peak_pages(policy, device_config, prompt_length, chunk, page_size)
    lengths = np.array([prompt_length])
    budget = policy.budget_tokens(lengths)
    held = int(policy.planned_tokens(budget, lengths)[0][0])
    grown = held + max_new_tokens - 1
    if policy.decode_eviction is not None:
        bound = policy.decode_eviction.decode_tokens_bound(budget, lengths, max_new_tokens)
        grown = min(grown, int(bound[0]))
    tokens = max(grown, held + 1)
    count = heads(config if policy.decides_across_heads else device_config)
    if held >= prompt_length and not policy.decides_across_heads:
        return max(peak, count * -(-tokens // page_size))  # every head holds at most `tokens`
    return max(peak, (count * tokens + count * (page_size - 1)) // page_size)
