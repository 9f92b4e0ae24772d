"""Sharded inference: `generate` and `compress_prompt` on a (data, model) device mesh.

Every device runs the single-device program (`jax.shard_map`) on its share:
  data   batch rows: data shard i holds rows [i * B/d, (i + 1) * B/d);
  model  KV heads: model shard j holds KV heads [j * K/m, (j + 1) * K/m), their query heads,
         and columns [j * F/m, (j + 1) * F/m) of the MLP (tensor parallelism).
A device's KV state is a whole paged state of its own (pool, page tables, allocator) for its
rows and heads, so it holds and reads only its share of the cache. Outside the devices those
states are stacked on a leading shard axis [S = d * m] (shard s = data shard s // m, model shard
s % m), which is the one sharded array axis.

Devices meet only in the collectives of `jaxkv.collectives` (identities on one device, so the
same policy code runs on one device and on a mesh), which also holds the logical-axis rules
that place parameters and the stacked cache on the mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from jaxkv.collectives import DATA_AXIS, MESH_AXES, MODEL_AXIS, logical_spec
from jaxkv.models.configs import ModelConfig
from jaxkv.models.decoder import PARAM_AXES, Model

_SHARDS_SPEC = PartitionSpec(MESH_AXES)  # the stacked per-device values: one entry per device


def to_host(x: ArrayLike) -> np.ndarray:
    """x on the host, whole: with several processes an array spread over their devices is
    gathered from all of them (every process must call this); small values only."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def make_inference_mesh(
    data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (data, model) mesh over the first data * model devices (Auto axes)."""
    for name, size in (("data", data), ("model", model)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name}={size!r} must be an integer >= 1")
    devices = list(jax.devices() if devices is None else devices)
    if data * model > len(devices):
        hint = ""
        if jax.process_count() == 1 and not jax.distributed.is_initialized():
            hint = (
                "; jax.distributed is not initialised: for a mesh over several hosts, call "
                "jax.distributed.initialize() in every process first (docs/multi-host.md)"
            )
        raise ValueError(
            f"mesh data={data} x model={model} needs {data * model} devices, "
            f"{len(devices)} are visible{hint}"
        )
    return jax.make_mesh(
        (data, model), MESH_AXES, (AxisType.Auto,) * 2, devices=devices[: data * model]
    )


def mesh_from_text(text: str) -> Mesh:
    """The mesh a command line's `--mesh DATAxMODEL` names (`make_inference_mesh`), e.g. "2x4"."""
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if match is None:
        raise ValueError(f"--mesh {text}: give the mesh's sizes as DATAxMODEL, e.g. 2x4")
    return make_inference_mesh(data=int(match[1]), model=int(match[2]))


