"""The one trainer of the project: optax, a device mesh, orbax checkpoints, JSON-lines metrics.

A run is a pure function of its inputs: `batch_for_step(step)` must give the same batch for the
same step, so that a run resumed from a checkpoint reaches the same parameters as one that never
stopped. The mesh (`jaxkv.train.mesh`) has the axes "data", "fsdp" and "seq": batch rows are
split over data and fsdp; every parameter's largest divisible axis is sharded over "fsdp" (or
over "data" with `fsdp=True` and no "fsdp" axis), and the optimizer state follows. "seq"
splits the batch's token axis (`train`'s `sequence_dim`; the loss keeps its activations split
with `jaxkv.train.mesh.shard_tokens`) and is refused for losses without one. Other axes are
refused.

Multi-host: call `jax.distributed.initialize()` (coordinator address, process count and id from
the environment or arguments) before building the mesh; `make_mesh()` then spans every process's
devices, and each process's `batch_for_step` returns its own share of the batch: the rows its
devices hold (`jaxkv.train.mesh.process_share` cuts it from a global batch, tokens too with a seq
axis), as many on every process and a multiple of its devices in the mesh. The global batch is
built from the shares with `jax.make_array_from_process_local_data`; with one process the share
is the whole batch.
Metrics are written by process 0 only. See docs/multi-host.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxkv.train import mesh as mesh_lib
from jaxkv.train.mesh import DATA_AXIS, FSDP_AXIS, make_mesh  # noqa: F401  (re-exported)

# Where a run resumed and each checkpoint it saved, for a log file (the CLI shows the `jaxkv`
# logger on stderr); a terminal sees the progress bar instead.
LOG = logging.getLogger(__name__)

Params = Any
Batch = dict[str, np.ndarray]
LossFn = Callable[[Params, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping of one run.

    Attributes:
      steps: optimizer steps in all.
      learning_rate: peak of the warmup + cosine schedule (decays to `final_lr_fraction` of it).
      warmup_steps: linear warmup from 0.
      weight_decay: AdamW decoupled weight decay (applied to matrices only, not norms/biases).
      grad_clip: global-norm clip.
      b1, b2: Adam moments.
      checkpoint_every: save every this many steps (and at the end); 0 disables checkpoints.
      keep_checkpoints: how many recent checkpoints orbax keeps.
      log_every: metrics are written every this many steps.
      fsdp: shard parameters and optimizer state over the data axis as well as the batch (a
        mesh with an "fsdp" axis shards them over that axis whatever this says).
    """

    steps: int
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    log_every: int = 10
    fsdp: bool = False

    def __post_init__(self):
        if self.steps <= 0:
            raise ValueError(f"steps={self.steps} must be > 0")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must lie in [0, steps)")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be > 0")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1 or self.log_every < 1:
            raise ValueError(
                "checkpoint_every must be >= 0, keep_checkpoints and log_every >= 1; got "
                f"{self.checkpoint_every}, {self.keep_checkpoints}, {self.log_every}"
            )


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 []
    params: Params
    opt_state: optax.OptState


def param_partition(
    shape: tuple[int, ...], num_shards: int, mesh_axis: str | None
) -> PartitionSpec:
    """Replicated, or sharded over `mesh_axis` along the largest axis that `num_shards` divides."""
    if mesh_axis is None or num_shards == 1:
        return PartitionSpec()
    divisible = [axis for axis, size in enumerate(shape) if size % num_shards == 0]
    if not divisible:
        return PartitionSpec()
    axis = max(divisible, key=lambda a: shape[a])
    return PartitionSpec(*[mesh_axis if a == axis else None for a in range(len(shape))])


def make_optimizer(
    cfg: TrainConfig,
    params: Params,
    trainable: Params | None = None,
    decay_mask: Params | None = None,
):
    """AdamW with warmup + cosine decay and global-norm clipping; frozen leaves get no update.

    trainable: a pytree of bools like `params` (None: everything trains). decay_mask: bools,
    which leaves get weight decay (None: leaves of rank >= 2).
    """
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        cfg.learning_rate,
        cfg.warmup_steps,
        cfg.steps,
        end_value=cfg.learning_rate * cfg.final_lr_fraction,
    )
    if decay_mask is None:
        decay_mask = jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)
    adamw = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask),
    )
    if trainable is None:
        return adamw
    labels = jax.tree.map(lambda t: "train" if t else "freeze", trainable)
    return optax.multi_transform({"train": adamw, "freeze": optax.set_to_zero()}, labels)


def _state_shardings(state: TrainState, mesh: Mesh, fsdp: bool) -> TrainState:
    mesh_axis = mesh_lib.param_axis(mesh, fsdp)
    num_shards = mesh.shape[mesh_axis] if mesh_axis else 1

    def sharding(x):
        shape = jnp.shape(x)
        return NamedSharding(mesh, param_partition(shape, num_shards, mesh_axis))

    return jax.tree.map(sharding, state)


