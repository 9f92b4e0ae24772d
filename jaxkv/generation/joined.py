"""Sessions joined into one: one-row sessions, each over its own prompt and compressed by its own
policy, decoded together in one loop, each row as it would decode alone.

A decode step reads every weight once whatever the batch, so a benchmark that answers many
compressed copies of one context (`jaxkv bench ruler`: policies x ratios) decodes them as the
rows of one session for much less than one by one, where the rows hold about as many tokens:
the step's attention reads every row as far as its longest row holds (the XLA path), so rows
of very different lengths gain little (`jaxkv bench ruler` joins one ratio's rows). Only
policies that do nothing while decoding can be joined (no decode eviction, attention scoring,
page selection, gate or admission: `DECODE_PARTS`): what a row holds decides its tokens,
whichever policy compressed it. Each session is first moved into a pool sized for its decode
(`decode_ready`), then copied into its row of the joined state (`insert_row`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import KVState
from jaxkv.cache.geometry import pool_pages_bucket
from jaxkv.cache.rows import insert_row
from jaxkv.generation.loop import to_decode_geometry
from jaxkv.generation.session import Session

# The parts of a policy that act while decoding: sessions joined into one decode must have none.
DECODE_PARTS = ("decode_eviction", "attention_scoring", "selection", "gate", "admission")

_insert_row = jax.jit(insert_row, donate_argnums=0)


def join_refusal(sessions: Sequence[Session]) -> str | None:
    """Why `sessions` cannot be decoded as the rows of one (None when they can)."""
    if not sessions:
        return "sessions is empty: give at least one session"
    first = sessions[0]
    for session in sessions:
        acting = [part for part in DECODE_PARTS if getattr(session.policy, part) is not None]
        if acting:
            return f"policy {session.policy.name!r} acts while decoding ({', '.join(acting)})"
        if session.batch != 1 or session.shared or session.placement is not None:
            return "each session must be one row on one device, not forked"
        if session.model is not first.model or session.cache != first.cache:
            return "the sessions differ in their model or cache configuration"
        if session.kv.pool.int8 is not None or session.kv.ring is not None:
            return "a session with int8 storage or a local ring cannot be joined"
        if np.shape(session.budget_tokens) != np.shape(first.budget_tokens):
            return "the sessions' budgets have different columns"
        if np.shape(session.thresholds) != np.shape(first.thresholds):
            return "the sessions' thresholds have different columns"
    return None


def join_sessions(sessions: Sequence[Session], max_new_tokens: int) -> Session:
    """One session whose row i is `sessions[i]` (one-row sessions, `join_refusal`), its pool
    sized for `max_new_tokens` decode steps of every row; row i decodes as `sessions[i]`
    would (the same tokens, up to the rounding of batched matrix products). The joined
    session's policy is the first's (none of them acts while decoding).

    Raises ValueError for sessions that cannot be joined."""
    refusal = join_refusal(sessions)
    if refusal is not None:
        raise ValueError(f"cannot join the sessions: {refusal}")
    rows = [decode_ready(session, max_new_tokens).kv for session in sessions]
    first = sessions[0]
    return first.replace(
        kv=_joined_state(rows),
        last_hidden=jnp.concatenate([s.last_hidden for s in sessions]),
        lengths=np.concatenate([s.lengths for s in sessions]),
        budget_tokens=np.concatenate([s.budget_tokens for s in sessions]),
        budget_ratio=np.concatenate([s.budget_ratio for s in sessions]),
        thresholds=np.concatenate([s.thresholds for s in sessions]),
    )


def decode_ready(session: Session, max_new_tokens: int) -> Session:
    """The session with its state in a pool sized for what it holds and `max_new_tokens` more
    (`to_decode_geometry`): what `decode` would move it to, done ahead so that many sessions
    waiting to be joined hold no more than that."""
    kv = to_decode_geometry(
        session.kv,
        session.policy,
        budget_tokens=session.budget_tokens,
        lengths=session.lengths,
        placement=session.placement,
        num_pages=None,
        max_new_tokens=max_new_tokens,
        shared=session.shared,
    )
    return session.replace(kv=kv)


def _joined_state(rows: list[KVState]) -> KVState:
    """A state whose row i is the one-row state `rows[i]`, its pool their pools' pages."""
    first = rows[0]
    page_size = first.pool.page_size
    width = max(row.page_table.shape[-1] for row in rows)
    pages = sum(row.pool.num_pages for row in rows)
    kv = KVState.create(
        num_layers=first.num_layers,
        batch=len(rows),
        num_kv_heads=first.page_table.shape[2],
        head_dim=first.pool.k_pages.shape[-1],
        max_tokens=width * page_size,
        page_size=page_size,
        num_pages=pool_pages_bucket(pages, page_size),
        dtype=first.pool.k_pages.dtype,
    )
    for slot, row in enumerate(rows):
        kv = _insert_row(kv, row, jnp.int32(slot))
    kv.check()
    return kv
