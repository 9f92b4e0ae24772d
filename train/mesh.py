"""The training mesh: its axes, how the command line names it, and a batch's share per process.

Two axes, both data parallel for the batch (its rows are split over data x fsdp devices):
  data  parameters replicated (gradients all-reduced);
  fsdp  parameters and optimizer state sharded too (gathered per step, FSDP / ZeRO-3).
Any other axis name is refused: the trainer would leave it unused, so its devices would only
repeat the same work. `--mesh data=2,fsdp=4` on the command line; see docs/multi-host.md.
"""

from __future__ import annotations

import argparse
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
SUPPORTED_AXES = (DATA_AXIS, FSDP_AXIS)  # in mesh order: data outermost (across hosts)

MESH_HELP = (
    "device mesh as AXIS=SIZE[,AXIS=SIZE], axes data (parameters replicated) and fsdp "
    "(parameters sharded); batch rows are split over both. Default: data parallel over as many "
    "devices as divide the batch (all devices with several processes). A size -1 takes the "
    "devices left. See docs/multi-host.md"
)


def check_axes(mesh: Mesh) -> None:
    """Raises ValueError unless every axis of `mesh` is one the trainer uses."""
    unused = [name for name in mesh.axis_names if name not in SUPPORTED_AXES]
    if unused or not mesh.axis_names:
        raise ValueError(
            f"mesh axes {tuple(mesh.axis_names)}: the trainer does not use {tuple(unused)}; "
            f"it splits batch rows over an axis named {DATA_AXIS!r} (parameters replicated) "
            f"and/or {FSDP_AXIS!r} (parameters sharded too): supported axes are {SUPPORTED_AXES}"
        )


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch's rows are split over (all of them, in mesh order)."""
    return tuple(name for name in mesh.axis_names if name in SUPPORTED_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


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
    return jax.make_mesh(shape, SUPPORTED_AXES, (AxisType.Auto,) * 2, devices=devices)


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


def cli_mesh(text: str | None, batch_rows: int, batch_flag: str = "--batch-size") -> Mesh:
    """The mesh of a stage's `--mesh` (or the default), checked against its batch rows."""
    if text is None:
        return default_mesh(batch_rows)
    mesh = mesh_from_sizes(parse_mesh(text), text)
    shards = math.prod(mesh.shape[name] for name in batch_axes(mesh))
    if batch_rows % shards:
        shape = ", ".join(f"{name}={mesh.shape[name]}" for name in mesh.axis_names)
        raise ValueError(
            f"--mesh {text} ({shape}) splits batch rows over {shards} devices, and the batch "
            f"has {batch_rows} rows: make {batch_flag} a multiple of {shards}, or pass "
            f"--mesh data=1"
        )
    return mesh


def add_mesh_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", default=None, metavar="AXIS=SIZE[,AXIS=SIZE]", help=MESH_HELP)


def local_batch_shards(mesh: Mesh) -> int:
    """How many distinct row blocks of the batch this process's devices hold."""
    here = jax.process_index()
    return sum(device.process_index == here for device in mesh.devices.flat)


def process_rows(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, np.ndarray]:
    """This process's share of a global batch (the same on every process): the rows its
    devices hold under the batch sharding, for `trainer.train`'s process-local batches."""
    if jax.process_count() == 1:
        return batch
    rows = {len(array) for array in batch.values()}
    if len(rows) != 1:
        raise ValueError(f"batch arrays have different row counts {sorted(rows)}")
    (total,) = rows
    indices = batch_sharding(mesh).addressable_devices_indices_map((total,)).values()
    starts = sorted({index[0].indices(total)[:2] for index in indices})
    first, last = starts[0][0], starts[-1][1]
    if sum(stop - start for start, stop in starts) != last - first:
        raise ValueError("this process's batch rows are not contiguous in the mesh")
    return {name: array[first:last] for name, array in batch.items()}
