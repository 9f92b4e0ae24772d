"""The engine in a thread of its own: request handlers talk to it through a queue, and each
request's tokens (each cached context's events) come back to the callback it was submitted
with."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time

from jaxkv.engine import ContextEvent, Engine, TokenEvent

log = logging.getLogger(__name__)

# Tokens-per-second is measured over this many recent seconds.
RATE_WINDOW_SECONDS = 10.0


class EngineStoppedError(RuntimeError):
    """The engine's thread stopped on an error: no request is served any more."""


class EngineWorker:
    """The engine in a thread of its own: `submit`, `cancel`, `add_context` and
    `drop_context` from any thread, each request's `TokenEvent`s (each context's
    `ContextEvent`s) to the callback it was submitted with (called in the engine's thread)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._listeners: dict[int, callable] = {}
        self._context_listeners: dict[int, callable] = {}
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.tokens_generated = 0
        # The engine's stats as of its last command or step, taken in its thread: the engine's
        # state is donated to its programs, so no other thread may read it.
        self._engine_stats = engine.stats()
        self.failure: str | None = None  # the error the engine's thread stopped on
        self._failing = threading.Lock()  # a submit is queued before a failure or refused after
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    def submit(self, on_event, /, *args, **kwargs) -> concurrent.futures.Future:
        """A future of the request id (or of the engine's ValueError, or EngineStoppedError) for
        `Engine.submit`."""
        return self._command("submit", on_event, args, kwargs)

    def add_context(self, on_event, /, *args, **kwargs) -> concurrent.futures.Future:
        """A future of the context id (or of the engine's ValueError, or EngineStoppedError)
        for `Engine.add_context`; the context's events go to `on_event`."""
        return self._command("add_context", on_event, args, kwargs)

    def drop_context(self, context_id: int) -> concurrent.futures.Future:
        """A future of `Engine.drop_context`'s answer."""
        return self._command("drop_context", None, (context_id,), {})

    def _command(self, kind: str, on_event, args, kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._failing:
            if self.failure is None:
                self._commands.put((kind, future, on_event, args, kwargs))
            else:
                future.set_exception(EngineStoppedError(self.failure))
        return future

    def cancel(self, request_id: int) -> None:
        self._commands.put(("cancel", request_id))

    def stats(self) -> dict:
        now = time.monotonic()
        # A copy made in one call (the engine's thread appends and pops meanwhile).
        recent = sum(count for at, count in tuple(self._recent) if now - at <= RATE_WINDOW_SECONDS)
        return {
            **self._engine_stats,
            "tokens_generated": self.tokens_generated,
            "tokens_per_second": recent / RATE_WINDOW_SECONDS,
        }

    def stop(self) -> None:
        """Ends the engine's thread after its current step (a compile included): once this
        returns, no other thread uses the engine."""
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join()

    def _handle(self, command) -> None:
        if command[0] in ("submit", "add_context", "drop_context"):
            kind, future, on_event, args, kwargs = command
            try:
                result = getattr(self.engine, kind)(*args, **kwargs)
            except ValueError as error:
                future.set_exception(error)
                return
            if kind == "submit":
                self._listeners[result] = on_event
            elif kind == "add_context":
                self._context_listeners[result] = on_event
            elif result:
                self._context_listeners.pop(args[0], None)
            future.set_result(result)
        elif command[0] == "cancel":
            request_id = command[1]
            if self.engine.cancel(request_id) and request_id in self._listeners:
                self._listeners.pop(request_id)(TokenEvent(request_id, -1, True, "cancelled"))

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as error:
            log.exception("the engine's thread stopped")
            self._fail(f"{type(error).__name__}: {error}")

    def _fail(self, failure: str) -> None:
        """Refuses every submit from now on and ends every request with reason "error"."""
        with self._failing:
            self.failure = failure
            commands = []
            while not self._commands.empty():
                commands.append(self._commands.get_nowait())
        for command in commands:
            if command[0] in ("submit", "add_context", "drop_context"):  # those with a future
                command[1].set_exception(EngineStoppedError(failure))
        for request_id, listener in self._listeners.items():
            listener(TokenEvent(request_id, -1, True, "error"))
        for context_id, listener in self._context_listeners.items():
            listener(ContextEvent(context_id, "error", 0))
        self._listeners.clear()
        self._context_listeners.clear()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            busy = self.engine.has_work()
            try:
                self._handle(self._commands.get(block=not busy))
                self._engine_stats = self.engine.stats()
                continue  # take every waiting command before the next step
            except queue.Empty:
                pass
            events = self.engine.step()
            self._engine_stats = self.engine.stats()
            produced = sum(isinstance(e, TokenEvent) and e.token >= 0 for e in events)
            self.tokens_generated += produced
            self._recent.append((time.monotonic(), produced))
            while self._recent and time.monotonic() - self._recent[0][0] > RATE_WINDOW_SECONDS:
                self._recent.popleft()
            for event in events:
                if isinstance(event, ContextEvent):
                    self._tell_context(event)
                    continue
                listener = self._listeners.get(event.request_id)
                if listener is not None:
                    listener(event)
                    if event.finished:
                        del self._listeners[event.request_id]

    def _tell_context(self, event: ContextEvent) -> None:
        listener = self._context_listeners.get(event.context_id)
        if listener is not None:
            listener(event)
            if event.state != "ready":
                del self._context_listeners[event.context_id]
