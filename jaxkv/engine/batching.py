"""Which prefill rows one prefill program reads, and its inputs (host code over the ledger).

A step reads one chunk of each prefill row the plan reads. Each lane reads R rows in one
program, the same R on every lane: a power of two (or all of a lane's prefill rows) that
covers its rows that read, padded with its other rows that may pad (they read nothing, empty
rows first). Where too few rows may pad, R is the widest power of two every lane fills and
the rows past it wait for the next step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.engine.lanes import Lanes
from jaxkv.engine.requests import Request
from jaxkv.pallas_kernels.common import next_power_of_two

MIN_CHUNK_BUCKET = 16  # the smallest chunk a prefill program compiles for


@dataclasses.dataclass(frozen=True)
class ChunkBatch:
    """One prefill program's inputs, B = lanes x R rows, lane by lane (host arrays).

    rows: [B] the prefill rows (global), padding rows included.
    counts: [B] tokens each row reads (0: a padding row).
    tokens: [B, C] int32 the tokens read (C: a power of two, at least MIN_CHUNK_BUCKET).
    starts, lengths, offsets: [B] int32 each row's tokens read before, its prompt's tokens, the
      positions before its prompt (a cached context's); 0 for an empty row.
    budget_tokens: [B, ...] int32, thresholds: [B, ...] float32 its request's policy values.
    """

    rows: tuple[int, ...]
    counts: np.ndarray
    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray
    budget_tokens: np.ndarray
    thresholds: np.ndarray


def chunk_batch(
    prefill_rows: Sequence[Request | None],
    lanes: Lanes,
    reading: Sequence[int],
    may_pad: Callable[[int], bool],
) -> ChunkBatch | None:
    """The program that reads a chunk of the rows in `reading` (module docstring), or None when
    no row can read. prefill_rows: the ledger's request of each prefill row (None: empty);
    may_pad: whether a row outside `reading` may pad its lane's program."""
    per_lane = [
        [row for row in reading if lanes.prefill_lane(row) == lane] for lane in range(lanes.count)
    ]
    pads = [
        sorted(
            (r for r in lanes.lane_prefills(lane) if r not in rows and may_pad(r)),
            key=lambda r: prefill_rows[r] is not None,  # empty rows first
        )
        for lane, rows in enumerate(per_lane)
    ]
    width = min(next_power_of_two(max(map(len, per_lane))), lanes.prefills)
    available = min(len(r) + len(p) for r, p in zip(per_lane, pads, strict=True))
    if not available:
        return None
    if width > available:  # the widest power of two every lane fills
        width = 1 << (available.bit_length() - 1)
    batch, read = [], set()
    for rows, pad in zip(per_lane, pads, strict=True):
        batch += rows[:width] + pad[: width - len(rows[:width])]
        read.update(rows[:width])
    if not read:
        return None
    counts = np.array([prefill_rows[row].next_chunk if row in read else 0 for row in batch])
    chunk = max(MIN_CHUNK_BUCKET, next_power_of_two(int(counts.max())))
    template = prefill_rows[reading[0]]
    tokens = np.zeros((len(batch), chunk), np.int32)
    starts, lengths, offsets = (np.zeros(len(batch), np.int32) for _ in range(3))
    budget = np.zeros((len(batch),) + template.budget_tokens.shape[1:], np.int32)
    thresholds = np.zeros((len(batch),) + template.thresholds.shape[1:], np.float32)
    for i, (row, count) in enumerate(zip(batch, counts, strict=True)):
        request = prefill_rows[row]
        if request is None:
            continue
        start = min(request.read, request.length)
        starts[i], lengths[i], offsets[i] = start, request.length, request.offset
        tokens[i, :count] = request.prompts.tokens[0, start : start + count]
        budget[i], thresholds[i] = request.budget_tokens[0], request.thresholds[0]
    return ChunkBatch(
        rows=tuple(batch),
        counts=counts.astype(np.int32),
        tokens=tokens,
        starts=starts,
        lengths=lengths,
        offsets=offsets,
        budget_tokens=budget,
        thresholds=thresholds,
    )
