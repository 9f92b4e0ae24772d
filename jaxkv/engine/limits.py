"""An engine's bounds, checked once when it is made (`Engine`'s arguments).

Host code only: counts against each other, the model and the mesh.
"""

from __future__ import annotations

import dataclasses

from jaxkv.cache.config import check_count
from jaxkv.generation.request import DEFAULT_PREFILL_CHUNK
from jaxkv.models.configs import ModelConfig
from jaxkv.sharding import InferenceMesh


@dataclasses.dataclass(frozen=True)
class Limits:
    """The counts an engine runs within (`Engine`'s arguments of the same names, checked).

    max_slots, max_prefills, max_contexts: decode slots, prefill rows, context rows (every
      lane's). max_batched_tokens: the most tokens one step runs on a lane. max_context: the
      longest prompt + generation. max_waiting: the bound of the waiting queue.
      prefill_chunk: the prefill chunk asked for (None: `generate`'s default, `chunk`).
    """

    max_slots: int
    max_prefills: int
    max_contexts: int
    max_batched_tokens: int
    max_context: int
    max_waiting: int
    prefill_chunk: int | None

    @property
    def chunk(self) -> int:
        """The tokens a prefill row reads at most in one step."""
        return DEFAULT_PREFILL_CHUNK if self.prefill_chunk is None else self.prefill_chunk


def check_limits(
    config: ModelConfig,
    placement: InferenceMesh | None,
    *,
    max_slots: int,
    max_prefills: int,
    max_contexts: int,
    max_batched_tokens: int | None,
    max_context: int | None,
    max_waiting: int,
    prefill_chunk: int | None,
) -> Limits:
    """`Limits` from `Engine`'s arguments; ValueError naming the first out of its range: the
    counts >= 1 (max_contexts >= 0), on a mesh multiples of its data axis (each data shard an
    equal share, `placement.check` of the slots against the model), max_batched_tokens at
    least a lane's slots + 16 (default: room for every slot and a full chunk of every prefill
    row of a lane), max_context within the model's max_position_embeddings (default: that, at
    most 8192)."""
    counts = {
        "max_slots": check_count("max_slots", max_slots, 1),
        "max_prefills": check_count("max_prefills", max_prefills, 1),
        "max_contexts": check_count("max_contexts", max_contexts, 0),
    }
    shards = 1
    if placement is not None:
        for name, count in counts.items():
            if count % placement.data:
                raise ValueError(
                    f"{name}={count} must be a multiple of the mesh's data axis "
                    f"({placement.data}): each data shard holds an equal share"
                )
        placement.check(config, counts["max_slots"])
        shards = placement.data
    if prefill_chunk is not None:
        prefill_chunk = check_count("prefill_chunk", prefill_chunk, 1)
    lane_slots = counts["max_slots"] // shards
    if max_batched_tokens is None:
        chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        max_batched_tokens = lane_slots + counts["max_prefills"] // shards * chunk
    max_batched_tokens = check_count("max_batched_tokens", max_batched_tokens, lane_slots + 16)
    limit = config.max_position_embeddings
    max_context = check_count(
        "max_context", min(limit, 8192) if max_context is None else max_context, 1
    )
    if max_context > limit:
        raise ValueError(
            f"max_context={max_context} exceeds the model's max_position_embeddings={limit}"
        )
    return Limits(
        **counts,
        max_batched_tokens=max_batched_tokens,
        max_context=max_context,
        max_waiting=check_count("max_waiting", max_waiting, 1),
        prefill_chunk=prefill_chunk,
    )
