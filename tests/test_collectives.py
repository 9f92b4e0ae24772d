"""The collectives of `jaxkv.collectives` on 8 host CPU devices: identities on one device, the
collective inside a sharded program, whichever of the two a jitted caller was traced in first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxkv import collectives, sharding

MESH = sharding.make_inference_mesh(data=2, model=4)
STACKED = PartitionSpec(collectives.MESH_AXES)


def _on_every_device(fn, stacked):
    """fn on each device's slice of stacked [S, ...] (S = 8), outputs stacked again."""

    def per_device(x):
        return fn(x[0])[None]

    return jax.jit(jax.shard_map(per_device, mesh=MESH, in_specs=STACKED, out_specs=STACKED))(
        stacked
    )


def test_a_jitted_helper_traced_on_one_device_has_its_collectives_on_the_mesh():
    helper = jax.jit(lambda x: collectives.reduce_partial_sums(x) + collectives.head_shards())
    values = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
    np.testing.assert_array_equal(helper(values[0]), values[0] + 1)  # traced on one device
    summed = _on_every_device(helper, values)
    per_data_shard = values.reshape(2, 4, 3).sum(axis=1)  # shard s = data s // 4, model s % 4
    expected = np.repeat(np.asarray(per_data_shard), 4, axis=0) + 4
    np.testing.assert_array_equal(summed, expected)
    np.testing.assert_array_equal(helper(values[0]), values[0] + 1)  # and still on one device


def test_global_rows_and_any_shard_on_the_mesh():
    flags = jnp.zeros((8,), bool).at[5].set(True)
    anywhere = _on_every_device(lambda f: collectives.any_shard(f), flags)
    np.testing.assert_array_equal(anywhere, np.ones(8, bool))
    everywhere = _on_every_device(lambda f: collectives.all_shards(f), flags)
    np.testing.assert_array_equal(everywhere, np.zeros(8, bool))
    rows = _on_every_device(lambda _: collectives.global_rows(3), jnp.zeros((8,)))
    np.testing.assert_array_equal(rows, np.repeat(np.arange(6).reshape(2, 3), 4, axis=0))


def test_varying_like_types_a_constant_as_the_values_it_stands_for():
    def branch(x):  # a cond whose skipped branch builds zeros: needs the same manual axes
        zeros = collectives.varying_like(jnp.zeros(x.shape, x.dtype), x)
        return jax.lax.cond(jnp.sum(x) > 0, lambda: x * 2, lambda: zeros)

    values = jnp.arange(8, dtype=jnp.float32) - 3.5
    np.testing.assert_array_equal(
        _on_every_device(branch, values), np.where(values > 0, 2 * values, 0)
    )
    constant = jnp.ones(3)
    assert collectives.varying_like(constant, constant) is constant  # one device: x itself
