"""Cached contexts: a document prefilled and compressed once in the engine's pool, that any
number of later requests read (`Engine.add_context`, `Engine.submit(..., context=)`).

A context is prefilled as a prompt is (chunk eviction, observations) in a prefill row, compressed
by the engine's policy, then moved into a context row of its lane, where it stays until dropped.
A question on it starts in a prefill row attached to the context row (`attach_row`: the
context's full pages shared, its partial last pages copied), reads its tokens after the
context's as `Session.extend` reads them (no chunk eviction, no compression) and decodes as any
request: its answer equals `jaxkv.ask` over the same context and question. Nothing writes a
shared page: a policy whose decode eviction would run within a question's `max_new_tokens` is
refused (`check_shared_decode`), as `ask` refuses it.

Host code only: the engine's bookkeeping of each context and what it tells its callers.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.engine.pages import Pages


class ContextsFullError(ValueError):
    """`Engine.add_context`: every context row holds a context that requests read or wait for."""


class UnknownContextError(ValueError):
    """A context id the engine does not hold (never made, dropped, or evicted for its pages)."""


@dataclasses.dataclass(frozen=True)
class ContextEvent:
    """What became of a cached context in a step.

    state: "ready" (prefilled and compressed: requests read it from now on), "too_large" (its
      prefill or compressed prompt came out larger than the pool: it is gone), "evicted"
      (dropped, idle, for its pages: a request naming it now is refused).
    tokens: the context's tokens (positions); kv_bytes: the bytes its pages hold (every
      device's); full_kv_bytes: those the full cache would hold; compressed: whether the policy
      dropped any of its tokens (on "ready"; None otherwise).
    """

    context_id: int
    state: str
    tokens: int
    kv_bytes: int | None = None
    full_kv_bytes: int | None = None
    compressed: bool | None = None


@dataclasses.dataclass(eq=False)  # a context is itself: compared by identity
class Context:
    """The engine's bookkeeping of one cached context (mutable: the engine's own).

    Attributes:
      id: its id.
      row: its (global) context row, reserved when it is made.
      tokens: its tokens (a question's first position).
      budget_tokens, budget_ratio, thresholds: its policy values, one row each (the questions
        on it decode with them, as a forked session's rows do).
      request: the request that prefills it (None once it is ready).
      ready: whether it is prefilled and compressed.
      readers: ids of the requests that read it (queued, prefilling, ready or running).
      last_used: when a request last named it (the engine's count of submissions).
      pages: the pages its row holds (every device's; and its int8 pages), recorded when it is
        ready.
      hits: the requests that have read it.
      evict_first: dropped, idle, before the contexts without it (`Engine.add_context`).
      dropping: deleted while requests read it: dropped when the last one ends.
      last_hidden: [1, D] (host) the hidden state after its last token, once it is ready (what
        a `Session` of it holds).
    """

    id: int
    row: int
    tokens: int
    budget_tokens: np.ndarray
    budget_ratio: np.ndarray
    thresholds: np.ndarray
    request: object | None
    ready: bool = False
    readers: set[int] = dataclasses.field(default_factory=set)
    last_used: int = 0
    pages: Pages = Pages(0)
    hits: int = 0
    evict_first: bool = False
    dropping: bool = False
    last_hidden: np.ndarray | None = None

    @property
    def idle(self) -> bool:
        """Ready, and no request reads or waits for it: it may be dropped for its pages."""
        return self.ready and not self.readers


def check_session(session, kv, config, policy, max_context: int) -> None:
    """ValueError, named, for a session (`jaxkv.Session`) that `Engine.add_session` cannot
    take into an engine whose device KV state is `kv` (its model `config`, `policy` and
    `max_context`): several rows or forked, another policy or model configuration, another
    page geometry or storage, more pages a head than max_context allows."""
    if session.batch != 1 or session.shared:
        raise ValueError(
            "session: give a one-row session without shared pages (prefill one context), "
            f"not one of {session.batch} rows (shared={session.shared})"
        )
    if session.model.config != config or session.policy != policy:
        raise ValueError(
            f"session: made with policy {session.policy.name!r} and model "
            f"{session.model.config.family.value}; this engine runs {policy.name!r} on "
            "its own model: prefill it with the engine's"
        )
    theirs = session.kv
    if kv_geometry(theirs) != kv_geometry(kv):
        raise ValueError(
            f"session: its KV state's (page size, dtype, head dim, layers, KV heads, key "
            f"bounds, ring, int8 window) are {kv_geometry(theirs)}, the engine's "
            f"{kv_geometry(kv)}"
        )
    if theirs.page_table.shape[-1] > kv.page_table.shape[-1] or (
        theirs.pool.int8 is not None
        and theirs.pool.int8.page_table.shape[-1] > kv.pool.int8.page_table.shape[-1]
    ):
        raise ValueError(
            f"session: its heads hold up to {theirs.page_table.shape[-1]} pages, more than "
            f"the engine's max_context={max_context} allows"
        )


def kv_geometry(kv) -> tuple:
    """What one device's KV states must share for a row to move between them: (page size,
    dtype, head dim, layers, KV heads, key bounds, ring window, int8 window)."""
    pool, table = kv.pool, kv.page_table
    ring = None if kv.ring is None else kv.ring.window
    return (
        pool.page_size,
        str(pool.k_pages.dtype),
        pool.k_pages.shape[-1],
        table.shape[0],
        table.shape[-2],
        pool.key_min is not None,
        ring,
        None if pool.int8 is None else pool.int8.window,
    )
