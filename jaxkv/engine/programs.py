"""The engine's programs, over one KV state per device whose rows are the decode slots
[0, S), the context rows [S, S + X) and the prefill rows [S + X, S + X + P) of the device's
lane, all in the device's pool. On a
(data, model) mesh each data shard is a lane with its own slots, prefill rows and pool (its
model shards hold its KV heads); on one device there is one lane. Each program runs on the rows
it is given (`jaxkv.cache.rows.take_rows`, then `put_rows`) and donates the state, so a step
changes it in place. They are `jaxkv.generation.mesh.Program`s: the same code runs on one device
and, unchanged, on a mesh, each argument placed by name (ROWS: a host array over every lane's
rows, split by lane).

A program that changes one lane (a compression, an admission, a swap) takes an `active` flag
per lane: the other lanes run the identity.

Programs and what each compiles for (`Engine`'s docstring counts them):
- `decode_slots`: one decode step of every lane's slots (`generate`'s `decode_and_sample`).
- `prefill_rows`: a chunk of R prefill rows a lane (tokens [R, C]): per (R, C) bucket, for
  prompts and for questions over a cached context (no chunk eviction; with int8 storage, read
  over their int8 tier, as `Session.extend` reads).
- `finish_row`: a prefilled row's compression (per prompt bucket for a compression that reads
  the prompt's tokens, KVzip's; once more for a question, which is not compressed), and with
  int8 storage its tokens but each head's newest window moved to the int8 tier (`start_held`).
- `row_pages`, `start_rows`, `move`, `attach`, `release`, `insert_rows`, `take_row_state`:
  once.
- `swap_out`, `swap_in`, `copy_row`: per bucket of the swapped request's (or copied
  context's) pages (and int8 pages, with int8 storage).
`first_token` (a one-row sample from the hidden state) is a plain jit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.cache import KVState
from jaxkv.cache.int8 import start_held
from jaxkv.cache.repack import repack
from jaxkv.cache.rows import (
    attach_row,
    insert_row,
    move_row,
    own_pages,
    put_rows,
    release_rows,
    take_rows,
    without_int8,
)
from jaxkv.generation.mesh import MODEL, POLICY_PARAMS, ROWS, SAME, SHARD, program
from jaxkv.generation.observations import (
    PrefillCarry,
    carry_rows,
    initial_carry,
    observed_by,
    put_carry_rows,
    with_rows_reset,
)
from jaxkv.generation.prefill import compress_observed, read_chunk
from jaxkv.models.decoder import logits_from_hidden
from jaxkv.step.decode import StepContext, decode_and_sample, next_tokens
from jaxkv.step.rows import Rows


def _if_active(active, change, *operands):
    """change(*operands) where this lane's `active` (bool [1]) is set, else operands[0]."""
    return jax.lax.cond(active[0], change, lambda *ops: ops[0], *operands)


def _carry_index(kv: KVState, carry: PrefillCarry, rows):
    """The carry rows of kv rows `rows` (the prefill rows are the last)."""
    return rows - (kv.page_table.shape[1] - carry.last_hidden.shape[0])


@program(
    static=("policy", "backend"),
    donate=("kv",),
    model=MODEL,
    kv=SHARD,
    tokens=ROWS,
    active=ROWS,
    rows=SHARD,
    policy_params=POLICY_PARAMS,
)
def decode_slots(model, kv, tokens, active, rows: Rows, policy_params, *, policy, backend):
    """One decode step of the active slots (bool [S]; the others write nothing), as
    `generate`'s loop runs it (`decode_and_sample`), on rows [0, S) of `kv`. Returns (kv,
    tokens int32 [S], rows)."""
    slots = jnp.arange(tokens.shape[0])
    context = StepContext(rows=rows, policy_params=policy_params, policy=policy, backend=backend)
    part, _, tokens, rows = decode_and_sample(model, take_rows(kv, slots), tokens, active, context)
    return put_rows(kv, slots, part), tokens, rows


