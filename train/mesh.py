"""The training mesh: its axes, how the command line names it, and a batch's share per process.

Three axes; a batch's rows are split over data x fsdp devices:
  data  parameters replicated (gradients all-reduced);
  fsdp  parameters and optimizer state sharded too (gathered per step, FSDP / ZeRO-3);
  seq   each row's tokens split (sequence / context parallelism: one long sequence per step
        over several devices), parameters replicated. Only for stages whose batches have a
        token axis (`sequence_dim`): WG-KV gate training (tokens [B, T]: the frozen forward and
        the loss run on T/seq tokens per device, keys and values gathered for attention) and
        Fast KVzip (rows are tokens: seq splits them like the batch axes). Refused elsewhere.
Any other axis name is refused: the trainer would leave it unused, so its devices would only
repeat the same work. `--mesh data=2,fsdp=4` or `--mesh seq=8` on the command line; see
docs/multi-host.md.
"""

from __future__ import annotations

import argparse
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
SEQ_AXIS = "seq"
ROW_AXES = (DATA_AXIS, FSDP_AXIS)
# In mesh order: data outermost (across hosts), seq innermost (its per-layer gathers stay on a
# host's fast links).
SUPPORTED_AXES = (DATA_AXIS, FSDP_AXIS, SEQ_AXIS)

MESH_HELP = (
    "device mesh as AXIS=SIZE[,AXIS=SIZE], axes data (parameters replicated) and fsdp "
    "(parameters sharded), both splitting batch rows, and seq (each row's tokens split; wgkv "
    "and fastkvzip only). Default: data parallel over as many devices as divide the batch (all "
    "devices with several processes). A size -1 takes the devices left. See docs/multi-host.md"
)


def check_axes(mesh: Mesh, sequence_dim: int | None = None) -> None:
    """Raises ValueError unless every axis of `mesh` is one the trainer uses: "seq" only when
    the batches have a token axis (`sequence_dim`, see `dim_axes`)."""
    unused = [name for name in mesh.axis_names if name not in SUPPORTED_AXES]
    if unused or not mesh.axis_names:
        raise ValueError(
            f"mesh axes {tuple(mesh.axis_names)}: the trainer does not use {tuple(unused)}; "
            f"it splits batch rows over an axis named {DATA_AXIS!r} (parameters replicated) "
            f"and/or {FSDP_AXIS!r} (parameters sharded too), and tokens over {SEQ_AXIS!r}: "
            f"supported axes are {SUPPORTED_AXES}"
        )
    if SEQ_AXIS in mesh.axis_names and sequence_dim is None:
        raise ValueError(
            f"mesh axes {tuple(mesh.axis_names)}: axis {SEQ_AXIS!r} splits each row's tokens, "
            "and this loss has no token axis to split (sequence parallelism is for "
            f"`jaxkv train wgkv` and `fastkvzip`): use the axes {ROW_AXES}"
        )


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch's rows are split over (data and/or fsdp, in mesh order)."""
    return tuple(name for name in mesh.axis_names if name in ROW_AXES)


def dim_axes(mesh: Mesh, sequence_dim: int | None = None) -> tuple[tuple[str, ...], ...]:
    """The mesh axes each leading dimension of a batch array is split over: rows over data x
    fsdp, and the token dimension `sequence_dim` over seq (with 0, rows are tokens and seq
    splits them too)."""
    rows = batch_axes(mesh)
    if SEQ_AXIS not in mesh.axis_names:
        return (rows,)
    if sequence_dim == 0:
        return (rows + (SEQ_AXIS,),)
    return (rows, *[()] * (sequence_dim - 1), (SEQ_AXIS,))


def batch_sharding(mesh: Mesh, sequence_dim: int | None = None) -> NamedSharding:
    spec = [axes or None for axes in dim_axes(mesh, sequence_dim)]
    return NamedSharding(mesh, PartitionSpec(*spec))


