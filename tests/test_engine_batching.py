"""`chunk_batch`: which prefill rows one prefill program reads, padded lane by lane."""

import types

import numpy as np

from jaxkv.engine.batching import MIN_CHUNK_BUCKET, chunk_batch
from jaxkv.engine.lanes import Lanes


def reading_row(tokens, read, chunk, offset=0):
    """A prefill row's request as `chunk_batch` reads it: its prompt, tokens read, chunk."""
    tokens = np.asarray(tokens, np.int32)[None]
    length = tokens.shape[1]
    return types.SimpleNamespace(
        prompts=types.SimpleNamespace(tokens=tokens, chunk=chunk),
        read=read,
        length=length,
        offset=offset,
        next_chunk=min(chunk, length - read),
        budget_tokens=np.full((1, 2), 7 + read, np.int32),
        thresholds=np.full((1, 2), 0.5, np.float32),
    )


def test_one_lane_reads_its_rows_in_a_power_of_two_padded_with_empty_rows_first():
    lanes = Lanes(None, slots=2, prefills=4)
    rows = [reading_row(range(1, 41), 32, 32), None, reading_row(range(50, 90), 0, 32), None]
    rows.append(None)  # (beyond the lane: never read)
    batch = chunk_batch(rows[:4], lanes, [0, 2, 3][:2], may_pad=lambda row: True)
    assert batch.rows[:2] == (0, 2) and len(batch.rows) == 2  # two rows: no padding needed
    np.testing.assert_array_equal(batch.counts, [8, 32])
    assert batch.tokens.shape == (2, 32)
    np.testing.assert_array_equal(batch.tokens[0, :8], np.arange(33, 41))
    np.testing.assert_array_equal(batch.tokens[0, 8:], 0)
    np.testing.assert_array_equal(batch.tokens[1], np.arange(50, 82))
    np.testing.assert_array_equal(batch.starts, [32, 0])
    np.testing.assert_array_equal(batch.lengths, [40, 40])
    np.testing.assert_array_equal(batch.budget_tokens[:, 0], [39, 7])


def test_three_rows_pad_to_four_with_an_empty_row_before_a_held_one():
    lanes = Lanes(None, slots=1, prefills=8)
    rows = [reading_row(range(1, 21), 0, 16) if i in (0, 1, 2, 5) else None for i in range(8)]
    batch = chunk_batch(rows, lanes, [0, 1, 2], may_pad=lambda row: True)
    assert batch.rows[:3] == (0, 1, 2) and len(batch.rows) == 4
    assert rows[batch.rows[3]] is None  # an empty row pads before row 5, which holds a request
    np.testing.assert_array_equal(batch.counts, [16, 16, 16, 0])
    np.testing.assert_array_equal(batch.lengths, [20, 20, 20, 0])
    assert batch.tokens.shape == (4, MIN_CHUNK_BUCKET)


def test_too_few_rows_that_may_pad_leave_rows_to_the_next_step():
    lanes = Lanes(None, slots=1, prefills=4)
    rows = [reading_row(range(1, 5), 0, 16) for _ in range(4)]
    batch = chunk_batch(rows, lanes, [0, 1, 2], may_pad=lambda row: False)
    assert batch.rows == (0, 1)  # a width of 4 would need a padding row: 2 read now, 1 waits
    assert batch.tokens.shape == (2, MIN_CHUNK_BUCKET)  # 4 tokens: the smallest bucket


def test_every_lane_reads_the_same_width_its_idle_lane_padding():
    lanes = Lanes(types.SimpleNamespace(data=2, model=1), slots=1, prefills=2)
    rows = [reading_row(range(1, 9), 0, 16), reading_row(range(1, 9), 0, 16), None, None]
    batch = chunk_batch(rows, lanes, [0, 1], may_pad=lambda row: True)
    assert batch.rows == (0, 1, 2, 3)  # lane 1 reads nothing: its rows pad its program
    np.testing.assert_array_equal(batch.counts, [8, 8, 0, 0])


def test_nothing_to_read_is_none():
    lanes = Lanes(None, slots=1, prefills=2)
    assert chunk_batch([None, None], lanes, [], may_pad=lambda row: True) is None
