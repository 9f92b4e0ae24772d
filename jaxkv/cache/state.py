"""The ragged paged KV state: one physical page pool shared by all layers, sequences and KV heads.

Every (layer, sequence, KV head) owns its own list of pages. A page holds `page_size` tokens of one
KV head. Because the pool is shared, a head or layer that keeps fewer tokens holds fewer pages,
and the pages it gives back serve any other head: non-uniform budgets save real memory.

Keys are stored after RoPE at their original positions, so order inside the cache does not matter
to attention; `token_positions` keeps each token's original position for policies (recency, sinks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.slots import merge_slots, slot_view
from jaxkv.sharding import to_host


@flax.struct.dataclass
class PagePool:
    """Physical storage and its allocator.

    Attributes:
      k_pages, v_pages: [P, p, H] keys (post-RoPE) and values.
      token_positions: int32 [P, p] original position of each stored token.
      token_scores: f32 [P, p] per-token policy score (accumulated attention mass for H2O).
      key_min, key_max: f32 [P, H] per-page, per-channel bounds of the held keys, for page
        selection (Quest); None unless the state was created with `key_bounds=True`.
      allocator: the free-page stack.
      overflow: bool []; set when a write did not fit in the pool (the write was dropped whole).
      k_scales, v_scales: f32 [P, p] per-token dequantisation scales of an int8 pool (value =
        int8 * token scale * channel scale); None for a pool in a float dtype.
      int8: the int8 tier holding each head's older tokens (mixed-precision storage,
        `Int8Tier`, written by `jaxkv.cache.int8`); None unless int8 storage is on.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    token_positions: jax.Array
    token_scores: jax.Array
    allocator: PageAllocator
    overflow: jax.Array
    key_min: jax.Array | None = None
    key_max: jax.Array | None = None
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None
    int8: Int8Tier | None = None

    # Shapes are read from the last axes, so that a mesh's per-device pools stacked [S, ...]
    # (`jaxkv.sharding`) answer per device.
    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[-3]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[-2]

    @property
    def page_bytes(self) -> int:
        """Bytes one page holds: its keys, values and per-token metadata (and scales)."""
        p, h = self.k_pages.shape[-2:]
        kv_bytes = p * h * (self.k_pages.dtype.itemsize + self.v_pages.dtype.itemsize)
        metadata = p * (self.token_positions.dtype.itemsize + self.token_scores.dtype.itemsize)
        bounds = 0 if self.key_min is None else 2 * h * self.key_min.dtype.itemsize
        scales = 0 if self.k_scales is None else 2 * p * self.k_scales.dtype.itemsize
        return kv_bytes + metadata + bounds + scales

    def map_token_data(self, move: Callable[[jax.Array | None], jax.Array | None]) -> PagePool:
        """This pool with `move` applied to every page-aligned per-token field ([P, p, ...]:
        keys, values, positions, scores, int8 token scales), so code that relocates tokens
        (compaction, repacking) moves all of them; `move(None)` must give None."""
        return dataclasses.replace(
            self,
            k_pages=move(self.k_pages),
            v_pages=move(self.v_pages),
            token_positions=move(self.token_positions),
            token_scores=move(self.token_scores),
            k_scales=move(self.k_scales),
            v_scales=move(self.v_scales),
        )

    def refresh_key_bounds(self, pages: jax.Array, held_counts: jax.Array) -> PagePool:
        """Recomputes key bounds of `pages` (int32 [n], -1 ignored) from their first
        `held_counts` [n] tokens; a no-op for a pool without bounds."""
        if self.key_min is None:
            return self
        keys = self.k_pages[jnp.maximum(pages, 0)].astype(jnp.float32)  # [n, p, H]
        held = (jnp.arange(self.page_size) < held_counts[:, None])[..., None]
        index = jnp.where(pages >= 0, pages, self.num_pages)
        low = jnp.min(jnp.where(held, keys, jnp.inf), axis=1)
        high = jnp.max(jnp.where(held, keys, -jnp.inf), axis=1)
        return dataclasses.replace(
            self,
            key_min=self.key_min.at[index].set(low, mode="drop"),
            key_max=self.key_max.at[index].set(high, mode="drop"),
        )