def shard_tokens(x: jax.Array, mesh: Mesh | None, token_dim: int = 1) -> jax.Array:
    """`x` [B, ..., T, ...] constrained to rows over the batch axes and dimension `token_dim`
    over seq (unchanged without a mesh or a seq axis). Inside a jitted loss this keeps the
    activations split over tokens; XLA gathers what each device needs (keys and values)."""
    if mesh is None or SEQ_AXIS not in mesh.axis_names:
        return x
    spec = [batch_axes(mesh) or None, *[None] * (token_dim - 1), SEQ_AXIS]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def param_axis(mesh: Mesh, fsdp: bool) -> str | None:
    """The axis parameters are sharded over: "fsdp" when the mesh has it, else "data" when
    `fsdp` (one axis for both batch and parameters), else None (replicated)."""
    if FSDP_AXIS in mesh.axis_names:
        return FSDP_AXIS
    return DATA_AXIS if fsdp and DATA_AXIS in mesh.axis_names else None


def make_mesh(devices=None, *, fsdp: int = 1) -> Mesh:
    """A mesh over `devices` (all devices of all processes by default): axis "data" alone, or
    ("data", "fsdp") with `fsdp` devices per fsdp group when `fsdp` > 1."""
    devices = list(jax.devices() if devices is None else np.asarray(devices).reshape(-1))
    if fsdp == 1:
        return jax.make_mesh((len(devices),), (DATA_AXIS,), (AxisType.Auto,), devices=devices)
    if len(devices) % fsdp:
        raise ValueError(f"fsdp={fsdp} does not divide the {len(devices)} devices")
    shape = (len(devices) // fsdp, fsdp)
    return jax.make_mesh(shape, ROW_AXES, (AxisType.Auto,) * 2, devices=devices)


def parse_mesh(text: str) -> dict[str, int]:
    """ "data=2,fsdp=4" -> {"data": 2, "fsdp": 4} (ValueError naming what is wrong)."""
    sizes: dict[str, int] = {}
    for item in text.split(","):
        name, equals, value = item.strip().partition("=")
        if not equals:
            raise ValueError(f"--mesh {text!r}: {item!r} is not AXIS=SIZE")
        if name not in SUPPORTED_AXES:
            raise ValueError(
                f"--mesh {text!r}: axis {name!r} is not used by the trainer; supported axes "
                f"are {SUPPORTED_AXES}"
            )
        if name in sizes:
            raise ValueError(f"--mesh {text!r}: axis {name!r} given twice")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(
                f"--mesh {text!r}: size {value!r} of {name!r} is not an integer"
            ) from None
        if sizes[name] < 1 and sizes[name] != -1:
            raise ValueError(f"--mesh {text!r}: {name}={sizes[name]} must be >= 1 or -1")
    if list(sizes.values()).count(-1) > 1:
        raise ValueError(f"--mesh {text!r}: at most one axis may be -1")
    return sizes


def _check_device_count(needed: int, text: str) -> None:
    available = jax.device_count()
    if needed <= available:
        return
    if jax.process_count() == 1 and not jax.distributed.is_initialized():
        raise ValueError(
            f"--mesh {text}: needs {needed} devices and this process sees {available}; "
            "jax.distributed is not initialised: for a mesh over several hosts start one "
            "process per host with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
            "JAX_PROCESS_ID set (see docs/multi-host.md)"
        )
    raise ValueError(
        f"--mesh {text}: needs {needed} devices, the {jax.process_count()} processes have "
        f"{available}"
    )


def mesh_from_sizes(sizes: dict[str, int], text: str = "") -> Mesh:
    """The mesh of `parse_mesh`'s sizes over the first devices (all of them with several
    processes: every process must hold a share of the mesh)."""
    text = text or ",".join(f"{k}={v}" for k, v in sizes.items())
    names = tuple(name for name in SUPPORTED_AXES if name in sizes)
    shape = [sizes[name] for name in names]
    if -1 in shape:
        known = math.prod(size for size in shape if size != -1)
        if jax.device_count() % known:
            raise ValueError(f"--mesh {text}: {known} does not divide {jax.device_count()}")
        shape[shape.index(-1)] = jax.device_count() // known
    needed = math.prod(shape)
    _check_device_count(needed, text)
    if jax.process_count() > 1 and needed != jax.device_count():
        raise ValueError(
            f"--mesh {text}: {needed} devices, but the {jax.process_count()} processes have "
            f"{jax.device_count()}; with several processes the mesh must span all of them"
        )
    devices = jax.devices()[:needed]
    return jax.make_mesh(tuple(shape), names, (AxisType.Auto,) * len(names), devices=devices)


def default_mesh(batch_rows: int) -> Mesh:
    """Data parallel over the most devices that divide `batch_rows` (one process), or over all
    devices (several processes: each must hold a share)."""
    if jax.process_count() > 1:
        return make_mesh()
    count = max(n for n in range(1, jax.device_count() + 1) if batch_rows % n == 0)
    return make_mesh(jax.devices()[:count])


def cli_mesh(
    text: str | None,
    batch_rows: int,
    batch_flag: str = "--batch-size",
    *,
    sequence_dim: int | None = None,
    seq_len: int = 0,
    seq_flag: str = "--seq-len",
) -> Mesh:
    """The mesh of a stage's `--mesh` (or the default), checked against its batch rows and,
    with a seq axis, its tokens per row `seq_len` (`sequence_dim` as in `dim_axes`)."""
    if text is None:
        return default_mesh(batch_rows)
    mesh = mesh_from_sizes(parse_mesh(text), text)
    check_axes(mesh, sequence_dim)
    row_axes = dim_axes(mesh, sequence_dim)[0]
    shards = math.prod(mesh.shape[name] for name in row_axes)
    shape = ", ".join(f"{name}={mesh.shape[name]}" for name in mesh.axis_names)
    if batch_rows % shards:
        raise ValueError(
            f"--mesh {text} ({shape}) splits batch rows over {shards} devices, and the batch "
            f"has {batch_rows} rows: make {batch_flag} a multiple of {shards}, or pass "
            f"--mesh data=1"
        )
    if sequence_dim and SEQ_AXIS in mesh.axis_names and seq_len % mesh.shape[SEQ_AXIS]:
        raise ValueError(
            f"--mesh {text} ({shape}) splits each row's {seq_len} tokens over "
            f"{SEQ_AXIS}={mesh.shape[SEQ_AXIS]} devices: make {seq_flag} a multiple of "
            f"{mesh.shape[SEQ_AXIS]}"
        )
    return mesh


def add_mesh_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", default=None, metavar="AXIS=SIZE[,AXIS=SIZE]", help=MESH_HELP)


def local_blocks(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """How many distinct blocks along the mesh `axes` this process's devices hold (1 for none)."""
    here = jax.process_index()
    dims = [mesh.axis_names.index(name) for name in axes]
    return len(
        {
            tuple(index[d] for d in dims)
            for index, device in np.ndenumerate(mesh.devices)
            if device.process_index == here
        }
    )


def process_share(
    batch: dict[str, np.ndarray], mesh: Mesh, sequence_dim: int | None = None
) -> dict[str, np.ndarray]:
    """This process's share of a global batch (the same on every process): the rows (and with
    a seq axis, the tokens) its devices hold under the batch sharding, for `trainer.train`'s
    process-local batches."""
    if jax.process_count() == 1:
        return batch
    sharding = batch_sharding(mesh, sequence_dim)
    return {name: array[_local_box(sharding, np.shape(array))] for name, array in batch.items()}


def _local_box(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[slice, ...]:
    indices = sharding.addressable_devices_indices_map(shape).values()
    box = []
    for dim, size in enumerate(shape):
        blocks = sorted({index[dim].indices(size)[:2] for index in indices})
        first, last = blocks[0][0], blocks[-1][1]
        if sum(stop - start for start, stop in blocks) != last - first:
            raise ValueError(f"this process's share of batch dimension {dim} is not contiguous")
        box.append(slice(first, last))
    return tuple(box)