def init_state(params: Params, optimizer, mesh: Mesh, fsdp: bool) -> TrainState:
    """The step-0 state, placed on the mesh: always fresh buffers, never the caller's `params`
    (the train step donates the state, which would delete them)."""
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
    return jax.device_put(state, _state_shardings(state, mesh, fsdp), may_alias=False)


def check_mesh(mesh: Mesh, sequence_dim: int | None = None) -> None:
    """Raises ValueError unless every mesh axis is one the trainer uses ("data", "fsdp", and
    "seq" when the batches have a token axis `sequence_dim`)."""
    mesh_lib.check_axes(mesh, sequence_dim)


def gather_to_host(tree: Params) -> Params:
    """Numpy copies of (possibly sharded, possibly multi-process) arrays, on every process."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def make_train_step(
    loss_fn: LossFn,
    optimizer,
    mesh: Mesh,
    state: TrainState,
    fsdp: bool,
    sequence_dim: int | None = None,
):
    """Jitted (state, batch) -> (state, metrics); batch rows are split over the batch axes and
    the token axis `sequence_dim` over seq."""
    state_shardings = _state_shardings(state, mesh, fsdp)
    batch_sharding = mesh_lib.batch_sharding(mesh, sequence_dim)

    def step(state: TrainState, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        return TrainState(state.step + 1, params, opt_state), metrics

    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )


def drop_metrics_after(path: str | Path, step: int) -> None:
    """Removes the records past `step` from a JSON-lines metrics file: a run killed after its
    last checkpoint logged steps that its resumption runs (and logs) again."""
    path = Path(path)
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) < len(lines):
        path.write_text("".join(line + "\n" for line in kept))


def checkpoint_manager(directory: str | Path, cfg: TrainConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep_checkpoints, save_interval_steps=max(cfg.checkpoint_every, 1)
    )
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def _trains(params: Params, trainable: Params | None) -> list[bool]:
    """Per leaf of `params` (in leaf order): whether it trains (None: every leaf)."""
    if trainable is None:
        return [True] * len(jax.tree.leaves(params))
    return jax.tree.leaves(trainable)


def _checkpointed(state: TrainState, trainable: Params | None) -> dict[str, Any]:
    """What a checkpoint holds: the step, the optimizer state and the trainable parameters only
    (as a list, in `params`' leaf order). Frozen ones, a distillation's backbone, come back from
    the caller's `params`: a checkpoint costs what trains, not the model."""
    flags = _trains(state.params, trainable)
    leaves = jax.tree.leaves(state.params)
    trained = [leaf for leaf, train in zip(leaves, flags, strict=True) if train]
    return {"step": state.step, "trainable_params": trained, "opt_state": state.opt_state}


def _with_checkpoint(
    state: TrainState, saved: dict[str, Any], trainable: Params | None
) -> TrainState:
    """`state` with a checkpoint's step, optimizer state and trainable parameters."""
    leaves, treedef = jax.tree.flatten(state.params)
    flags = _trains(state.params, trainable)
    restored = iter(saved["trainable_params"])
    merged = [next(restored) if train else leaf for leaf, train in zip(leaves, flags, strict=True)]
    return TrainState(saved["step"], treedef.unflatten(merged), saved["opt_state"])


def restore_latest(
    manager: ocp.CheckpointManager, state: TrainState, trainable: Params | None = None
) -> TrainState:
    """The latest saved state (with `state`'s shardings and its frozen parameters), or `state`
    when none is saved."""
    step = manager.latest_step()
    if step is None:
        return state
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _checkpointed(state, trainable))
    try:
        saved = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as error:  # orbax raises many types for corrupt or partial directories
        raise ValueError(
            f"checkpoint step {step} in {manager.directory} cannot be restored "
            f"(corrupt, partial, or from another model): {type(error).__name__}: {error}"
        ) from error
    return _with_checkpoint(state, saved, trainable)


def check_batch(batch: Batch, mesh: Mesh, sequence_dim: int | None = None) -> None:
    """Raises ValueError unless this process's rows split evenly over its devices in the mesh,
    and its tokens (dimension `sequence_dim`) over the seq axis (the global batch is the
    processes' shares stacked in process order)."""
    where = "" if jax.process_count() == 1 else f" in process {jax.process_index()}"
    row_axes, *other_axes = mesh_lib.dim_axes(mesh, sequence_dim)
    shards = mesh_lib.local_blocks(mesh, row_axes)
    axes = ", ".join(f"{name}={mesh.shape[name]}" for name in row_axes)
    for name, array in batch.items():
        shape = np.shape(array)
        if not shape or shape[0] % shards:
            rows = shape[0] if shape else 0
            raise ValueError(
                f"batch[{name!r}] has {rows} rows{where}, not a multiple of the {shards} "
                f"devices{where} on the batch axes ({axes}): make the batch (per process) a "
                f"multiple of {shards} or use a smaller mesh"
            )
        for dim, dim_axes in enumerate(other_axes, start=1):
            blocks = mesh_lib.local_blocks(mesh, dim_axes)
            if len(shape) <= dim or shape[dim] % blocks:
                seq = mesh.shape[mesh_lib.SEQ_AXIS]
                raise ValueError(
                    f"batch[{name!r}] has shape {shape}{where}: its tokens (axis {dim}) are not "
                    f"a multiple of the {blocks} devices{where} on the seq axis (seq={seq}): "
                    f"make the sequence length a multiple of {seq}"
                )


