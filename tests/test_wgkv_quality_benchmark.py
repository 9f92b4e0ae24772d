"""The WG-KV quality benchmark's equal-memory baselines: a local window of WG-KV's bytes, and
Duo-style runs at the whole-head counts bracketing them."""

import numpy as np
import pytest

from jaxkv import policies
from jaxkv.benchmarks import wgkv_quality
from jaxkv.models import init_model
from tests.tiny_models import tiny_config

WINDOW = 8


@pytest.fixture(scope="module")
def model():
    return init_model(tiny_config(num_layers=3), seed=0)


@pytest.mark.parametrize(("wgkv_share", "counts"), [(0.25, [1, 2]), (0.5, [3])])
def test_equal_memory_runs_bracket_wgkv_memory(model, wgkv_share, counts):
    slot = wgkv_quality.ring_bytes_per_slot(model)
    ring, full = WINDOW * slot, 1000 * slot
    wgkv_memory = ring + wgkv_share * (full - ring)
    scores = np.arange(6.0).reshape(3, 2)  # 3 layers x 2 KV heads: 6 heads
    runs = wgkv_quality.equal_memory_runs(model, scores, wgkv_memory, full, window=WINDOW, tau=0.1)
    label, local, params = runs[0]
    assert label == "local_attention" and params is None
    assert isinstance(local, policies.LocalAttention)
    assert (
        (local.window + local.sinks) * slot <= wgkv_memory < (local.window + local.sinks + 1) * slot
    )
    duo = runs[1:]
    assert [label for label, _, _ in duo] == [f"duo_attention {c}/6 heads" for c in counts]
    for (_, policy, chosen), count in zip(duo, counts, strict=True):
        assert isinstance(policy, policies.DuoAttention) and policy.window == WINDOW
        assert chosen.sum() == count
        # The highest-scoring heads retrieve.
        np.testing.assert_array_equal(np.sort(scores[chosen]), np.arange(6 - count, 6.0))


def test_table_names_the_samples_behind_each_cell():
    row = {"gates": "lambda-0.08", "policy": "wgkv", "task": "needle", "samples": 16}
    table = wgkv_quality.markdown_table([{**row, "kv_bytes_per_sequence": 2048, "accuracy": 0.5}])
    header, _, line = table.splitlines()
    assert header.endswith("| accuracy | samples |")
    assert line == "| lambda-0.08 | wgkv | needle |  | 2 | 0.50 | 16 |"
