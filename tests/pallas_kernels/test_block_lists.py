"""Block-list builders list exactly the blocks their token-level masks touch."""

import numpy as np
import pytest

from jaxkv import pallas_kernels as pk
from tests.pallas_kernels import brute_force

SHAPES = [(64, 16, 16), (50, 16, 32), (77, 32, 16), (100, 64, 64)]  # (T, block_q, block_k)


def _check_lists(lists, token_mask, block_q, block_k):
    """Lists match the block mask of `token_mask` [B, M, T, T] exactly (nothing missing, nothing
    extra), entries valid first and ascending."""
    idx, cnt = (np.asarray(x) for x in lists)
    expected = brute_force.block_mask_of_token_mask(token_mask, block_q, block_k)
    np.testing.assert_array_equal(
        brute_force.block_mask_of_lists(idx, cnt, expected.shape[-1]), expected
    )


def _causal(num_tokens):
    i, j = np.indices((num_tokens, num_tokens))
    return j <= i, i - j


@pytest.mark.parametrize("num_tokens,block_q,block_k", SHAPES)
def test_dense_causal(num_tokens, block_q, block_k):
    causal, _ = _causal(num_tokens)
    lists = pk.dense_causal_block_lists(2, 3, num_tokens, block_q=block_q, block_k=block_k)
    assert lists[0].shape == (2, 3, -(-num_tokens // block_q), -(-num_tokens // block_k))
    _check_lists(lists, np.broadcast_to(causal, (2, 3, num_tokens, num_tokens)), block_q, block_k)


@pytest.mark.parametrize("num_tokens,block_q,block_k", SHAPES)
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 1000])
def test_sliding_window(num_tokens, block_q, block_k, window):
    causal, distance = _causal(num_tokens)
    lists = pk.sliding_window_block_lists(
        1, 2, num_tokens, window=window, block_q=block_q, block_k=block_k
    )
    mask = causal & (distance < window)
    _check_lists(lists, np.broadcast_to(mask, (1, 2, num_tokens, num_tokens)), block_q, block_k)


@pytest.mark.parametrize("num_tokens,block_q,block_k", SHAPES)
@pytest.mark.parametrize("window,density", [(0, 0.05), (3, 0.0), (8, 0.1), (20, 0.02), (9, 1.0)])
def test_vertical_slash(num_tokens, block_q, block_k, window, density):
    rng = np.random.default_rng(num_tokens + window)
    admitted = rng.random((2, 3, num_tokens)) < density
    causal, distance = _causal(num_tokens)
    mask = causal & ((distance < window) | admitted[:, :, None, :])
    lists = pk.vertical_slash_block_lists(admitted, window=window, block_q=block_q, block_k=block_k)
    _check_lists(lists, mask, block_q, block_k)


def test_block_lists_from_mask_truncates_and_zero_fills():
    listed = np.array([[True, False, True, True], [False, False, False, False]])
    idx, cnt = pk.block_lists_from_mask(listed, max_entries=2)
    np.testing.assert_array_equal(idx, [[0, 2], [0, 0]])
    np.testing.assert_array_equal(cnt, [2, 0])


def test_bad_windows():
    with pytest.raises(ValueError, match="window"):
        pk.sliding_window_block_lists(1, 1, 8, window=0, block_q=16, block_k=16)
    with pytest.raises(ValueError, match="window"):
        pk.vertical_slash_block_lists(np.zeros((1, 1, 8), bool), window=-1, block_q=16, block_k=16)


@pytest.mark.parametrize("num_tokens,block_q,block_k", SHAPES)
def test_unmasked_prefix_counts_the_leading_fully_visible_blocks(num_tokens, block_q, block_k):
    """The forward kernel skips masking for exactly the leading entries whose every key every
    row of the query block sees (causally and inside the sequence); unordered lists included."""
    from jaxkv.pallas_kernels.block_sparse.kernel import unmasked_prefix

    rng = np.random.default_rng(num_tokens)
    nq, nk = -(-num_tokens // block_q), -(-num_tokens // block_k)
    idx = np.stack([rng.permutation(nk) for _ in range(2 * nq)]).reshape(1, 2, nq, nk)
    idx[:, 0] = np.sort(idx[:, 0], axis=-1)  # head 0 ascending, head 1 shuffled
    cnt = rng.integers(0, nk + 1, (1, 2, nq))
    got = np.asarray(
        unmasked_prefix(idx, cnt, block_q=block_q, block_k=block_k, num_tokens=num_tokens)
    )
    for h in range(2):
        for i in range(nq):
            expected = 0
            for entry in range(cnt[0, h, i]):
                keys = np.arange(idx[0, h, i, entry] * block_k, (idx[0, h, i, entry] + 1) * block_k)
                rows = np.arange(i * block_q, min((i + 1) * block_q, num_tokens))
                if not (keys.max() < num_tokens and keys.max() <= rows.min()):
                    break
                expected += 1
            assert got[0, h, i] == expected
