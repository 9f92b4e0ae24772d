"""Continuous batching: requests that come and go share one page pool and a fixed set of slots
(`jaxkv.engine.engine.Engine`; module map: docs/architecture.md).

  engine.py     Engine: submit, cancel, add_context, drop_context, step (plan, execute),
                stream, stats
  contexts.py   cached contexts: ContextEvent, the errors, a context's bookkeeping
  ledger.py     where requests and contexts are, what the scheduler sees of each lane
  intake.py     what submit and add_context check a request by, and its planned pages
  scheduler.py  the pure plan of a step from page counts
  executor.py   the device state and the programs that run a plan
  programs.py   the jitted programs (one device or a mesh)
  lanes.py      where slots, context rows and prefill rows lie on a mesh
  limits.py     the engine's bounds (slots, prefills, contexts, tokens a step), checked once
  batching.py   several prefill rows' chunks as one forward pass's batch
  pages.py      what a request may hold, in pages
  requests.py   TokenEvent, the errors, a request's bookkeeping
"""

from jaxkv.engine.contexts import ContextEvent, ContextsFullError, UnknownContextError
from jaxkv.engine.engine import Engine
from jaxkv.engine.pages import pages_needed_alone
from jaxkv.engine.requests import QueueFullError, TokenEvent, TooLargeForPoolError

__all__ = [
    "ContextEvent",
    "ContextsFullError",
    "Engine",
    "QueueFullError",
    "TokenEvent",
    "TooLargeForPoolError",
    "UnknownContextError",
    "pages_needed_alone",
]
