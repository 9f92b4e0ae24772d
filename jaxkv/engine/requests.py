"""What the engine says to its callers (tokens, refusals) and what it keeps of each request.

Host code only: a `Request` is the engine's mutable bookkeeping of one submitted prompt, a
`TokenEvent` what a step yields for it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxkv.cache import KVState
from jaxkv.engine.contexts import Context
from jaxkv.engine.pages import Pages
from jaxkv.generation.request import Prompts
from jaxkv.sampling import Sampler
from jaxkv.step.rows import Rows


class QueueFullError(ValueError):
    """`Engine.submit` found the waiting queue at its bound (`max_waiting`)."""


class TooLargeForPoolError(ValueError):
    """`Engine.submit`: the request's plan needs more pages than the pool holds, even alone.

    Attributes:
      pages_needed: the plan's pages (`pages_needed_alone`).
      num_pages: the pool's pages.
      field: what to shrink: "prompt_ids" (the prompt does not fit with a single new token) or
        "max_new_tokens" (a smaller one fits).
    """

    def __init__(self, message: str, *, pages_needed: int, num_pages: int, field: str):
        super().__init__(message)
        self.pages_needed, self.num_pages, self.field = pages_needed, num_pages, field


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """A token produced for a request (or its end without one: token -1).

    reason: why the request finished, None while it runs: "stop" (a stop token), "length"
      (max_new_tokens), "too_large" (it needed more pages than the pool has, alone: its
      prefill, its compressed prompt or its growth came out larger than `pages_needed_alone`
      planned, which `submit` checks).
    compressed: on the first token after a request's prefill, whether the policy compressed its
      prompt (False: kept whole, e.g. shorter than what the policy compresses); None on others.
    kv_bytes, full_kv_bytes: on a request's last token, the KV bytes of the pages it held after
      its last step (every device's), and those the full cache would hold for its tokens
      (prompt and generated, the last one unwritten); None on others.
    """

    request_id: int
    token: int
    finished: bool
    reason: str | None = None
    compressed: bool | None = None
    kv_bytes: int | None = None
    full_kv_bytes: int | None = None


@dataclasses.dataclass(eq=False)  # a request is itself: compared by identity
class Request:
    """A request's host-side bookkeeping (mutable: the engine's own).

    Where it is: in the queue; in prefill row `row` (reading its prompt, `read` tokens so far,
    until `state` is set); ready (`state` set: its row state after its first token), in its
    prefill row or swapped out to the host (`swapped`: its one-row KV state); in a slot.
    A request on a cached `context` reads its prompt (the question) after the context's tokens
    (`offset` positions), in the context's lane; a request that `makes_context` prefills one
    (it samples no token: its row moves into the context's row).
    """

    id: int
    prompts: Prompts  # its prompt, padded into its chunks
    budget_tokens: np.ndarray
    budget_ratio: np.ndarray
    prompt_share: np.ndarray  # f32 [1]: `Policy.prompt_share`, what its compression reads
    thresholds: np.ndarray
    peak_pages: Pages  # the most pages it holds from its first chunk to its first decode step
    max_new_tokens: int
    sampler: Sampler
    key: jax.Array  # the decode key (`generate` splits the request key into prefill, decode)
    prefill_key: jax.Array
    stop: frozenset[int]
    generated: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    order: int = -1  # when it first started its prefill, for whom to admit or preempt first
    held_pages: Pages = Pages(0)  # pages it held (every device's) when last recorded
    row: int | None = None
    read: int = 0
    state: Rows | None = None
    swapped: KVState | None = None
    swapped_pages: tuple[Pages, Pages] = (Pages(0), Pages(0))  # (held, growth) swapped out
    context: Context | None = None  # the cached context it reads
    makes_context: Context | None = None  # the cached context it prefills
    lane: int | None = None  # the lane it must run in (its context's), None: any

    @property
    def offset(self) -> int:
        """Positions before its prompt: its context's tokens (0 without one)."""
        return 0 if self.context is None else self.context.tokens

    @property
    def length(self) -> int:
        return int(self.prompts.lengths[0])

    def end_reason(self, token: int) -> str | None:
        """Why `token`, its next, ends the request ("stop", "length"), or None."""
        if token in self.stop:
            return "stop"
        if len(self.generated) + 1 >= self.max_new_tokens:
            return "length"
        return None

    def ends_with(self, token: int) -> bool:
        return self.end_reason(token) is not None

    @property
    def next_chunk(self) -> int:
        return min(self.prompts.chunk, self.length - self.read)