@flax.struct.dataclass
class Int8Tier:
    """The int8 pages of a mixed-precision cache: each head's tokens older than its window.

    Attributes:
      pool: int8 PagePool: k_pages, v_pages int8 [P8, p, H] with per-token scales k_scales,
        v_scales f32 [P8, p], positions and scores like the model-dtype pool.
      page_table: int32 [L, B, K, M8]; lengths: int32 [L, B, K] int8 tokens per head.
      k_channel_scales, v_channel_scales: f32 [L, B, K, H] per-channel scales.
      window: static F, the most tokens a head keeps in the model dtype.
    """

    pool: PagePool
    page_table: jax.Array
    lengths: jax.Array
    k_channel_scales: jax.Array
    v_channel_scales: jax.Array
    window: int = flax.struct.field(pytree_node=False)

    @property
    def max_tokens_per_head(self) -> int:
        return self.page_table.shape[-1] * self.pool.page_size

    def pages_in_use(self) -> jax.Array:
        return self.pool.allocator.pages_in_use()

    @property
    def channel_scale_bytes(self) -> int:
        return self.k_channel_scales.nbytes + self.v_channel_scales.nbytes

    def memory_bytes(self) -> int:
        """Host-side int: int8 pages held (values, token scales, metadata) + channel scales."""
        pages = int(np.sum(to_host(self.pages_in_use())))
        return pages * self.pool.page_bytes + self.channel_scale_bytes

    def merged_view(
        self, field: str, newer: jax.Array, layer: int | None, empty: float
    ) -> jax.Array:
        """The int8 tokens' `field` followed by the model-dtype view `newer`, per head slot."""
        table = self.page_table if layer is None else self.page_table[layer]
        lengths = self.lengths if layer is None else self.lengths[layer]
        older = slot_view(getattr(self.pool, field), table, lengths, empty)
        return merge_slots(older, newer, lengths, empty)


@flax.struct.dataclass
class LocalRing:
    """WG-KV's local ring (see `jaxkv.cache.ring`): the last `window` tokens written per (layer,
    sequence, KV head), a dense side array next to the pool. Leading [L] axis in the KV state,
    none inside the decoder's layer scan.

    Attributes:
      k, v: [L, B, K, W, H] keys (post-RoPE) and values.
      positions: int32 [L, B, W] original positions (every head of a sequence holds the same
        tokens), -1 for empty slots.
      scores: f32 [L, B, K, W] the tokens' write scores (gate values), kept on promotion.
      admitted: bool [L, B, K, W] whether the policy admits the token to the global cache.
      count: int32 [L, B] tokens written so far; the next one goes to slot count % W.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    scores: jax.Array
    admitted: jax.Array
    count: jax.Array

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        window: int,
        dtype: DTypeLike,
    ) -> LocalRing:
        if window <= 0:
            raise ValueError(f"window={window} must be > 0")
        heads = (num_layers, batch, num_kv_heads, window)
        return cls(
            k=jnp.zeros((*heads, head_dim), dtype),
            v=jnp.zeros((*heads, head_dim), dtype),
            positions=jnp.full((num_layers, batch, window), -1, jnp.int32),
            scores=jnp.zeros(heads, jnp.float32),
            admitted=jnp.zeros(heads, bool),
            count=jnp.zeros((num_layers, batch), jnp.int32),
        )

    @property
    def window(self) -> int:
        return self.positions.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes the ring reserves (host-side int, from the shapes)."""
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self))


