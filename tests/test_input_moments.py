"""GVote's per-channel attention-input statistics: chunk-wise two-pass moments combined exactly."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.forward import chunk_moments, combine_moments


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
