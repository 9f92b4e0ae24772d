"""The pages of the pool a request may hold in the engine, planned on the host from shapes
(as `jaxkv bench plan` plans a request): what `Engine.submit` refuses by, and what the scheduler
reserves for a prefill."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.generation.request import default_prefill_chunk, pad_prompts
from jaxkv.models.configs import ModelConfig
from jaxkv.policies import Policy


@dataclasses.dataclass(frozen=True)
class Pages:
    """Page counts of an engine's two pools: its model-dtype pages and its int8 tier's (0
    without int8 storage). An amount fits in another when each count does (`<=`); the literal
    0 reads as no pages, so `sum` and the scheduler's int arithmetic take them."""

    model: int
    int8: int = 0

    @staticmethod
    def _of(other) -> Pages:
        if isinstance(other, Pages):
            return other
        if isinstance(other, int) and other == 0:
            return Pages(0, 0)
        raise TypeError(f"page counts add to Pages or 0, not {other!r}")

    def __add__(self, other) -> Pages:
        other = Pages._of(other)
        return Pages(self.model + other.model, self.int8 + other.int8)

    __radd__ = __add__

    def __sub__(self, other) -> Pages:
        other = Pages._of(other)
        return Pages(self.model - other.model, self.int8 - other.int8)

    def __rsub__(self, other) -> Pages:
        return Pages._of(other) - self

    def __le__(self, other) -> bool:
        other = Pages._of(other)
        return self.model <= other.model and self.int8 <= other.int8

    def __ge__(self, other) -> bool:
        return Pages._of(other) <= self

    def floor(self) -> Pages:
        """Each count, at least 0."""
        return Pages(max(self.model, 0), max(self.int8, 0))

    def cap(self, other: Pages) -> Pages:
        """Each count, at most `other`'s."""
        return Pages(min(self.model, other.model), min(self.int8, other.int8))

    @property
    def total(self) -> int:
        return self.model + self.int8

    @staticmethod
    def of(counts) -> Pages:
        """Pages from per-pool counts [T] (`jaxkv.engine.programs.row_pages`' pool axis)."""
        return Pages(int(counts[0]), int(counts[1]) if len(counts) > 1 else 0)


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


def _decode_tokens(policy: Policy, prompt_length: int, max_new_tokens: int):
    """(tokens a head holds after the prompt's compression, the most it holds by the end,
    whether every head holds the same): `pages_needed_alone`'s plan."""
    lengths = np.array([prompt_length])
    budget = policy.budget_tokens(lengths)
    held = int(policy.planned_tokens(budget, lengths)[0][0])
    grown = held + max_new_tokens - 1
    if policy.decode_eviction is not None:
        bound = policy.decode_eviction.decode_tokens_bound(budget, lengths, max_new_tokens)
        grown = min(grown, int(bound[0]))
    uniform = held >= prompt_length and not policy.decides_across_heads
    return held, max(grown, held + 1), uniform


def _pages_of(count: int, tokens: int, page_size: int, uniform: bool) -> int:
    """Pages `count` heads hold with `tokens` each (uniform), or `tokens` on average (each head
    rounding up to a page of its own)."""
    if uniform:
        return count * -(-tokens // page_size)
    return (count * tokens + count * (page_size - 1)) // page_size


def pages_needed_alone(
    policy: Policy,
    config: ModelConfig,
    prompt_length: int,
    max_new_tokens: int,
    page_size: int,
    prefill_chunk: int | None = None,
    device_config: ModelConfig | None = None,
    int8_window: int | None = None,
) -> Pages:
    """The most pages of one device's pools a request holds in the engine, alone: its
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

    With int8 storage (`int8_window` F) a head's model-dtype pages hold at most F + 1 tokens
    after the prompt, and its int8 pages the rest (every token, where heads split unevenly).
    """
    device_config = config if device_config is None else device_config
    chunk = engine_chunk(policy, prompt_length, prefill_chunk)
    peak = prefill_peak_pages(policy, device_config, prompt_length, chunk, page_size)
    _, tokens, uniform = _decode_tokens(policy, prompt_length, max_new_tokens)
    count = heads(config if policy.decides_across_heads else device_config)
    if int8_window is None:
        return Pages(max(peak, _pages_of(count, tokens, page_size, uniform)))
    window = heads(device_config) * -(-min(tokens, int8_window + 1) // page_size)
    int8 = max(tokens - int8_window, 0) if uniform else tokens
    return Pages(max(peak, window), _pages_of(count, int8, page_size, uniform))


def int8_pages_after_prefill(
    policy: Policy,
    config: ModelConfig,
    prompt_length: int,
    page_size: int,
    int8_window: int | None,
    device_config: ModelConfig | None = None,
) -> int:
    """The most int8 pages of one device a request holds once its prompt is compressed and its
    tokens but each head's newest `int8_window` moved to int8 (to its first decode step); 0
    without int8 storage (`int8_window` None)."""
    if int8_window is None:
        return 0
    device_config = config if device_config is None else device_config
    held, _, uniform = _decode_tokens(policy, prompt_length, 1)
    count = heads(config if policy.decides_across_heads else device_config)
    int8 = max(held - int8_window, 0) if uniform else held
    return _pages_of(count, int8, page_size, uniform)