@program(
    static=("policy", "backend", "questions"),
    donate=("kv", "carry"),
    model=MODEL,
    kv=SHARD,
    carry=SHARD,
    rows=ROWS,
    tokens=ROWS,
    starts=ROWS,
    counts=ROWS,
    lengths=ROWS,
    offsets=ROWS,
    budget_tokens=ROWS,
    thresholds=ROWS,
    policy_params=POLICY_PARAMS,
)
def prefill_rows(
    model,
    kv: KVState,
    carry: PrefillCarry,
    rows,
    tokens,
    starts,
    counts,
    lengths,
    offsets,
    budget_tokens,
    thresholds,
    policy_params,
    *,
    policy,
    backend,
    questions,
):
    """One chunk of each of `rows` (int32 [R], kv rows, distinct, prefill rows): row r reads
    tokens[r, :counts[r]], its prompt's tokens starts[r] onwards, at positions offsets[r]
    onwards (`read_chunk`; a row with counts 0 reads nothing); a row with starts 0 and
    counts > 0 starts a prefill (its carry fresh). `questions`: the rows read questions over
    cached contexts: the policy's chunk eviction does not run (their rows share a context's
    pages) and their int8 tiers are on (a prompt is read in the model dtype alone). Returns
    (kv, carry)."""
    index = _carry_index(kv, carry, rows)
    part = carry_rows(carry, index)
    fresh = initial_carry(model, rows.shape[0], observed_by(policy))
    part = with_rows_reset(part, fresh, (starts == 0) & (counts > 0))
    view, part = read_chunk(
        model,
        tokens,
        starts,
        counts,
        lengths,
        offsets,
        budget_tokens,
        thresholds,
        take_rows(kv, rows) if questions else without_int8(take_rows(kv, rows)),
        part,
        policy_params,
        policy=policy,
        backend=backend,
        evict_chunks=not questions,
    )
    return put_rows(kv, rows, view), put_carry_rows(carry, index, part)


@program(
    static=("policy", "compress"),
    donate=("kv",),
    model=MODEL,
    kv=SHARD,
    carry=SHARD,
    row=ROWS,
    active=ROWS,
    tokens=ROWS,
    length=ROWS,
    budget_tokens=ROWS,
    prompt_share=ROWS,
    thresholds=ROWS,
    key=SAME,
    policy_params=POLICY_PARAMS,
)
def finish_row(
    model,
    kv: KVState,
    carry: PrefillCarry,
    row,
    active,
    tokens,
    length,
    budget_tokens,
    prompt_share,
    thresholds,
    key,
    policy_params,
    *,
    policy,
    compress,
):
    """The policy's compression of a prefilled row (int32 [1], a kv row) of the active lane,
    from what its prefill observed (`compress_observed`; tokens [1, T] its prompt where the
    compression reads it; none unless `compress`: a question over a cached context), then
    with int8 storage its tokens but each head's newest window into the int8 tier (as
    `generate` starts one after its compression). Returns (kv, last_hidden [1, D], whether any
    head holds fewer than the `length` tokens it read)."""
    index = _carry_index(kv, carry, row)
    observed = carry_rows(carry, index)

    def compressed_row(kv):
        taken = take_rows(kv, row)
        part, _ = compress_observed(
            model,
            tokens,
            length,
            budget_tokens,
            prompt_share,
            thresholds,
            without_int8(taken),
            observed,
            key,
            policy_params,
            policy=policy,
            int8_window=None,
        )
        if taken.pool.int8 is not None:
            pool = dataclasses.replace(part.pool, int8=taken.pool.int8)
            part = start_held(dataclasses.replace(part, pool=pool))
        return put_rows(kv, row, part)

    if compress:
        kv = _if_active(active, compressed_row, kv)
    compressed = jnp.any(take_rows(kv, row).tokens_held() < length[0])
    return kv, observed.last_hidden, compressed


@jax.jit
def first_token(model, last_hidden, row: Rows):
    """The token a prefilled request samples next (`next_tokens` of its one row, as `generate`
    samples its first), and the row after it."""
    logits = logits_from_hidden(model.params, model.config, last_hidden)
    tokens, row = next_tokens(logits, row, jnp.ones((1,), bool))
    return tokens[0], row


