"""SAGE-KV's budget split, from the paper's appendix A.2 worked numbers."""

import numpy as np
import pytest

from jaxkv import policies
from jaxkv.policies.sage import sage_split
from tests import policy_references as ref


@pytest.mark.parametrize(
    ("group", "expected"),
    [
        # Llama3.1-8B / ProLong (32 query heads, 8 KV heads): B = 8192 -> 2048 / 1024 / 2048.
        (4, (2048, 1024, 2048)),
        # Qwen2.5-7B (28 query heads, 4 KV heads): 8192 / 14 = 585 -> 512, so the local window
        # is 8192 - 2048 - 7 * 512 = 2560.
        (7, (2048, 512, 2560)),
    ],
)
def test_sage_split_reproduces_the_papers_numbers(group, expected):
    sinks, per_head, recent = sage_split(np.array([8192], np.int32), group)
    assert (int(sinks[0]), int(per_head[0]), int(recent[0])) == expected
    assert ref.sage_split(8192, group) == expected


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8])
def test_sage_split_matches_the_rule_for_every_budget(group):
    budgets = np.arange(4, 700, dtype=np.int32)
    sinks, per_head, recent = (np.asarray(x) for x in sage_split(budgets, group))
    expected = np.array([ref.sage_split(int(b), group) for b in budgets])
    np.testing.assert_array_equal(np.stack([sinks, per_head, recent], axis=1), expected)
    # Every part fits: sinks + G * k + recent is the budget, and the recent window holds at
    # least the last token.
    np.testing.assert_array_equal(sinks + group * per_head + recent, budgets)
    assert np.all(recent >= 1)


@pytest.mark.parametrize("field", ["sinks", "recent"])
def test_sage_rejects_the_split_fields_it_derives_from_the_budget(field):
    with pytest.raises(ValueError, match=f"policy 'sage_kv' takes no sinks= or recent=.*{field}=4"):
        policies.SageKV(budget=64, **{field: 4})
    assert policies.get("sage_kv", budget=64).static().sinks == 0
