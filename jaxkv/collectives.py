"""Collectives of a sharded program, identities on one device, and the logical-axis rules.

A sharded program (`jaxkv.sharding`) runs the single-device code on every device of a (data,
model) mesh; these helpers are the only places where devices meet:
  - `reduce_partial_sums`: the output projection and the MLP's down projection sum their
    partial products over "model" (one all-reduce each per layer);
  - `gather_heads` / `over_all_heads`: policies whose decisions span a layer's KV heads (AdaKV's
    bottom-k, KVzip's and Fast KVzip's global thresholds, TOVA's and Conf-KV's head-averaged
    rankings) gather the scores they rank, never the cache, and keep their own heads' slice;
  - `any_shard` / `all_shards`: loop and branch conditions every device must agree on.
Whether code is inside a sharded program is read from JAX's abstract mesh (the mesh axes are
manual inside `jax.shard_map`), which `jax.jit` keys its traces on: a jitted helper traced on
one device is traced again on the mesh, never reused without its collectives.

`LOGICAL_AXIS_RULES` maps the logical axes of parameters (`jaxkv.models.decoder.PARAM_AXES`, a
policy's `params.axes`) and of the stacked cache to the mesh's axes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

DATA_AXIS = "data"
MODEL_AXIS = "model"
MESH_AXES = (DATA_AXIS, MODEL_AXIS)

# Logical axis -> mesh axis (None: replicated on every device).
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": DATA_AXIS,
    "heads": MODEL_AXIS,
    "kv_heads": MODEL_AXIS,
    "mlp": MODEL_AXIS,
    "cache_shards": MESH_AXES,  # the stacked per-device KV states (and all per-device outputs)
    "layers": None,
    "embed": None,
    "vocab": None,
    "head_dim": None,
    "gate": None,  # a learned gate's own feature axes
}

_SHARDS_SPEC = PartitionSpec(MESH_AXES)


def logical_spec(axes: Sequence[str | None]) -> PartitionSpec:
    """The PartitionSpec of an array whose axes have these logical names (None: replicated)."""
    unknown = [axis for axis in axes if axis is not None and axis not in LOGICAL_AXIS_RULES]
    if unknown:
        raise ValueError(f"logical axes {unknown} are not in LOGICAL_AXIS_RULES")
    return PartitionSpec(*(None if axis is None else LOGICAL_AXIS_RULES[axis] for axis in axes))


def _in_sharded_program() -> bool:
    """Whether the code being traced is one device's share of a sharded program (the mesh's
    axes are manual there)."""
    return set(MESH_AXES) <= set(jax.sharding.get_abstract_mesh().manual_axes)


def head_shards() -> int:
    """How many devices share a layer's KV heads (1 outside a sharded program)."""
    return jax.lax.axis_size(MODEL_AXIS) if _in_sharded_program() else 1


def reduce_partial_sums(x: jax.Array) -> jax.Array:
    """Sums a tensor-parallel partial product (over a device's heads or MLP columns) over the
    model axis; x itself on one device."""
    return jax.lax.psum(x, MODEL_AXIS) if _in_sharded_program() else x


def alike_over_heads(x: jax.Array) -> jax.Array:
    """x, which every device of the model axis holds alike (a row's token ids), typed as
    invariant over that axis (a max over it; x itself on one device). A gradient taken inside a
    sharded program from a residual stream that starts there counts each device's heads once;
    from a stream typed as varying, the all-reduces' transposes would sum every device's copy."""
    return jax.lax.pmax(x, MODEL_AXIS) if _in_sharded_program() else x


def gather_heads(tree: Any, axis: int) -> Any:
    """Every KV head's values of each leaf (its KV-head axis `axis`), in head order."""
    if not _in_sharded_program():
        return tree
    return jax.tree.map(lambda x: jax.lax.all_gather(x, MODEL_AXIS, axis=axis, tiled=True), tree)


def local_heads(x: jax.Array, axis: int) -> jax.Array:
    """This device's KV heads of x (every head on its KV-head axis `axis`)."""
    shards = head_shards()
    if shards == 1:
        return x
    size = x.shape[axis] // shards
    start = jax.lax.axis_index(MODEL_AXIS) * size
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def over_all_heads(fn: Callable[..., jax.Array], *arrays: jax.Array, axis: int) -> jax.Array:
    """fn(*arrays) over every device's KV heads (each array's head axis `axis` gathered; fn's
    result has the same head axis), and this device's heads of the result. The inputs are
    gathered whole, so the result is bit for bit the one device's."""
    return local_heads(fn(*gather_heads(arrays, axis)), axis)


def global_rows(batch: int) -> jax.Array:
    """int32 [batch]: the request's row index of each of this device's `batch` rows, so that
    per-row randomness (`jax.random.fold_in(key, row)`) does not depend on the mesh."""
    rows = jnp.arange(batch, dtype=jnp.int32)
    if not _in_sharded_program():
        return rows
    return rows + jax.lax.axis_index(DATA_AXIS).astype(jnp.int32) * batch


def any_shard(flag: jax.Array) -> jax.Array:
    """bool []: `flag` (bool []) on any device of the program (itself on one device), for
    conditions every device must agree on (a branch or loop holding collectives)."""
    if not _in_sharded_program():
        return flag
    return jax.lax.psum(flag.astype(jnp.int32), MESH_AXES) > 0


def all_shards(flag: jax.Array) -> jax.Array:
    """bool []: `flag` (bool []) on every device of the program."""
    return ~any_shard(~flag)


def _varying_axes(x: jax.Array) -> set[str]:
    """The manual mesh axes x varies over (jax >= 0.10 types say it in `manual_axis_type`,
    earlier ones in `vma`; constants vary over none)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return set(manual.varying if manual is not None else getattr(aval, "vma", ()))


def varying_like(x: Any, *like: jax.Array) -> Any:
    """x (a pytree) typed as varying over every manual mesh axis that the arrays `like` vary
    over, so that constants built inside a sharded program (a skipped branch's zeros, a loop's
    initial carry) have the type of the values they stand for; x itself on one device."""
    axes = set().union(*(_varying_axes(array) for array in like))
    if not axes:
        return x

    def cast(leaf):
        missing = tuple(sorted(axes - _varying_axes(leaf)))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, x)
