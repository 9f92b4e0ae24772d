"""The Conf-KV benchmark's teacher-forced reader runs the policy's decode hook as `generate`."""

import numpy as np
import pytest

from jaxkv import bundled, policies
from jaxkv.benchmarks import confkv as bench
from jaxkv.models import load_hf_checkpoint


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL)


@pytest.mark.parametrize("evict_every", [1, 8])
def test_teacher_forced_read_holds_the_budget_on_due_steps(model, evict_every):
    text = b"def area(width, height):\n    return width * height\n\n" * 4
    settings = bench.Settings(prefix=96, continuation=48, bins=2)
    policy = policies.ConfKV(tight=24, loose=40, protected=8, evict_every=evict_every)
    result = bench.teacher_forced(model, policy, [text], settings)
    held = np.asarray(result["trace"]["tokens_per_head"])
    assert np.isfinite(result["bits_per_byte"])
    assert held.max() <= 40 + evict_every
    due = np.arange(1, len(held) + 1) % evict_every == 0
    assert np.all(held[due] <= 40)
    assert held.min() >= 24
