"""Per-head slot views of page-aligned fields, and the one slot space of a two-tier head.

A head's slot s is page `page_table[s // p]`, offset `s % p`. With int8 storage a head's slots
are its int8 tier's tokens first, then its model-dtype ones (`merge_slots`; `split_slots` is the
inverse for a keep-mask). The lowest module of the cache: it knows no state class.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pages_holding(tokens: int | None, page_size: int, max_pages: int) -> int:
    """How many of a table's first pages hold a head's first `tokens` slots (static; at least
    one, at most `max_pages`, all of them for None)."""
    if tokens is None:
        return max_pages
    return min(max(-(-tokens // page_size), 1), max_pages)


def set_from_itself(array: jax.Array, destination: jax.Array, updates: jax.Array) -> jax.Array:
    """`array.at[destination].set(updates, mode="drop")` for `updates` read from `array` itself
    (tokens moved within a pool, scores updated from their old values), in place on every
    backend. The updates are materialised first (an optimization barrier): XLA's GPU compiler
    fuses a gather into the scatter that consumes it, and a scatter fusion that reads the buffer
    it writes through another path cannot write it in place, so it copies the whole array (a
    second KV pool in SnapKV's and H2O's prefill, results/plan/h200)."""
    return array.at[destination].set(jax.lax.optimization_barrier(updates), mode="drop")


def slot_view(per_token: jax.Array, table: jax.Array, lengths: jax.Array, empty) -> jax.Array:
    """A page-aligned field [P, p] seen through page tables [..., M]: [..., M * p], `empty`
    past each head's length [...]."""
    gathered = per_token[jnp.maximum(table, 0)]
    gathered = gathered.reshape(*table.shape[:-1], -1)
    held = jnp.arange(gathered.shape[-1]) < lengths[..., None]
    return jnp.where(held, gathered, empty)


def merge_slots(older: jax.Array, newer: jax.Array, older_lengths: jax.Array, empty) -> jax.Array:
    """One slot space per head: `older` [..., S1]'s first `older_lengths` [...] slots, then
    `newer` [..., S2] (already `empty` past its length): [..., S1 + S2]."""
    s1, s2 = older.shape[-1], newer.shape[-1]
    slots = jnp.arange(s1 + s2)
    lengths = older_lengths[..., None]
    index = jnp.where(slots < lengths, slots, s1 + slots - lengths)
    both = jnp.concatenate([older, newer], axis=-1)
    merged = jnp.take_along_axis(both, jnp.minimum(index, s1 + s2 - 1), axis=-1)
    return jnp.where(slots - lengths < s2, merged, empty)


def split_slots(
    keep: jax.Array, older_lengths: jax.Array, older_slots: int
) -> tuple[jax.Array, jax.Array]:
    """Inverse of `merge_slots` for a mask keep [..., S]: (older [..., S1], newer [..., S - S1])."""
    total = keep.shape[-1]
    newer_index = older_lengths[..., None] + jnp.arange(total - older_slots)
    newer = jnp.take_along_axis(keep, jnp.minimum(newer_index, total - 1), axis=-1)
    return keep[..., :older_slots], newer & (newer_index < total)
