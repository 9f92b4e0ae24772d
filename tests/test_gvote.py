"""GVote's two steps on inputs small enough to work by hand (numbers in the comments)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.policies.gvote import nucleus_budget, vote

# Dyadic probabilities, so that every partial sum is exact in f32.
PROBS = [1 / 8, 1 / 2, 1 / 16, 1 / 4, 1 / 16]


@pytest.mark.parametrize(
    ("nucleus", "expected"),
    [
        # Sorted: 1/2, 1/4, 1/8, 1/16, 1/16; running sums 0.5, 0.75, 0.875, 0.9375, 1.
        (0.95, 5),  # 0.9375 < 0.95: all five keys are needed to reach 0.95
        (0.9, 4),  # 0.875 < 0.9 <= 0.9375: the four largest
        (0.8, 3),  # 0.75 < 0.8 <= 0.875
        (0.75, 2),  # 0.5 + 0.25 reaches 0.75 exactly: two keys
        (0.5, 1),  # the largest alone holds half the mass
        (1.0, 5),
    ],
)
def test_nucleus_budget_by_hand(nucleus, expected):
    probs = jnp.asarray([PROBS, PROBS[::-1]], jnp.float32)  # the order does not matter
    np.testing.assert_array_equal(np.asarray(nucleus_budget(probs, nucleus)), [expected] * 2)


# One KV head (H = 2) with G = 2 query heads, one sampled query each; keys
#   k0 = (1, 0), k1 = (0, 1), k2 = (1, 1), k3 = (-1, 0).
KEYS = jnp.asarray([[[[1, 0], [0, 1], [1, 1], [-1, 0]]]], jnp.float32)  # [B=1, K=1, S=4, H=2]
# Query head 0: q = (2, -1): logits q.k = 2, -1, 1, -2; its step budget 1 -> votes {k0}.
# Query head 1: q = (-1, 3): logits -1, 3, 2, 1; its step budget 2 -> votes {k1, k2}.
QUERIES = jnp.asarray([[[[2, -1]], [[-1, 3]]]], jnp.float32)  # [B=1, N=2, X=1, H=2]
BUDGETS = jnp.asarray([[1, 2]], jnp.int32)


def test_one_samples_vote_by_hand():
    held = jnp.ones((1, 1, 4), bool)
    keep = np.asarray(vote(QUERIES, KEYS, held, BUDGETS))
    # The KV head keeps the union of its heads' votes: {k0} | {k1, k2}; k3 gets no vote.
    np.testing.assert_array_equal(keep, [[[True, True, True, False]]])


def test_vote_skips_slots_that_hold_no_token():
    held = jnp.asarray([[[True, True, False, True]]])
    keep = np.asarray(vote(QUERIES, KEYS, held, BUDGETS))
    # Without k2, head 1's two best are k1 (3) and k3 (1); head 0 still votes {k0}.
    np.testing.assert_array_equal(keep, [[[True, True, False, True]]])
