"""The engine's device side: one KV state of every decode slot and prefill row over one pool
(per device), the slots' row states, the prefill carry, and the jitted programs that change them.

The `Engine` decides (its scheduler's plan) and keeps the requests; the `Executor` runs what it
decided, on kv rows (`jaxkv.engine.lanes`: a lane's slots, then its prefill rows, on each of its
devices), and knows no request. Every method is one program of `jaxkv.engine.programs` (or two,
for the first token) and checks the state it leaves.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxkv import sharding
from jaxkv.attention import Backend
from jaxkv.cache import CacheConfig, KVState
from jaxkv.cache.geometry import pool_pages_bucket, table_pages_bucket
from jaxkv.cache.int8 import create_tier
from jaxkv.engine import programs
from jaxkv.engine.lanes import Lanes
from jaxkv.engine.pages import Pages
from jaxkv.generation.observations import observed_by
from jaxkv.generation.prefill import empty_carry
from jaxkv.models.decoder import Model
from jaxkv.policies import Policy
from jaxkv.policies.base import PolicyParams
from jaxkv.sharding import InferenceMesh
from jaxkv.step.parts import local_window
from jaxkv.step.rows import Rows


class Executor:
    """The device state of an engine's lanes and the programs over it (module docstring).

    Args:
      model: the model, placed on the mesh when there is one.
      policy: the engine's policy (its static copy runs).
      cache: the pool of each device (and with int8 storage its int8 tier's pool of
        `cache.int8_pool_pages` pages).
      lanes: where the slots and prefill rows lie.
      placement: the mesh, or None on one device.
      max_context: the longest prompt + generation a row holds (sizes the page tables).
      policy_params, backend: as for `generate`.
    """

    def __init__(
        self,
        model: Model,
        policy: Policy,
        *,
        cache: CacheConfig,
        lanes: Lanes,
        placement: InferenceMesh | None,
        max_context: int,
        policy_params: PolicyParams | None,
        backend: Backend,
    ):
        self.model, self.lanes, self.placement = model, lanes, placement
        self.policy = policy.static()
        self.policy_params, self.backend, self.page_size = policy_params, backend, cache.page_size
        device_config = model.config if placement is None else placement.local_config(model.config)
        p = cache.page_size
        geometry = dict(
            num_layers=model.config.num_layers,
            batch=lanes.rows,
            num_kv_heads=device_config.num_kv_heads,
            head_dim=model.config.head_dim,
            max_tokens=table_pages_bucket(-(-max_context // p)) * p,
            page_size=p,
            num_pages=cache.num_pages,
            dtype=cache.dtype_for(model.dtype),
            key_bounds=policy.selection is not None,
            local_window=local_window(policy),
        )
        geometry["int8"] = None
        if cache.int8_window is not None:
            geometry["int8"] = (cache.int8_window, cache.int8_pool_pages)
        if placement is None:
            self.kv = _engine_state(**geometry)
        else:
            self.kv = placement.run(_engine_state, (), (), geometry)
        self._carry = empty_carry(
            placement, model=model, batch=lanes.prefills, observed=observed_by(self.policy)
        )
        self._rows: Rows | None = None  # every slot's row state, from the first admission on

    def kv_bytes(self, pages: Pages) -> int:
        """Bytes `pages` hold (and with int8 storage a row's channel scales beside its int8
        pages)."""
        held = pages.model * self.kv.pool.page_bytes
        tier = self.kv.pool.int8
        if tier is None or not pages.int8:
            return held
        config = self.model.config  # f32 key and value scales per (layer, KV head, channel)
        scales = 2 * 4 * config.num_layers * config.num_kv_heads * config.head_dim
        return held + pages.int8 * tier.pool.page_bytes + scales

    def row_pages(self) -> tuple[np.ndarray, ...]:
        """Per lane and pool (`programs.row_pages`; T = 1, or 2 with int8 storage)
        [lanes, devices, T, rows]: the pages each kv row names (shared ones too), those it
        alone names (what releasing it frees), those its next decode step may add, and
        [lanes, devices, T] the pools' free pages."""
        counts = programs.row_pages(self.placement, kv=self.kv)
        return tuple(self.lanes.per_lane(x) for x in counts)

    def _pools(self, held: Pages) -> dict:
        """The pool sizes of a row alone that holds `held` pages (`copy_row`'s statics)."""
        int8 = None if self.kv.pool.int8 is None else pool_pages_bucket(held.int8, self.page_size)
        return {"num_pages": pool_pages_bucket(held.model, self.page_size), "int8_pages": int8}

    def read_chunks(
        self,
        kv_rows,
        tokens,
        starts,
        counts,
        lengths,
        offsets,
        budget_tokens,
        thresholds,
        *,
        questions: bool,
    ):
        """One chunk of each given kv row (prefill rows, lane after lane, the same count a lane)
        in one forward pass: tokens int32 [R, C], read from `starts` [R], `counts` [R] of them
        (0: a row that reads nothing), of prompts `lengths` [R] long whose first token is at
        position `offsets` [R] (a question's: after its context); `questions`: rows over
        cached contexts (`programs.prefill_rows`)."""
        self.kv, self._carry = programs.prefill_rows(
            self.placement,
            model=self.model,
            kv=self.kv,
            carry=self._carry,
            rows=np.asarray(kv_rows, np.int32),
            tokens=tokens,
            starts=starts,
            counts=counts,
            lengths=lengths,
            offsets=offsets,
            budget_tokens=budget_tokens,
            thresholds=thresholds,
            policy_params=self.policy_params,
            policy=self.policy,
            backend=self.backend,
            questions=questions,
        )
        self.kv.check()

    def finish_row(
        self,
        lane,
        kv_row,
        tokens,
        length,
        budget,
        prompt_share,
        thresholds,
        prefill_key,
        *,
        compress: bool = True,
    ) -> tuple[np.ndarray, bool]:
        """The policy's compression of a prefill row whose prompt is read (unless not
        `compress`: a question over a cached context): (its last hidden state [1, D] on the
        host, whether any head holds fewer than the `length` tokens the row read). tokens: the
        prompt (read by a compression that replays it) or a placeholder; budget, thresholds:
        its request's row of each, and its budget's share of the prompt (`prompt_share`)."""
        lanes = self.lanes
        self.kv, last_hidden, compressed = programs.finish_row(
            self.placement,
            model=self.model,
            kv=self.kv,
            carry=self._carry,
            row=lanes.one_lane(lane, kv_row, lanes.slots + lanes.contexts),  # a prefill row
            active=lanes.active(lane),
            tokens=lanes.one_lane(lane, tokens, np.zeros_like(tokens)),
            length=lanes.one_lane(lane, length, 1),
            budget_tokens=lanes.one_lane(lane, budget, budget),
            prompt_share=lanes.one_lane(lane, prompt_share, prompt_share),
            thresholds=lanes.one_lane(lane, thresholds, thresholds),
            key=prefill_key,
            policy_params=self.policy_params,
            policy=self.policy,
            compress=compress,
        )
        self.kv.check()
        return lanes.lane_value(last_hidden, lane), bool(lanes.lane_value(compressed, lane))

    def first_token(self, last_hidden: np.ndarray, row: Rows) -> tuple[int, Rows]:
        """The token a prefilled row samples first from its last hidden state [1, D], and its
        row state (one row, `row` before it) after it."""
        token, state = programs.first_token(self.model, last_hidden, row)
        return int(token), jax.device_get(state)

    def move(self, lane: int, source: int, destination: int) -> None:
        """kv row `source`'s pages to the empty kv row `destination` of `lane` (no copy)."""
        self.kv = self._on_lane(programs.move, lane, source=source, destination=destination)

    def attach(self, lane: int, context: int, destination: int) -> None:
        """The empty kv row `destination` of `lane` attached to its context kv row `context`
        (the context's full pages shared, its partial pages copied)."""
        self.kv = self._on_lane(programs.attach, lane, context=context, destination=destination)
        self.kv.check()

    def _on_lane(self, program, lane: int, **kv_rows) -> KVState:
        """`program` over the state, only `lane` active, each of `kv_rows` one kv row of it."""
        lanes = self.lanes
        rows = {name: lanes.one_lane(lane, row, 0) for name, row in kv_rows.items()}
        return program(self.placement, kv=self.kv, active=lanes.active(lane), **rows)

    def admit(self, lane: int, slot_kv_row: int, row: Rows, *, source=None, swapped=None):
        """A ready row into a slot: the pages of prefill kv row `source` (no copy) or a
        swapped-out state (`swap_out`'s) back into the pool, its row state into the slots'."""
        lanes = self.lanes
        destination = lanes.one_lane(lane, slot_kv_row, 0)
        if source is not None:
            self.move(lane, source, slot_kv_row)
        else:
            self.kv = programs.swap_in(
                self.placement,
                kv=self.kv,
                alone=self._in_lane(swapped, lane),
                slot=destination,
                active=lanes.active(lane),
            )
        if self._rows is None:
            self._rows = programs.start_rows(self.placement, row=row, batch=lanes.slots)
        self._rows = programs.insert_rows(
            self.placement, rows=self._rows, slot=destination, row=row, active=lanes.active(lane)
        )
        self.kv.check()

    def _in_lane(self, swapped: KVState, lane: int) -> KVState:
        """A swapped-out state (its lane's devices' [devices, ...]) as a SHARD argument that
        puts it in `lane`'s devices (zeros in the others', which do not read it)."""
        lanes = self.lanes

        def placed(x):
            whole = np.zeros((lanes.count, *x.shape), x.dtype)
            whole[lane] = x
            return lanes.stacked(whole.reshape(-1, *x.shape[1:]))

        return jax.tree.map(placed, swapped)

    def swap_out(self, lane: int, kv_row: int, *, slot: bool):
        """The kv row's state copied to the host and its pages freed: (its one-row state
        [devices, ...], its (held, growth) pages, its row state when it is a `slot`'s)."""
        lanes = self.lanes
        held, _, growth, _ = (x[lane].max(axis=0) for x in self.row_pages())
        held, growth = Pages.of(held[:, kv_row]), Pages.of(growth[:, kv_row])
        self.kv, alone = programs.swap_out(
            self.placement,
            kv=self.kv,
            row=lanes.one_lane(lane, kv_row, 0),
            active=lanes.active(lane),
            **self._pools(held),
        )
        state = None
        if slot:
            taken = programs.take_row_state(
                self.placement, rows=self._rows, slot=lanes.one_lane(lane, kv_row, 0)
            )
            state = jax.tree.map(lambda x: lanes.lane_value(x, lane), taken)
        swapped = jax.tree.map(lambda x: lanes.per_lane(x)[lane], alone)
        return swapped, (held, growth), state

    def copy_row(self, lane: int, kv_row: int) -> KVState:
        """The kv row's state alone, in a pool of its own of the pages it names (one device's
        state: the engine copies out on one device only)."""
        held = Pages.of(self.row_pages()[0][lane].max(axis=0)[:, kv_row])
        return programs.copy_row(
            self.placement,
            kv=self.kv,
            row=self.lanes.one_lane(lane, kv_row, 0),
            **self._pools(held),
        )

    def insert(self, lane: int, kv_row: int, alone: KVState) -> None:
        """A one-row state with a pool of its own (one device's) into the empty kv row of
        `lane`: its held pages copied into the pool (`insert_row`)."""
        per_device = jax.tree.map(lambda x: np.asarray(x)[None], alone)
        self.kv = programs.swap_in(
            self.placement,
            kv=self.kv,
            alone=self._in_lane(per_device, lane),
            slot=self.lanes.one_lane(lane, kv_row, 0),
            active=self.lanes.active(lane),
        )
        self.kv.check()

    def release(self, kv_rows_mask: np.ndarray) -> None:
        """These kv rows' pages back to the pool (bool [lanes * rows], `Lanes.kv_rows_mask`)."""
        self.kv = programs.release(self.placement, kv=self.kv, rows=kv_rows_mask)

    def decode(self, tokens: np.ndarray, active: np.ndarray) -> np.ndarray:
        """One decode step of the active slots (global slot order, [slots of every lane]) from
        their last tokens: each slot's next token."""
        self.kv, new_tokens, self._rows = programs.decode_slots(
            self.placement,
            model=self.model,
            kv=self.kv,
            tokens=tokens,
            active=active,
            rows=self._rows,
            policy_params=self.policy_params,
            policy=self.policy,
            backend=self.backend,
        )
        self.kv.check()
        return self.lanes.per_lane(new_tokens)[:, 0].reshape(-1)

    def usage(self) -> dict:
        """Pages in use (every device's) of the pool and of the int8 tier's (0 without one),
        the local ring's bytes and the KV bytes held."""
        tier = self.kv.pool.int8
        int8 = 0 if tier is None else int(np.sum(sharding.to_host(tier.pages_in_use())))
        return {
            "pages_in_use": int(np.sum(sharding.to_host(self.kv.pages_in_use()))),
            "int8_pages_in_use": int8,
            "ring_bytes": self.kv.ring_bytes,
            "kv_bytes_in_use": self.kv.memory_bytes(),
        }


def _engine_state(*, int8: tuple[int, int] | None, **geometry) -> KVState:
    """An empty `KVState.create(**geometry)`, with `int8` = (window, pages) an empty int8 tier
    of that many pages beside its pool (its rows join it once compressed, `start_held`)."""
    kv = KVState.create(**geometry)
    if int8 is None:
        return kv
    window, pages = int8
    tier = create_tier(kv, window, pages, kv.page_table.shape[-1])
    return dataclasses.replace(kv, pool=dataclasses.replace(kv.pool, int8=tier))
