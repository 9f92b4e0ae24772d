"""The engine's intake: what `Engine.submit` and `Engine.add_context` check a request by before
it is queued, and the pages the engine plans for it (host code over shapes, no device state).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable

import numpy as np

from jaxkv.cache import CacheConfig
from jaxkv.engine.contexts import Context
from jaxkv.engine.limits import Limits
from jaxkv.engine.pages import (
    Pages,
    heads,
    int8_pages_after_prefill,
    pages_needed_alone,
    prefill_peak_pages,
)
from jaxkv.engine.requests import Request, TooLargeForPoolError
from jaxkv.generation.decoding import check_shared_decode
from jaxkv.generation.request import (
    Prompts,
    checked_prompts,
    pad_prompts,
    prompt_lengths,
)
from jaxkv.models.configs import ModelConfig
from jaxkv.models.decoder import Model
from jaxkv.policies import Policy
from jaxkv.policies.base import with_budget
from jaxkv.sampling import Sampler
from jaxkv.step.parts import local_window


@dataclasses.dataclass(frozen=True)
class Intake:
    """An engine's limits, and the requests they let in (its id, sampling and keys still to
    set: `Engine.submit` sets them).

    device_config: the model's configuration on one device (its heads' share on a mesh).
    limits: the engine's (`check_limits`).
    lane_slots: the decode slots of a lane, each a token of every step's batch.
    pool_pages: each device's pools.
    """

    model: Model
    policy: Policy
    cache: CacheConfig
    device_config: ModelConfig
    limits: Limits
    lane_slots: int
    pool_pages: Pages

    def prompt_request(self, rows, max_new_tokens: int, budget) -> Request:
        """A request that prefills and compresses its prompt (`rows`: one prompt's ids) at the
        policy's budget or `budget` (as `policies.get`'s), checked: its length with
        max_new_tokens against max_context, its chunk, the pages it may hold alone."""
        policy = self.policy if budget is None else with_budget(self.policy, budget)
        prompts = checked_prompts(self.model, policy, rows, self.limits.prefill_chunk)
        length = int(prompts.lengths[0])
        if length + max_new_tokens > self.limits.max_context:
            raise ValueError(
                f"prompt of {length} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"engine's max_context={self.limits.max_context}"
            )
        self.check_chunk(prompts)
        self.check_fits_alone(
            f"prompt of {length} tokens",
            max_new_tokens,
            lambda new_tokens: pages_needed_alone(
                policy,
                self.model.config,
                length,
                new_tokens,
                self.cache.page_size,
                self.limits.prefill_chunk,
                self.device_config,
                self.cache.int8_window,
            ),
        )
        peak = prefill_peak_pages(
            policy, self.device_config, length, prompts.chunk, self.cache.page_size
        )
        int8 = int8_pages_after_prefill(
            policy,
            self.model.config,
            length,
            self.cache.page_size,
            self.cache.int8_window,
            self.device_config,
        )
        return _request(
            prompts,
            policy.budget_tokens(prompts.lengths),
            policy.budget_ratio(1),
            policy.prompt_share(1),
            policy.thresholds(1),
            Pages(peak, int8),
        )

    def question_request(self, rows, max_new_tokens: int, held: Context) -> Request:
        """A request that reads its prompt after the cached context `held`, uncompressed (as
        `Session.extend` reads it), checked: the policy must not evict within max_new_tokens,
        the context, prompt and max_new_tokens within max_context, the chunk, the pages."""
        check_shared_decode(self.policy, max_new_tokens)
        lengths = prompt_lengths(self.model, rows)
        chunk = self.limits.chunk
        if self.cache.int8_window is not None:  # read in the model dtype, as `extend` reads
            chunk = min(chunk, self.cache.int8_window)
        prompts = pad_prompts(rows, lengths, chunk)
        length = int(lengths[0])
        if held.tokens + length + max_new_tokens > self.limits.max_context:
            raise ValueError(
                f"context {held.id} of {held.tokens} tokens + a prompt of {length} + "
                f"max_new_tokens={max_new_tokens} exceeds the engine's "
                f"max_context={self.limits.max_context}"
            )
        self.check_chunk(prompts)
        context_pages = pages_needed_alone(
            self.policy,
            self.model.config,
            held.tokens,
            1,
            self.cache.page_size,
            self.limits.prefill_chunk,
            self.device_config,
            self.cache.int8_window,
        )
        self.check_fits_alone(
            f"context {held.id} of {held.tokens} tokens + a prompt of {length}",
            max_new_tokens,
            lambda new_tokens: context_pages + self.attached_pages(length + new_tokens),
        )
        request = _request(
            prompts,
            held.budget_tokens,
            held.budget_ratio,
            np.zeros((1,), np.float32),  # nothing compresses the question
            held.thresholds,
            self.attached_pages(length),
        )
        return dataclasses.replace(request, context=held)

    def check_chunk(self, prompts: Prompts) -> None:
        """ValueError, named, when a chunk of `prompts` and a token of each of a lane's slots
        exceed max_batched_tokens."""
        if prompts.chunk + self.lane_slots > self.limits.max_batched_tokens:
            raise ValueError(
                f"the prompt is read in chunks of {prompts.chunk} tokens with policy "
                f"{self.policy.name!r}: give max_batched_tokens >= "
                f"{prompts.chunk + self.lane_slots} (the chunk and a token of each of a "
                f"lane's {self.lane_slots} slots), not {self.limits.max_batched_tokens}"
            )

    def check_fits_alone(
        self, what: str, max_new_tokens: int, needed: Callable[[int], Pages]
    ) -> None:
        """TooLargeForPoolError when the request's plan (`needed(new_tokens)`: its pages with
        that many new tokens) needs more pages than the pools have (the policy's own budget
        checks run first, named). what: its prompt, in words."""
        pool = self.pool_pages
        pages = needed(max_new_tokens)
        if pages <= pool:
            return
        # needed() grows with max_new_tokens: the count of smaller ones that fit is the largest.
        fitting = bisect.bisect_left(
            range(1, max_new_tokens), True, key=lambda new: not needed(new) <= pool
        )
        if pages.model <= pool.model:  # the int8 tier's pool is what is short
            tier, pool_name, needed_count, pool_count = (
                "int8 pages",
                "int8_pages",
                pages.int8,
                pool.int8,
            )
        else:
            tier, pool_name, needed_count, pool_count = (
                "pages",
                "num_pages",
                pages.model,
                pool.model,
            )
        advice = (
            f"give max_new_tokens <= {fitting}, or a shorter prompt"
            if fitting
            else "give a shorter prompt"
        )
        raise TooLargeForPoolError(
            f"{what} + max_new_tokens={max_new_tokens} may need {needed_count} {tier} with "
            f"policy {self.policy.name!r}, more than the pool's {pool_name}={pool_count} hold: "
            f"{advice}, or a larger pool",
            pages_needed=needed_count,
            num_pages=pool_count,
            field="max_new_tokens" if fitting else "prompt_ids",
        )

    def attached_pages(self, tokens: int) -> Pages:
        """The most pages of a device a row attached to a context allocates for `tokens` more
        tokens (and the copies of the context's partial pages), to its first decode step; with
        int8 storage, also the copies of the context's window (every model-dtype page) and the
        int8 pages its tokens move to."""
        pages = self.chunk_pages(tokens + 1)
        window = self.cache.int8_window
        if window is None:
            return Pages(pages)
        copies = heads(self.device_config) * -(-window // self.cache.page_size)
        return Pages(pages + copies, pages)

    def chunk_pages(self, tokens: int) -> int:
        """The most pages of a device reading `tokens` more tokens may allocate: a page per head
        for each `page_size` of them, and one more where a head's last page is part full."""
        return heads(self.device_config) * (-(-tokens // self.cache.page_size) + 1)

    def read_pages(self, request: Request) -> Pages:
        """The most pages of a device the request's next chunk may allocate: a prompt's are
        model-dtype pages; a question's on an int8 context may move as many tokens to int8."""
        pages = self.chunk_pages(request.next_chunk)
        question = request.context is not None and self.cache.int8_window is not None
        return Pages(pages, pages if question else 0)

    def full_pages(self, tokens: int) -> int:
        """Pages the full cache holds for `tokens` tokens (every head's)."""
        config = self.model.config
        return config.num_layers * config.num_kv_heads * -(-tokens // self.cache.page_size)


def _request(
    prompts: Prompts,
    budget_tokens: np.ndarray,
    budget_ratio: np.ndarray,
    prompt_share: np.ndarray,
    thresholds: np.ndarray,
    peak_pages: Pages,
) -> Request:
    return Request(
        id=-1,
        prompts=prompts,
        budget_tokens=budget_tokens,
        budget_ratio=budget_ratio,
        prompt_share=prompt_share,
        thresholds=thresholds,
        peak_pages=peak_pages,
        max_new_tokens=1,
        sampler=Sampler(),
        key=None,
        prefill_key=None,
        stop=frozenset(),
    )


def check_storage(policy: Policy, cache: CacheConfig) -> None:
    """ValueError, named, for int8 storage with a policy that cannot run over it."""
    if cache.int8_window is None:
        return
    if policy.selection is not None:
        raise ValueError(f"policy {policy.name!r} selects pages, which int8 storage does not do")
    if local_window(policy):
        raise ValueError(
            f"policy {policy.name!r} keeps a local ring, which int8 storage does not support"
        )
