"""A free-page stack that allocates and releases pages inside jit.

Pages `free_stack[:num_free]` are free. Allocation pops from the top of the stack, release pushes.
A request that does not fit allocates nothing and reports `ok = False`; the caller records the
failure in the state (never a silent overwrite of a page in use).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PageAllocator:
    """Free-page stack.

    Attributes:
      free_stack: int32 [P]; entries [0, num_free) are the free page ids.
      num_free: int32 []; number of free pages.
    """

    free_stack: jax.Array
    num_free: jax.Array

    @classmethod
    def create(cls, num_pages: int) -> PageAllocator:
        # Reversed so that the first pages handed out are 0, 1, 2, ... (easier to read in tests).
        return cls(
            free_stack=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
            num_free=jnp.asarray(num_pages, jnp.int32),
        )

    @property
    def num_pages(self) -> int:
        return self.free_stack.shape[-1]

    def pages_in_use(self) -> jax.Array:
        return self.num_pages - self.num_free


def allocate(alloc: PageAllocator, counts: jax.Array, max_count: int):
    """Allocates counts[i] pages for each request i, all or nothing.

    Args:
      counts: int32 [R] pages wanted per request, each in [0, max_count].
      max_count: static bound on counts.
    Returns:
      (allocator, pages int32 [R, max_count] with -1 beyond counts[i], ok bool []).
      When the requests do not fit, nothing is allocated, pages are all -1 and ok is False.
    """
    total = jnp.sum(counts)
    ok = total <= alloc.num_free
    first = jnp.cumsum(counts) - counts  # each request's offset from the top of the stack
    slot = first[:, None] + jnp.arange(max_count)
    wanted = (jnp.arange(max_count) < counts[:, None]) & ok
    stack_index = jnp.clip(alloc.num_free - 1 - slot, 0, alloc.num_pages - 1)
    pages = jnp.where(wanted, alloc.free_stack[stack_index], -1)
    num_free = jnp.where(ok, alloc.num_free - total, alloc.num_free)
    return PageAllocator(free_stack=alloc.free_stack, num_free=num_free), pages, ok


def release(alloc: PageAllocator, pages: jax.Array) -> PageAllocator:
    """Returns pages to the pool; entries < 0 are ignored. pages: int32 [R] (any shape, flattened).

    The caller guarantees every released page is in use (each page is owned by exactly one
    (layer, sequence, head) slot of the page table, which gives it back once).
    """
    pages = pages.reshape(-1)
    valid = pages >= 0
    rank = jnp.cumsum(valid) - 1
    destination = jnp.where(valid, alloc.num_free + rank, alloc.num_pages)
    free_stack = alloc.free_stack.at[destination].set(pages, mode="drop")
    return PageAllocator(free_stack=free_stack, num_free=alloc.num_free + jnp.sum(valid))
