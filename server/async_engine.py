"""Drive the (not thread-safe) ``LLMEngine`` from one background thread for an asyncio server.

* The engine is built and stepped only by the loop thread. The event loop talks to it through
  commands (add, abort) that the loop thread applies between steps.
* Outputs go to a per-HTTP-request ``RequestStream`` (one asyncio queue for all of that
  request's engine requests) with one ``loop.call_soon_threadsafe`` per step.
* A failing ``step()`` kills the engine: every in-flight stream gets a ``FailedEvent`` and new
  requests are refused. A failure tied to one request only fails that request. A lost
  tensor-parallel worker (``TensorParallelError``, also noticed while idle through
  ``engine.check_health()``) is answered 503 rather than 500: the request was fine, the
  server lost one of its processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.distributed import TensorParallelError
from engine.engine import QueueFullError, RequestValidationError
from engine.outputs import RequestOutput
from server.engine_types import (
    AbortedEvent,
    EngineDeadError,
    EngineObserver,
    EngineSnapshot,
    Event,
    FailedEvent,
    OutputEvent,
    RequestStream,
    SubRequest,
)
from server.errors import ServiceUnavailableError

if TYPE_CHECKING:
    from engine.engine import LLMEngine

log = logging.getLogger("specserve.server")


@dataclass
class _Command:
    apply: Callable[[LLMEngine], None]
    fail: Callable[[BaseException], None] | None = None


class AsyncEngine:
    IDLE_WAIT_S = 1.0

    def __init__(
        self,
        factory: Callable[[], LLMEngine],
        *,
        observer: EngineObserver | None = None,
        on_ready: Callable[[LLMEngine], None] | None = None,
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        self._factory = factory
        self._observer = observer
        self._on_ready = on_ready
        self._on_dead = on_dead
        self._lock = threading.Lock()
        self._commands: deque[_Command] = deque()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._routes: dict[str, tuple[RequestStream, int]] = {}  # loop thread only
        self._streams: set[RequestStream] = set()  # event loop only
        self.state = "created"  # created -> starting -> ready -> stopped | dead
        self.error: str | None = None
        self.error_status = 500  # HTTP status of requests refused or failed by a dead engine
        self.snapshot = EngineSnapshot()

    # -- lifecycle (event loop) ------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.state = "starting"
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            if self._thread.is_alive():
                log.warning("engine thread did not stop within %.0fs", timeout)

    @property
    def ready(self) -> bool:
        return self.state == "ready" and not self._stopping

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # -- requests (event loop) -------------------------------------------------------------
    async def add(self, subs: Sequence[SubRequest]) -> RequestStream:
        """Queue engine requests for one HTTP request; raises the engine's
        ``RequestValidationError`` / ``QueueFullError`` before anything is queued."""
        loop = asyncio.get_running_loop()
        stream = RequestStream([s.request_id for s in subs])
        fut: asyncio.Future[None] = loop.create_future()

        def apply(engine: LLMEngine) -> None:
            try:
                self._add_all(engine, stream, subs)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                self._call(_settle, fut, exc)
                return
            self._call(_settle, fut, None)

        self._submit(_Command(apply, lambda exc: self._call(_settle, fut, exc)))
        self._streams.add(stream)
        try:
            await fut
        except asyncio.CancelledError:
            self.release(stream)  # the command may still run: abort what it adds
            raise
        except BaseException:
            self._streams.discard(stream)
            raise
        return stream

    def release(self, stream: RequestStream) -> None:
        """The handler is done with ``stream``: abort whatever still runs."""
        if not stream.finished:
            self.abort(stream)
        self._streams.discard(stream)

    def abort(self, stream: RequestStream, notify: bool = False) -> None:
        """Abort ``stream``'s engine requests (frees their KV blocks at the next command
        point); with ``notify`` the stream gets an ``AbortedEvent`` per unfinished index."""

        def apply(engine: LLMEngine) -> None:
            self._abort_routes(engine, [r for r in stream.request_ids if r in self._routes],
                               notify)

        with contextlib.suppress(ServiceUnavailableError, EngineDeadError):
            self._submit(_Command(apply))

    def abort_all(self) -> int:
        """Abort every in-flight request with a final ``AbortedEvent``; returns how many
        streams were affected."""
        for stream in list(self._streams):
            self.abort(stream, notify=True)
        return len(self._streams)

    # -- plumbing --------------------------------------------------------------------------
    def _submit(self, command: _Command) -> None:
        with self._lock:
            if self.state == "dead":
                raise EngineDeadError(f"The engine is dead: {self.error}",
                                      status=self.error_status)
            if self._stopping or self.state not in ("starting", "ready"):
                raise ServiceUnavailableError("The engine is shutting down", retry_after=None)
            self._commands.append(command)
        self._wakeup.set()

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` on the event loop (from the loop thread)."""
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody listens
            self._loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, batch: list[tuple[RequestStream, Event]]) -> None:
        if batch:
            self._call(_dispatch, batch)

    # -- loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:
            log.exception("the engine failed to start")
            self._die(f"the engine failed to start: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            if self.state == "starting":
                self.state = "ready"
        self.snapshot = EngineSnapshot.of(engine)
        if self._on_ready is not None:
            self._call(self._on_ready, engine)
        # What startup built (models, tokenizer, libraries) lives as long as the engine; in
        # view of the garbage collector, every full collection walked all of it: 135-155 ms
        # stalls, one per 500-800 steps at 32 requests (measured offline, ~300,000 objects).
        # Unfrozen when the loop ends, so that a stopped engine can be collected.
        gc.collect()
        gc.freeze()
        try:
            self._serve(engine)
        except BaseException as exc:
            log.exception("the engine loop failed")
            self._die(f"{type(exc).__name__}: {exc}",
                      503 if isinstance(exc, TensorParallelError) else 500)
            return
        finally:
            gc.unfreeze()
        self._abort_routes(engine, list(self._routes), notify=True)
        with self._lock:
            self.state = "stopped"
            pending = list(self._commands)
            self._commands.clear()
        for cmd in pending:
            if cmd.fail is not None:
                cmd.fail(ServiceUnavailableError("The engine is shutting down", None))

    def _serve(self, engine: LLMEngine) -> None:
        busy = False
        while True:
            if not busy:
                self._wakeup.wait(self.IDLE_WAIT_S)
            self._wakeup.clear()
            with self._lock:
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            for cmd in commands:
                self._apply(engine, cmd)
            if stopping:
                return
            busy = engine.has_unfinished_requests()
            if not busy:
                engine.check_health()  # a worker lost while idle: die now, not at the next request
            else:
                outputs = engine.step()  # an exception here kills the engine (see _run)
                self._publish(outputs)
                if not outputs and engine.num_running == 0:
                    self._wakeup.wait(0.005)  # nothing could be scheduled: do not spin
            self.snapshot = EngineSnapshot.of(engine)
            self._observe("on_tick", self.snapshot, time.monotonic())

    def _apply(self, engine: LLMEngine, cmd: _Command) -> None:
        try:
            cmd.apply(engine)
        except Exception as exc:
            log.exception("engine command failed")
            if cmd.fail is not None:
                cmd.fail(exc)

    def _add_all(self, engine: LLMEngine, stream: RequestStream,
                 subs: Sequence[SubRequest]) -> None:
        # all or nothing, validated and checked against the waiting queue once
        engine.add_requests([(s.request_id, s.prompt_token_ids, s.params, s.prompt)
                             for s in subs])
        for index, sub in enumerate(subs):
            self._routes[sub.request_id] = (stream, index)

    def _abort_routes(self, engine: LLMEngine, request_ids: Sequence[str], notify: bool) -> None:
        batch: list[tuple[RequestStream, Event]] = []
        for rid in request_ids:
            route = self._routes.pop(rid, None)
            try:
                engine.abort_request(rid)
            except Exception:
                log.exception("aborting request %s failed", rid)
            if route is not None and notify:
                batch.append((route[0], AbortedEvent(route[1])))
        self._observe("on_aborted", list(request_ids))
        self._deliver(batch)

    def _publish(self, outputs: Sequence[RequestOutput]) -> None:
        batch: list[tuple[RequestStream, Event]] = []
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            if out.finished:
                del self._routes[out.request_id]
            batch.append((route[0], OutputEvent(route[1], out)))
        self._observe("on_outputs", outputs, time.monotonic())
        self._deliver(batch)

    def _observe(self, method: str, *args: object) -> None:
        if self._observer is None:
            return
        try:
            getattr(self._observer, method)(*args)
        except Exception:
            log.exception("engine observer %s failed", method)

    def _die(self, message: str, status: int = 500) -> None:
        with self._lock:
            self.state = "dead"
            self.error = message
            self.error_status = status
            pending = list(self._commands)
            self._commands.clear()
        error = EngineDeadError(f"The engine failed and cannot serve requests: {message}",
                                status=status)
        streams = {stream for stream, _ in self._routes.values()}
        self._routes.clear()
        self._deliver([(s, FailedEvent(error)) for s in streams])
        for cmd in pending:
            if cmd.fail is not None:
                cmd.fail(error)
        if self._on_dead is not None:
            self._call(self._on_dead, message)


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _dispatch(batch: list[tuple[RequestStream, Event]]) -> None:
    for stream, event in batch:
        stream.put(event)


__all__ = [
    "AbortedEvent", "AsyncEngine", "EngineDeadError", "EngineObserver", "EngineSnapshot",
    "Event", "FailedEvent", "OutputEvent", "QueueFullError", "RequestStream",
    "RequestValidationError", "SubRequest",
]