@program(kv=SHARD)
def row_pages(kv: KVState) -> tuple[jax.Array, ...]:
    """Per pool (T = 1, or 2 with int8 storage: model-dtype, then int8), int32 [T, B]: each
    row's pages named (shared ones too), those it alone names (what its release frees), the
    pages its next decode step may allocate (a model-dtype page per (layer, KV head) whose
    last page is full; an int8 page per head whose window is full, its token then moving to
    an int8 page, and whose last int8 page is full), and [T] the free pages."""
    p, tier = kv.pool.page_size, kv.pool.int8
    full_lengths = kv.full_precision_lengths()
    held = [jnp.sum(kv.page_table >= 0, axis=(0, 2, 3))]
    growth = [jnp.sum(full_lengths % p == 0, axis=(0, 2))]
    free = [kv.pool.allocator.num_free]
    if tier is not None:
        held.append(jnp.sum(tier.page_table >= 0, axis=(0, 2, 3)))
        spills = (full_lengths >= tier.window) & (tier.lengths % p == 0)
        growth.append(jnp.sum(spills, axis=(0, 2)))
        free.append(tier.pool.allocator.num_free)
    return jnp.stack(held), own_pages(kv), jnp.stack(growth), jnp.stack(free)


@program(static=("batch",), row=SAME)
def start_rows(row: Rows, *, batch: int) -> Rows:
    """A lane's slots' row state before any admission: `batch` copies of `row`."""
    return row.repeated(batch)


@program(donate=("kv",), kv=SHARD, source=ROWS, destination=ROWS, active=ROWS)
def move(kv: KVState, source, destination, active) -> KVState:
    """The active lane's kv row `source` moved to row `destination` ([1] each; `move_row`)."""
    return _if_active(active, lambda kv: move_row(kv, source[0], destination[0]), kv)


@program(donate=("kv",), kv=SHARD, context=ROWS, destination=ROWS, active=ROWS)
def attach(kv: KVState, context, destination, active) -> KVState:
    """The active lane's empty kv row `destination` attached to context row `context` ([1]
    each; `attach_row`: the context's full pages shared, its partial pages copied)."""
    return _if_active(active, lambda kv: attach_row(kv, context[0], destination[0]), kv)


@program(donate=("kv",), kv=SHARD, rows=ROWS)
def release(kv: KVState, rows) -> KVState:
    """`release_rows` of each lane's rows where `rows` (bool [B]) is set."""
    return release_rows(kv, rows)


@program(static=("num_pages", "int8_pages"), kv=SHARD, row=ROWS)
def copy_row(kv: KVState, row, *, num_pages: int, int8_pages: int | None) -> KVState:
    """Each lane's kv row `row` ([1]) alone, in a pool of its own of `num_pages` pages (and an
    int8 tier's of `int8_pages`, with int8 storage; `kv` unchanged: a cached context copied
    out)."""
    tier = kv.pool.int8
    int8_geometry = None if tier is None else (int8_pages, tier.page_table.shape[-1])
    return repack(
        take_rows(kv, row),
        num_pages=num_pages,
        max_pages=kv.page_table.shape[-1],
        int8_geometry=int8_geometry,
    )


@program(static=("num_pages", "int8_pages"), donate=("kv",), kv=SHARD, row=ROWS, active=ROWS)
def swap_out(
    kv: KVState, row, active, *, num_pages: int, int8_pages: int | None
) -> tuple[KVState, KVState]:
    """(kv with the active lane's `row` ([1]) released, the row alone in a pool of its own of
    `num_pages` pages (`copy_row`): what the host keeps of a preempted request)."""
    alone = copy_row.fn(kv, row, num_pages=num_pages, int8_pages=int8_pages)
    released = jnp.zeros((kv.page_table.shape[1],), bool).at[row[0]].set(active[0])
    return release_rows(kv, released), alone


@program(donate=("kv",), kv=SHARD, alone=SHARD, slot=ROWS, active=ROWS)
def swap_in(kv: KVState, alone: KVState, slot, active) -> KVState:
    """The active lane's swapped-out row state `alone` back into its `slot` ([1];
    `insert_row`)."""
    return _if_active(active, lambda kv, alone: insert_row(kv, alone, slot[0]), kv, alone)


@program(donate=("rows",), rows=SHARD, slot=ROWS, row=SAME, active=ROWS)
def insert_rows(rows: Rows, slot, row: Rows, active) -> Rows:
    """The active lane's slots' row state with `slot` ([1]) replaced by `row`'s."""
    return _if_active(active, lambda rows, row: rows.insert(slot[0], row), rows, row)


@program(rows=SHARD, slot=ROWS)
def take_row_state(rows: Rows, slot) -> Rows:
    """The one-row state of each lane's `slot` ([1])."""
    return rows.row(slot[0])