@flax.struct.dataclass
class KVState:
    """Paged KV cache for L layers, B sequences, K KV heads, at most M pages per head.

    With int8 storage (`pool.int8` set), each head's tokens live in two tiers: its older ones
    in the int8 tier, its newest (at most the tier's `window`) in `pool`'s model-dtype pages.
    `lengths` counts both, and every per-slot view (`positions`, `token_scores`, `compact`)
    sees one slot space per head: the int8 tier's tokens first, then the model-dtype ones.

    Attributes:
      pool: the physical pages and allocator, shared by all layers.
      page_table: int32 [L, B, K, M]; model-dtype page ids in token order, -1 where unallocated.
      lengths: int32 [L, B, K]; tokens stored per (layer, sequence, KV head), both tiers.
      ring: the local ring of ring policies (WG-KV and its static baselines), else None.
    """

    pool: PagePool
    page_table: jax.Array
    lengths: jax.Array
    ring: LocalRing | None = None

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        page_size: int,
        num_pages: int,
        dtype: DTypeLike = jnp.bfloat16,
        key_bounds: bool = False,
        local_window: int = 0,
    ) -> KVState:
        """An empty state with room for `max_tokens` per head and a pool of `num_pages` pages.

        `key_bounds` adds per-page key bounds for page selection (Quest); `local_window` > 0 a
        local ring of that many slots per head (WG-KV).
        """
        for name, value in (
            ("num_layers", num_layers),
            ("batch", batch),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_tokens", max_tokens),
            ("page_size", page_size),
            ("num_pages", num_pages),
        ):
            if value <= 0:
                raise ValueError(f"{name}={value} must be > 0")
        max_pages = -(-max_tokens // page_size)
        pool = PagePool(
            k_pages=jnp.zeros((num_pages, page_size, head_dim), dtype),
            v_pages=jnp.zeros((num_pages, page_size, head_dim), dtype),
            token_positions=jnp.full((num_pages, page_size), -1, jnp.int32),
            token_scores=jnp.zeros((num_pages, page_size), jnp.float32),
            allocator=PageAllocator.create(num_pages),
            overflow=jnp.zeros((), bool),
            key_min=jnp.zeros((num_pages, head_dim), jnp.float32) if key_bounds else None,
            key_max=jnp.zeros((num_pages, head_dim), jnp.float32) if key_bounds else None,
        )
        if local_window < 0:
            raise ValueError(f"local_window={local_window} must be >= 0")
        ring = None
        if local_window:
            ring = LocalRing.create(
                num_layers=num_layers,
                batch=batch,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                window=local_window,
                dtype=dtype,
            )
        return cls(
            pool=pool,
            page_table=jnp.full((num_layers, batch, num_kv_heads, max_pages), -1, jnp.int32),
            lengths=jnp.zeros((num_layers, batch, num_kv_heads), jnp.int32),
            ring=ring,
        )

    @property
    def num_layers(self) -> int:
        return self.page_table.shape[-4]

    @property
    def max_tokens_per_head(self) -> int:
        slots = self.page_table.shape[-1] * self.pool.page_size
        return slots if self.pool.int8 is None else slots + self.pool.int8.max_tokens_per_head

    def full_precision_lengths(self) -> jax.Array:
        """int32 [L, B, K]: tokens held in the model-dtype pages (all of them without int8)."""
        return self.lengths if self.pool.int8 is None else self.lengths - self.pool.int8.lengths

    def tokens_held(self) -> jax.Array:
        """int32 [L, B, K]: tokens each head holds, in its pages (both tiers) and its ring."""
        if self.ring is None:
            return self.lengths
        return self.lengths + jnp.minimum(self.ring.count, self.ring.window)[..., None]

    def pages_in_use(self) -> jax.Array:
        """int32 []: model-dtype pages held (the int8 tier's: `pool.int8.pages_in_use()`)."""
        return self.pool.allocator.pages_in_use()

    @property
    def ring_bytes(self) -> int:
        """Bytes the local ring reserves (0 without one); host-side int."""
        return 0 if self.ring is None else self.ring.nbytes

    def memory_bytes(self) -> int:
        """Bytes really held: the pages in use (keys, values, scales and per-token metadata, in
        both tiers) and the local ring; host-side int (all devices' for stacked states)."""
        held = int(np.sum(to_host(self.pages_in_use()))) * self.pool.page_bytes + self.ring_bytes
        return held if self.pool.int8 is None else held + self.pool.int8.memory_bytes()

    def _per_slot(self, field: str, layer: int | None, empty) -> jax.Array:
        """A page-aligned pool field [P, p] viewed per head slot, `empty` past each length."""
        if self.page_table.ndim != 4:
            raise ValueError(
                f"this KV state has page tables of shape {self.page_table.shape}: a mesh's "
                "per-device states stacked [S, ...] (`jaxkv.sharding`); view one device's with "
                "jax.vmap (e.g. jax.vmap(lambda kv: kv.positions())(state)) and join them with "
                "InferenceMesh.unshard"
            )
        table = self.page_table if layer is None else self.page_table[layer]
        lengths = self.full_precision_lengths()
        lengths = lengths if layer is None else lengths[layer]
        view = slot_view(getattr(self.pool, field), table, lengths, empty)
        if self.pool.int8 is not None:
            view = self.pool.int8.merged_view(field, view, layer, empty)
        return view

    def positions(self, layer: int | None = None) -> jax.Array:
        """int32 [B, K, S] (or [L, B, K, S] for all layers; S = `max_tokens_per_head`):
        original positions of the tokens kept per head, in cache order, -1 padded."""
        return self._per_slot("token_positions", layer, -1)

    def token_scores(self, layer: int | None = None) -> jax.Array:
        """f32 per head slot like `positions`: the policy scores of the kept tokens, 0 padded."""
        return self._per_slot("token_scores", layer, 0.0)

    def with_token_scores_zeroed(self) -> KVState:
        """This state with every stored token's score set to 0, in both tiers (a policy that
        ranks by what it counts during decode, Scissorhands, starts counting here)."""

        def zeroed(pool: PagePool) -> PagePool:
            return dataclasses.replace(pool, token_scores=jnp.zeros_like(pool.token_scores))

        pool = zeroed(self.pool)
        if pool.int8 is not None:
            pool = dataclasses.replace(
                pool, int8=dataclasses.replace(pool.int8, pool=zeroed(pool.int8.pool))
            )
        return dataclasses.replace(self, pool=pool)

    def with_values(self, values: jax.Array) -> KVState:
        """This state with each held slot's value replaced: values [L, B, K, S, H] in slot
        order (S = `max_tokens_per_head`); the model-dtype tier only (a policy that merges
        values refuses int8 storage)."""
        pool = self.pool
        per_page = values.reshape(*self.page_table.shape, pool.page_size, values.shape[-1])
        index = jnp.where(self.page_table >= 0, self.page_table, pool.num_pages)
        v_pages = pool.v_pages.at[index].set(per_page.astype(pool.v_pages.dtype), mode="drop")
        return dataclasses.replace(self, pool=dataclasses.replace(pool, v_pages=v_pages))

    def check(self) -> None:
        """Raises on the host if a write ran out of pages (call after a jitted step)."""
        if np.any(to_host(self.pool.overflow)):
            raise PoolExhaustedError(
                f"the KV page pool (num_pages={self.pool.num_pages}, page_size="
                f"{self.pool.page_size}) ran out of pages; the write was not performed. "
                "Give generate() a larger num_pages or a tighter cache policy."
            )


class PoolExhaustedError(ValueError):
    """A write needed more pages than the pool had free."""