@dataclasses.dataclass(frozen=True)
class InferenceMesh:
    """A checked (data, model) mesh and how a request's arrays are laid out on it (static,
    hashable: jit sees it as a static argument)."""

    mesh: Mesh

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise ValueError(f"mesh={self.mesh!r} must be a jax.sharding.Mesh")
        if tuple(self.mesh.axis_names) != MESH_AXES:
            raise ValueError(
                f"mesh axes {tuple(self.mesh.axis_names)}: inference meshes have the axes "
                f"{MESH_AXES} (batch rows, KV heads), sizes >= 1; build one with "
                "jaxkv.sharding.make_inference_mesh(data=, model=)"
            )

    @property
    def data(self) -> int:
        return self.mesh.shape[DATA_AXIS]

    @property
    def model(self) -> int:
        return self.mesh.shape[MODEL_AXIS]

    @property
    def num_shards(self) -> int:
        return self.data * self.model

    def check(self, cfg: ModelConfig, batch: int) -> None:
        """Raises ValueError unless the axes divide the batch, the heads and the MLP."""
        if batch % self.data:
            raise ValueError(
                f"mesh axis 'data' has {self.data} devices and the batch {batch} prompts: the "
                f"batch must be a multiple of {self.data}"
            )
        for name, size in (
            ("num_kv_heads", cfg.num_kv_heads),
            ("num_heads", cfg.num_heads),
            ("intermediate_size", cfg.intermediate_size),
        ):
            if size % self.model:
                raise ValueError(
                    f"mesh axis 'model' has {self.model} devices and the model's "
                    f"{name}={size}: it must be a multiple of {self.model}"
                )

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of one device's share of the model (its heads and MLP columns)."""
        return dataclasses.replace(
            cfg,
            num_heads=cfg.num_heads // self.model,
            num_kv_heads=cfg.num_kv_heads // self.model,
            intermediate_size=cfg.intermediate_size // self.model,
        )

    def row_groups(self, batch: int) -> list[np.ndarray]:
        """The batch rows of each data shard."""
        return np.split(np.arange(batch), self.data)

    def rows_per_device(self, array: ArrayLike) -> np.ndarray:
        """[B, ...] -> [S, B/d, ...] (host): each device's rows (repeated over model)."""
        array = np.asarray(array)
        rows = array.reshape(self.data, array.shape[0] // self.data, *array.shape[1:])
        return np.repeat(rows, self.model, axis=0)

    def split_rows(self, array: ArrayLike) -> jax.Array:
        """[B, ...] -> [S, B/d, ...] on the mesh, each device holding its rows."""
        return jax.device_put(self.rows_per_device(array), NamedSharding(self.mesh, _SHARDS_SPEC))

    def join_rows(self, stacked: ArrayLike) -> np.ndarray:
        """[S, B/d, ...] -> [B, ...] (host): the rows of model shard 0 of each data shard."""
        stacked = to_host(stacked)
        return stacked[:: self.model].reshape(-1, *stacked.shape[2:])

    def unshard(
        self, stacked: ArrayLike, row_axis: int, head_axis: int | None = None
    ) -> np.ndarray:
        """Per-device arrays stacked [S, ...] -> the whole request's array (host): the devices'
        rows joined on `row_axis` and KV heads on `head_axis` (axes of one device's array;
        None: replicated over "model", model shard 0's is taken)."""
        x = to_host(stacked)
        x = x.reshape(self.data, self.model, *x.shape[1:])
        if head_axis is None:
            return np.concatenate(list(x[:, 0]), axis=row_axis)
        data_shards = [np.concatenate(list(x[i]), axis=head_axis) for i in range(self.data)]
        return np.concatenate(data_shards, axis=row_axis)

    def sum_shards(self, stacked: ArrayLike) -> np.ndarray:
        """[S, ...] -> [...] (host): the sum over every shard (pages, bytes)."""
        return to_host(stacked).sum(axis=0)

    def param_specs(self, params: Any, axes: Any) -> Any:
        """PartitionSpecs of `params` from their logical axes (`axes`: the same tree with a
        tuple of axis names per leaf; None: replicated)."""
        if axes is None:
            return jax.tree.map(lambda _: PartitionSpec(), params)
        return jax.tree.map(
            lambda _, names: logical_spec(names), params, axes, is_leaf=lambda x: x is None
        )

    def model_specs(self, model: Model) -> Model:
        params_axes = {name: PARAM_AXES[name] for name in model.params if name != "layers"} | {
            "layers": {name: PARAM_AXES["layers"][name] for name in model.params["layers"]}
        }
        return dataclasses.replace(model, params=self.param_specs(model.params, params_axes))

    def place_policy_params(self, policy, params: Any) -> Any:
        """The policy's parameters split by `policy.params.axes` (None stays None)."""
        if params is None:
            return None
        return self.place(params, self.param_specs(params, policy.params.axes(params)))

    def place(self, tree: Any, specs: Any) -> Any:
        """`tree` put on the mesh by `specs` (a PartitionSpec tree of the same structure). With
        several processes every one passes the same values, from the host."""
        shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs)
        if jax.process_count() > 1:
            tree = jax.tree.map(to_host, tree)
        return jax.device_put(tree, shardings)

    def run(
        self,
        fn: Callable,
        kinds: tuple[str, ...],
        args: tuple,
        statics: dict[str, Any],
    ) -> Any:
        """fn(*args, **statics) as a sharded program: every device runs it on its share.

        kinds, one per argument:
          "model"   the Model: its params split by `PARAM_AXES`, the config made local;
          "params"  the policy's parameters, split by the `policy` static's `params.axes`;
          "rows"    a batch array [B, ...] (host), or a pytree of them: each shard gets its
                    rows;
          "shard" / "donate"  per-shard values stacked [S, ...] (a previous run's output);
                    "donate" hands the buffers to the program;
          "same"    the same value on every device.
        Returns fn's outputs, every leaf stacked [S, ...] (one entry per shard).
        """
        if len(kinds) != len(args):
            raise ValueError(f"{len(kinds)} kinds for {len(args)} arguments")
        policy = statics.get("policy")  # splits "params" (`policy.params.axes`)
        placed = []
        for kind, arg in zip(kinds, args, strict=True):
            if kind == "rows":  # an array or a pytree of them (`jaxkv.step.rows.Rows`)
                arg = jax.tree.map(self.split_rows, arg)
            elif kind == "model":  # a no-op when already placed (`generate` places it once)
                arg = self.place(arg, self.model_specs(arg))
            elif kind == "params":
                arg = self.place_policy_params(policy, arg)
            placed.append(arg)
        program = _sharded_program(fn, kinds, tuple(sorted(statics.items())), self, policy)
        return program(*placed)


@functools.lru_cache(maxsize=256)
def _sharded_program(fn, kinds, statics, inference_mesh: InferenceMesh, policy):
    """The jitted shard_map of fn for these argument kinds and static arguments (cached, so a
    request of the same shapes reuses the compiled program)."""
    donate = tuple(i for i, kind in enumerate(kinds) if kind == "donate")

    def program(*args):
        specs = []
        for kind, arg in zip(kinds, args, strict=True):
            if kind == "model":
                specs.append(inference_mesh.model_specs(arg))
            elif kind == "params":
                axes = None if arg is None else policy.params.axes(arg)
                specs.append(inference_mesh.param_specs(arg, axes))
            elif kind == "same":
                specs.append(PartitionSpec())
            else:
                specs.append(_SHARDS_SPEC)

        def per_device(*local):
            local = list(local)
            for i, kind in enumerate(kinds):
                if kind == "model":
                    cfg = inference_mesh.local_config(local[i].config)
                    local[i] = dataclasses.replace(local[i], config=cfg)
                elif kind in ("rows", "shard", "donate"):
                    local[i] = jax.tree.map(lambda x: x[0], local[i])
            out = fn(*local, **dict(statics))
            return jax.tree.map(lambda x: jnp.asarray(x)[None], out)

        return jax.shard_map(
            per_device,
            mesh=inference_mesh.mesh,
            in_specs=tuple(specs),
            out_specs=_SHARDS_SPEC,
        )(*args)

    # Named after fn, so that profiles and HLO dumps say which program this is.
    program.__name__ = f"sharded_{getattr(fn, '__name__', 'program')}"
    return jax.jit(program, donate_argnums=donate)


def as_inference_mesh(mesh: Mesh | InferenceMesh | None) -> InferenceMesh | None:
    if mesh is None or isinstance(mesh, InferenceMesh):
        return mesh
    return InferenceMesh(mesh)