def _shard_batch(batch: Batch, mesh: Mesh, sequence_dim: int | None) -> dict[str, jax.Array]:
    check_batch(batch, mesh, sequence_dim)
    sharding = mesh_lib.batch_sharding(mesh, sequence_dim)
    return {
        name: jax.make_array_from_process_local_data(sharding, np.asarray(array))
        for name, array in batch.items()
    }


def train(
    loss_fn: LossFn,
    params: Params,
    batch_for_step: Callable[[int], Batch],
    cfg: TrainConfig,
    *,
    mesh: Mesh | None = None,
    trainable: Params | None = None,
    decay_mask: Params | None = None,
    checkpoint_dir: str | Path | None = None,
    metrics_path: str | Path | None = None,
    eval_fn: Callable[[Params, int], dict[str, float]] | None = None,
    eval_every: int = 0,
    stop_after: int | None = None,
    progress: bool = True,
    optimizer: optax.GradientTransformation | None = None,
    sequence_dim: int | None = None,
) -> tuple[TrainState, list[dict]]:
    """Runs (or resumes) `cfg.steps` steps of `loss_fn` over `batch_for_step(step)`.

    loss_fn(params, batch) -> (scalar loss, dict of scalar metrics); batches are dicts of
    arrays with the batch axis first. With `checkpoint_dir`, the latest checkpoint there is
    restored first and saves happen every `cfg.checkpoint_every` steps and at the end; a
    checkpoint holds the step, the optimizer state and the `trainable` parameters (the frozen
    ones are `params`'s on resumption).
    `stop_after` ends the run early after that many steps in all (to test resumption).
    `optimizer` replaces the AdamW of `make_optimizer` (then cfg's learning rate, warmup, decay
    and clipping are unused; gate training uses SGD with momentum).
    `sequence_dim`: the batch arrays' token axis, split over the mesh's "seq" axis (0: rows are
    tokens, split over seq as well as the batch axes); None refuses a "seq" axis. The loss must
    then average over tokens as on one device, and may keep its activations split over them
    with `jaxkv.train.mesh.shard_tokens`.
    Returns the final state and the logged metrics (also appended to `metrics_path` as JSON
    lines, by process 0). With several processes, `batch_for_step` gives this process's share.
    """
    mesh = mesh or make_mesh()
    check_mesh(mesh, sequence_dim)
    if optimizer is None:
        optimizer = make_optimizer(cfg, params, trainable, decay_mask)
    state = init_state(params, optimizer, mesh, cfg.fsdp)
    manager = None
    if checkpoint_dir is not None and cfg.checkpoint_every:
        manager = checkpoint_manager(checkpoint_dir, cfg)
        state = restore_latest(manager, state, trainable)
    train_step = make_train_step(loss_fn, optimizer, mesh, state, cfg.fsdp, sequence_dim)
    first = int(state.step)
    if first:
        LOG.info("resumed from the step-%d checkpoint in %s", first, checkpoint_dir)
    last = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    logged: list[dict] = []
    started = time.perf_counter()
    write_metrics = metrics_path and jax.process_index() == 0
    if write_metrics:
        drop_metrics_after(metrics_path, first)
    metrics_file = open(metrics_path, "a") if write_metrics else None  # noqa: SIM115
    try:
        steps = range(first, last)
        # On a terminal only (disable=None): a log file gets the metrics and a line per
        # checkpoint, not bar redraws.
        bar = tqdm(steps, initial=first, total=cfg.steps, disable=None if progress else True)
        for step in bar:
            batch = _shard_batch(batch_for_step(step), mesh, sequence_dim)
            state, metrics = train_step(state, batch)
            done = step + 1
            record = None
            if done % cfg.log_every == 0 or done == last:
                record = {"step": done, **{k: float(v) for k, v in metrics.items()}}
            if eval_fn is not None and eval_every and (done % eval_every == 0 or done == last):
                record = {**(record or {"step": done}), **eval_fn(state.params, done)}
            if record is not None:
                record["seconds"] = time.perf_counter() - started
                logged.append(record)
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
            if manager is not None and (done % cfg.checkpoint_every == 0 or done == last):
                manager.save(
                    done, args=ocp.args.StandardSave(_checkpointed(state, trainable)), force=True
                )
                if bar.disable:
                    LOG.info(
                        "step %d of %d: loss %.4g, %.1f s a step; writing its checkpoint",
                        done,
                        cfg.steps,
                        float(metrics["loss"]),
                        (time.perf_counter() - started) / (done - first),
                    )
        if manager is not None:
            manager.wait_until_finished()
    finally:
        if metrics_file:
            metrics_file.close()
        if manager is not None:
            manager.close()
    return state, logged
