"""Where the engine's slots and prefill rows lie: on one device, or over a (data, model) mesh as
`generate` lays out a batch (`jaxkv.sharding`: data shards hold rows, model shards KV heads).

Each data shard is a *lane*: its devices hold `slots` decode slots, `contexts` context rows
(cached contexts that questions attach to) and `prefills` prefill rows of the engine (kv rows
[0, slots), then the contexts', then the prefill rows', last, of each device's state) and a
pool of their own, one per device. The engine numbers slots, context rows and prefill rows
globally, lane after lane; a program's ROWS argument is a host array over every lane's rows in
that order.
Host code only (numpy).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv import sharding
from jaxkv.sharding import InferenceMesh


@dataclasses.dataclass(frozen=True)
class Lanes:
    """The engine's lanes (module docstring).

    Attributes:
      mesh: the mesh, or None on one device (one lane).
      slots, prefills, contexts: decode slots, prefill rows and context rows of each lane.
    """

    mesh: InferenceMesh | None
    slots: int
    prefills: int
    contexts: int = 0

    @property
    def count(self) -> int:
        return 1 if self.mesh is None else self.mesh.data

    @property
    def devices(self) -> int:
        """Devices of a lane (its model shards)."""
        return 1 if self.mesh is None else self.mesh.model

    @property
    def rows(self) -> int:
        """kv rows of a device: its lane's slots, context rows, then its prefill rows."""
        return self.slots + self.contexts + self.prefills

    def slot_lane(self, slot: int) -> int:
        return slot // self.slots

    def prefill_lane(self, row: int) -> int:
        return row // self.prefills

    def context_lane(self, row: int) -> int:
        return row // self.contexts

    def slot_kv_row(self, slot: int) -> int:
        """The kv row of a (global) slot, in its lane's devices."""
        return slot % self.slots

    def prefill_kv_row(self, row: int) -> int:
        """The kv row of a (global) prefill row, in its lane's devices."""
        return self.slots + self.contexts + row % self.prefills

    def context_kv_row(self, row: int) -> int:
        """The kv row of a (global) context row, in its lane's devices."""
        return self.slots + row % self.contexts

    def lane_slots(self, lane: int) -> range:
        return range(lane * self.slots, (lane + 1) * self.slots)

    def lane_prefills(self, lane: int) -> range:
        return range(lane * self.prefills, (lane + 1) * self.prefills)

    def lane_contexts(self, lane: int) -> range:
        return range(lane * self.contexts, (lane + 1) * self.contexts)

    def one_lane(self, lane: int, value, fill) -> np.ndarray:
        """A ROWS argument of one row a lane: `value` in `lane`'s, `fill` in the others'."""
        values = [value if i == lane else fill for i in range(self.count)]
        return np.stack([np.asarray(v) for v in values])

    def active(self, lane: int) -> np.ndarray:
        """bool [lanes]: only `lane` is active."""
        return np.arange(self.count) == lane

    def kv_rows_mask(self, slots=(), prefills=(), contexts=()) -> np.ndarray:
        """bool [lanes * rows]: the kv rows of these (global) slots, prefill rows and context
        rows, lane after lane (a ROWS argument)."""
        mask = np.zeros((self.count, self.rows), bool)
        for slot in slots:
            mask[self.slot_lane(slot), self.slot_kv_row(slot)] = True
        for row in prefills:
            mask[self.prefill_lane(row), self.prefill_kv_row(row)] = True
        for row in contexts:
            mask[self.context_lane(row), self.context_kv_row(row)] = True
        return mask.reshape(-1)

    def per_device(self, value) -> np.ndarray:
        """A program's output on the host with a leading device axis [lanes * devices, ...]
        (a mesh's are stacked so already; one device's gets one)."""
        host = sharding.to_host(value)
        return host[None] if self.mesh is None else host

    def per_lane(self, value) -> np.ndarray:
        """A program's output [lanes, devices, ...] on the host."""
        host = self.per_device(value)
        return host.reshape(self.count, self.devices, *host.shape[1:])

    def lane_value(self, value, lane: int) -> np.ndarray:
        """`lane`'s value of a program's output (its first device's: the same on each)."""
        return self.per_lane(value)[lane, 0]

    def stacked(self, per_device):
        """Host values [lanes * devices, ...] as a SHARD argument (one device: unstacked)."""
        return per_device[0] if self.mesh is None else per_device
