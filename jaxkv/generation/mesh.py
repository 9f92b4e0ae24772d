"""Jitted programs that run on one device or, unchanged, on a (data, model) mesh.

A program declares how each of its arguments is placed on a mesh, by name, next to its
definition (`program(...)`); a call passes keyword arguments and names no placement, so an
argument cannot be placed by the position of another:

    @program(static=("policy",), donate=("kv",), model=MODEL, kv=SHARD, lengths=ROWS)
    def step(model, kv, lengths, *, policy): ...

    kv = step(placement, model=model, kv=kv, lengths=lengths, policy=policy)
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jaxkv.compile_log import compiling_as
from jaxkv.sharding import InferenceMesh


class Placement(enum.Enum):
    """How a program's argument is split over a mesh (`InferenceMesh.run`)."""

    MODEL = "model"  # the Model: params split by the rules table, config made local
    POLICY_PARAMS = "params"  # the policy's parameters, split by its params part's `axes`
    ROWS = "rows"  # a host batch array [B, ...]: each data shard gets its rows
    SHARD = "shard"  # per-device values stacked [S, ...] (a previous program's output)
    SAME = "same"  # the same value on every device


MODEL, POLICY_PARAMS, ROWS, SHARD, SAME = Placement


@dataclasses.dataclass(frozen=True)
class Program:
    """A jitted function with the mesh placement of each of its array arguments.

    Attributes:
      fn: the function itself (traced on each device of a mesh).
      jitted: `jax.jit(fn)` with its static and donated arguments (one device).
      placements: each non-static argument's `Placement`, in the function's order.
      static: the names of the static (hashable, compile-time) arguments.
      donate: the arguments whose buffers the program takes over.
    """

    fn: Callable
    jitted: Callable
    placements: Mapping[str, Placement]
    static: tuple[str, ...]
    donate: tuple[str, ...]

    def __call__(self, mesh: InferenceMesh | None, /, **arguments: Any) -> Any:
        """fn(**arguments) on one device (`mesh` None) or as a sharded program on `mesh`."""
        expected = set(self.placements) | set(self.static)
        if set(arguments) != expected:
            missing, extra = expected - set(arguments), set(arguments) - expected
            raise TypeError(
                f"{self.fn.__name__}: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        with compiling_as(self.fn.__name__.strip("_")):
            return self._run(mesh, arguments)

    def _run(self, mesh: InferenceMesh | None, arguments: dict) -> Any:
        if mesh is None:
            return self.jitted(**arguments)
        kinds = tuple(
            "donate" if name in self.donate else placement.value
            for name, placement in self.placements.items()
        )
        args = tuple(arguments[name] for name in self.placements)
        statics = {name: arguments[name] for name in self.static}
        return mesh.run(self.fn, kinds, args, statics)


def program(
    *, static: tuple[str, ...] = (), donate: tuple[str, ...] = (), **placements: Placement
) -> Callable[[Callable], Program]:
    """Decorator: `fn` as a `Program`; every parameter of `fn` is either named in `static` or
    given a `Placement` by keyword, and donated arguments are per-device values (SHARD)."""

    def wrap(fn: Callable) -> Program:
        parameters = list(inspect.signature(fn).parameters)
        if set(parameters) != set(placements) | set(static) or set(placements) & set(static):
            raise TypeError(
                f"{fn.__name__}: give each of {parameters} a placement or name it static "
                f"(placements {sorted(placements)}, static {sorted(static)})"
            )
        for name in donate:
            if placements.get(name) is not SHARD:
                raise TypeError(f"{fn.__name__}: donated {name!r} must be placed SHARD")
        ordered = {name: placements[name] for name in parameters if name in placements}
        jitted = jax.jit(fn, static_argnames=static, donate_argnames=donate)
        return Program(fn=fn, jitted=jitted, placements=ordered, static=static, donate=donate)

    return wrap
