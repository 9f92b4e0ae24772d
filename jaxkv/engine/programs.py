"""The engine's jitted programs, over one KV state whose rows are the decode slots [0, S) then
the prefill rows [S, S + P), all of them in one pool. Each program runs on the rows it is given
(`jaxkv.cache.rows.take_rows`, then `put_rows`) and donates the state, so a step changes it in
place.

Programs and what each compiles for (`Engine`'s docstring counts them):
- `decode_slots`: one decode step of the slots (`generate`'s `decode_and_sample`): once.
- `prefill_rows`: a chunk of R prefill rows (tokens [R, C]): once per (R, C) bucket.
- `finish_row`: a prefilled row's compression: once (per prompt bucket for a compression that
  reads the prompt's tokens, KVzip's).
- `first_token`, `row_pages`, `move_row`, `release`, `insert_rows`, `take_row_state`: once.
- `swap_out`, `swap_in`: once per bucket of the swapped request's pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv.cache import KVState
from jaxkv.cache.repack import repack
from jaxkv.cache.rows import insert_row, move_row, put_rows, release_rows, take_rows
from jaxkv.generation.prefill import (
    PrefillCarry,
    carry_rows,
    compress_observed,
    initial_carry,
    put_carry_rows,
    read_chunk,
    with_rows_reset,
)
from jaxkv.models.decoder import logits_from_hidden
from jaxkv.step.decode import StepContext, decode_and_sample, next_tokens
from jaxkv.step.rows import Rows


@functools.partial(jax.jit, static_argnames=("policy", "backend"), donate_argnames=("kv",))
def decode_slots(model, kv, tokens, active, rows: Rows, policy_params, *, policy, backend):
    """One decode step of the active slots (bool [S]; the others write nothing), as
    `generate`'s loop runs it (`decode_and_sample`), on rows [0, S) of `kv`. Returns (kv,
    tokens int32 [S], rows)."""
    slots = jnp.arange(tokens.shape[0])
    context = StepContext(rows=rows, policy_params=policy_params, policy=policy, backend=backend)
    part, _, tokens, rows = decode_and_sample(model, take_rows(kv, slots), tokens, active, context)
    return put_rows(kv, slots, part), tokens, rows


@functools.partial(jax.jit, static_argnames=("policy", "backend"), donate_argnames=("kv", "carry"))
def prefill_rows(
    model,
    kv: KVState,
    carry: PrefillCarry,
    rows,
    tokens,
    starts,
    counts,
    lengths,
    budget_tokens,
    thresholds,
    policy_params,
    *,
    policy,
    backend,
):
    """One chunk of each of `rows` (int32 [R], kv's rows; carry row = row - S): row r reads
    tokens[r, :counts[r]], its prompt's tokens starts[r] onwards (`read_chunk`); a row with
    starts 0 starts a prefill (its carry fresh). Returns (kv, carry)."""
    carry_index = rows - (kv.page_table.shape[1] - carry.last_hidden.shape[0])
    part = carry_rows(carry, carry_index)
    fresh = initial_carry(model, rows.shape[0], policy)
    part = with_rows_reset(part, fresh, (starts == 0) & (counts > 0))
    view, part = read_chunk(
        model,
        tokens,
        starts,
        counts,
        lengths,
        jnp.zeros_like(starts),
        budget_tokens,
        thresholds,
        take_rows(kv, rows),
        part,
        policy_params,
        policy=policy,
        backend=backend,
        evict_chunks=True,
    )
    return put_rows(kv, rows, view), put_carry_rows(carry, carry_index, part)


@functools.partial(jax.jit, static_argnames=("policy",), donate_argnames=("kv",))
def finish_row(
    model,
    kv: KVState,
    carry: PrefillCarry,
    row,
    tokens,
    length,
    budget_tokens,
    thresholds,
    key,
    *,
    policy,
):
    """The policy's compression of a prefilled row (int32 [], kv's; carry row = row - S) from
    what its prefill observed (`compress_observed`; tokens [1, T] its prompt where the
    compression reads it). Returns (kv, last_hidden [1, D], whether any head holds fewer than
    its `length` tokens)."""
    rows = row[None]
    carry_index = rows - (kv.page_table.shape[1] - carry.last_hidden.shape[0])
    part, last_hidden = compress_observed(
        model,
        tokens,
        length[None],
        budget_tokens,
        thresholds,
        take_rows(kv, rows),
        carry_rows(carry, carry_index),
        key,
        policy=policy,
        int8_window=None,
    )
    compressed = jnp.any(part.tokens_held() < length)
    return put_rows(kv, rows, part), last_hidden, compressed


@jax.jit
def first_token(model, last_hidden, row: Rows):
    """The token a prefilled request samples next (`next_tokens` of its one row, as `generate`
    samples its first), and the row after it."""
    logits = logits_from_hidden(model.params, model.config, last_hidden)
    tokens, row = next_tokens(logits, row, jnp.ones((1,), bool))
    return tokens[0], row


@jax.jit
def row_pages(kv: KVState) -> tuple[jax.Array, jax.Array]:
    """int32 [B] each row's pages held, and the pages its next decode step may allocate (one per
    (layer, KV head) whose last page is full)."""
    held = jnp.sum(kv.page_table >= 0, axis=(0, 2, 3))
    full = kv.full_precision_lengths() % kv.pool.page_size == 0
    return held, jnp.sum(full, axis=(0, 2))


@functools.partial(jax.jit, static_argnames=("num_pages",), donate_argnames=("kv",))
def swap_out(kv: KVState, row, *, num_pages: int) -> tuple[KVState, KVState]:
    """(kv with `row` released, the row alone in a pool of its own of `num_pages` pages: what
    the host keeps of a preempted request)."""
    rows = row[None]
    alone = repack(take_rows(kv, rows), num_pages=num_pages, max_pages=kv.page_table.shape[-1])
    released = jnp.zeros((kv.page_table.shape[1],), bool).at[row].set(True)
    return release_rows(kv, released), alone


swap_in = jax.jit(insert_row, donate_argnames=("kv",))
move = jax.jit(move_row, donate_argnames=("kv",))
release = jax.jit(release_rows, donate_argnames=("kv",))
insert_rows = jax.jit(Rows.insert, donate_argnums=(0,))
take_row_state = jax.jit(Rows.row)
