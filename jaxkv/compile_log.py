"""Feedback while jaxkv compiles: "compiling NAME for new shapes ..." when XLA starts compiling one
of jaxkv's programs, and "compiled NAME in S s" when it is done, on the `jaxkv` logger (INFO; the
CLI shows it on stderr). A first call of a shape can spend 15-40 s compiling: this says so, and
`counting_compiles` measures it, so that a rate (tokens per second) can leave it out.

jax reports each compilation's phases as duration events (`jax.monitoring`); the program being
called is named in a context variable by `compiling_as`, so only jaxkv's own programs are named.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging

import jax

LOG = logging.getLogger("jaxkv")

# jax's duration events around a compilation (jax._src.dispatch): a top-level trace done (nested
# jits trace inside it and report nothing), lowering done, backend done.
_TRACED = "/jax/core/compile/jaxpr_trace_duration"
_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILED = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileSeconds:
    """Seconds spent tracing, lowering and compiling programs inside a `counting_compiles`
    block (the block's own counter: it grows while the block runs)."""

    seconds: float = 0.0


_program: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxkv_program", default=None)
_counters: contextvars.ContextVar[tuple[CompileSeconds, ...]] = contextvars.ContextVar(
    "jaxkv_compile_counters", default=()
)


@contextlib.contextmanager
def compiling_as(name: str):
    """Names the jaxkv program that calls inside the block may compile."""
    token = _program.set(name)
    try:
        yield
    finally:
        _program.reset(token)


@contextlib.contextmanager
def counting_compiles():
    """Yields a `CompileSeconds` that counts the compilations of every program called inside
    the block, on this thread (blocks nest: each counts its own)."""
    counter = CompileSeconds()
    token = _counters.set((*_counters.get(), counter))
    try:
        yield counter
    finally:
        _counters.reset(token)


def _on_duration(event: str, duration: float, **kwargs) -> None:
    del kwargs
    if event in (_TRACED, _LOWERED, _COMPILED):
        for counter in _counters.get():
            counter.seconds += duration
    name = _program.get()
    if name is None:
        return
    if event == _LOWERED:
        LOG.info("compiling %s for new shapes ...", name)
    elif event == _COMPILED:
        LOG.info("compiled %s in %.1f s", name, duration)


jax.monitoring.register_event_duration_secs_listener(_on_duration)
