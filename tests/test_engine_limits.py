"""`check_limits`: an engine's counts, checked once, each error naming its argument."""

import types

import pytest

from jaxkv.engine.limits import check_limits
from jaxkv.generation.request import DEFAULT_PREFILL_CHUNK

CONFIG = types.SimpleNamespace(max_position_embeddings=16384)
ARGS = dict(
    max_slots=4,
    max_prefills=2,
    max_contexts=0,
    max_batched_tokens=None,
    max_context=None,
    max_waiting=8,
    prefill_chunk=None,
)


class TwoShards:
    """A mesh with a data axis of 2 (`InferenceMesh`'s surface `check_limits` reads)."""

    data = 2

    def __init__(self):
        self.checked = None

    def check(self, config, batch):
        self.checked = batch


def test_defaults_fit_every_slot_and_a_chunk_of_every_prefill_row_and_cap_the_context():
    limits = check_limits(CONFIG, None, **ARGS)
    assert limits.max_batched_tokens == 4 + 2 * DEFAULT_PREFILL_CHUNK
    assert limits.max_context == 8192 and limits.chunk == DEFAULT_PREFILL_CHUNK
    small = types.SimpleNamespace(max_position_embeddings=2048)
    assert check_limits(small, None, **ARGS).max_context == 2048


def test_on_a_mesh_the_defaults_are_a_lane_s_and_the_slots_are_checked_against_the_model():
    mesh = TwoShards()
    limits = check_limits(CONFIG, mesh, **{**ARGS, "prefill_chunk": 64})
    assert limits.max_batched_tokens == 2 + 1 * 64  # a lane: 2 slots, 1 prefill row
    assert mesh.checked == 4
    for name in ("max_slots", "max_prefills", "max_contexts"):
        with pytest.raises(ValueError, match=f"{name}=3 must be a multiple of the mesh's data"):
            check_limits(CONFIG, TwoShards(), **{**ARGS, name: 3})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_slots": 0}, "max_slots=0 must be >= 1"),
        ({"max_prefills": 0}, "max_prefills=0 must be >= 1"),
        ({"max_contexts": -1}, "max_contexts=-1 must be >= 0"),
        ({"max_batched_tokens": 19}, "max_batched_tokens=19 must be >= 20"),
        ({"max_context": 0}, "max_context=0 must be >= 1"),
        ({"max_context": 20000}, "max_context=20000 exceeds the model's"),
        ({"max_waiting": 0}, "max_waiting=0 must be >= 1"),
        ({"prefill_chunk": 0}, "prefill_chunk=0 must be >= 1"),
    ],
)
def test_each_count_out_of_its_range_is_named(change, message):
    with pytest.raises(ValueError, match=message):
        check_limits(CONFIG, None, **{**ARGS, **change})
