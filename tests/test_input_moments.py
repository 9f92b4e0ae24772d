"""Prefill statistics gathered chunk by chunk and combined exactly: GVote's per-channel
attention-input moments, ExpectedAttention's per-head query covariances."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.step.forward import chunk_covariance, chunk_moments, combine_covariances, combine_moments


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_moments_over_chunks_equal_numpy_with_a_large_mean_and_small_variance(chunk):
    rng = np.random.default_rng(0)
    lengths = np.array([64, 45])
    # f32 sums of squares lose everything here: mean^2 = 1e6, variance 1e-2.
    h = (1e3 + 1e-1 * rng.standard_normal((2, 64, 8))).astype(np.float32)
    count = jnp.zeros((2, 1))
    mean = m2 = jnp.zeros((2, 8))
    for start in range(0, 64, chunk):
        index = np.arange(start, min(start + chunk, 64))
        valid = jnp.asarray(index[None, :] < lengths[:, None])[..., None]
        chunk_mean, chunk_m2 = chunk_moments(jnp.asarray(h[:, index]), valid)
        seen = jnp.sum(valid, axis=1).astype(jnp.float32)
        count, mean, m2 = combine_moments(count, mean, m2, seen, chunk_mean, chunk_m2)
    for b, n in enumerate(lengths):
        rows = h[b, :n].astype(np.float64)
        np.testing.assert_allclose(np.asarray(mean[b]), rows.mean(0), rtol=1e-6)
        variance = np.asarray(m2[b]) / (n - 1)
        np.testing.assert_allclose(variance, rows.var(0, ddof=1), rtol=1e-3)
        # The sums-of-squares form this replaces: nowhere near.
        sums = h[b, :n].sum(0, dtype=np.float32), (h[b, :n] ** 2).sum(0, dtype=np.float32)
        naive = (sums[1] - n * (sums[0] / n) ** 2) / (n - 1)
        assert np.max(np.abs(naive - rows.var(0, ddof=1))) > 10 * rows.var(0, ddof=1).max()


@pytest.mark.parametrize("chunk", [1, 5, 32])
def test_covariances_over_chunks_equal_numpy_with_a_large_mean(chunk):
    rng = np.random.default_rng(1)
    lengths = np.array([32, 19])
    mixing = rng.standard_normal((4, 4))
    x = (1e3 + 1e-1 * rng.standard_normal((2, 3, 32, 4)) @ mixing).astype(np.float32)
    count = jnp.zeros((2, 1, 1))
    mean, m2 = jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 4, 4))
    for start in range(0, 32, chunk):
        index = np.arange(start, min(start + chunk, 32))
        valid = jnp.asarray(index[None, :] < lengths[:, None])[:, None, :, None]
        chunk_mean, chunk_m2 = chunk_covariance(jnp.asarray(x[:, :, index]), valid)
        seen = jnp.sum(valid, axis=(1, 2)).astype(jnp.float32)[..., None]
        count, mean, m2 = combine_covariances(count, mean, m2, seen, chunk_mean, chunk_m2)
    for b, n in enumerate(lengths):
        for head in range(3):
            rows = x[b, head, :n].astype(np.float64)
            np.testing.assert_allclose(np.asarray(mean[b, head]), rows.mean(0), rtol=1e-6)
            covariance = np.asarray(m2[b, head]) / n
            expected = np.cov(rows, rowvar=False, bias=True)
            np.testing.assert_allclose(covariance, expected, atol=1e-3 * np.abs(expected).max())
