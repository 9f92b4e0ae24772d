"""Feedback while jaxkv compiles: "compiling NAME for new shapes ..." when XLA starts compiling one
of jaxkv's programs, and "compiled NAME in S s" when it is done, on the `jaxkv` logger (INFO; the
CLI shows it on stderr). A first call of a shape can spend 15-40 s compiling: this says so.

jax reports each compilation's phases as duration events (`jax.monitoring`); the program being
called is named in a context variable by `compiling_as`, so only jaxkv's own programs are named.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import jax

LOG = logging.getLogger("jaxkv")

# jax's duration events around a compilation (jax._src.dispatch): lowering done, backend done.
_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILED = "/jax/core/compile/backend_compile_duration"

_program: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxkv_program", default=None)


@contextlib.contextmanager
def compiling_as(name: str):
    """Names the jaxkv program that calls inside the block may compile."""
    token = _program.set(name)
    try:
        yield
    finally:
        _program.reset(token)


def _on_duration(event: str, duration: float, **kwargs) -> None:
    del kwargs
    name = _program.get()
    if name is None:
        return
    if event == _LOWERED:
        LOG.info("compiling %s for new shapes ...", name)
    elif event == _COMPILED:
        LOG.info("compiled %s in %.1f s", name, duration)


jax.monitoring.register_event_duration_secs_listener(_on_duration)
