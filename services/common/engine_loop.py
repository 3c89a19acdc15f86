"""An LLMEngine on its own thread, driven from asyncio.

The engine is not thread-safe: every engine call happens on the loop's thread.
Async callers send commands through a thread-safe queue and get results, and
each request's step outputs, back on their event loop. The thread blocks on the
queue when the engine has nothing to do; when requests only wait (for
embeddings or for KV blocks) it re-checks with a growing back-off.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from services.common.errors import FeatureTimeoutError
from services.engine.llm_engine import LLMEngine
from services.engine.sequence import ErrorKind, FinishReason, RequestError, StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
_STALL_FIRST_S = 0.002
_STALL_MAX_S = 0.05


@dataclass(frozen=True, eq=False)
class _Sink:
    """Where one request's outputs go: a queue owned by an event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: StepOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    def __init__(self, engine: LLMEngine, observe: Callable[[LLMEngine], None] = lambda engine: None) -> None:
        self._engine = engine
        self._observe = observe  # called on the engine thread after every round (metrics)
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Finish the queued commands, then end the thread (unfinished requests are dropped)."""
        self._stopped = True
        self._commands.put(None)
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ async side

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread and return its result (or raise its exception)."""
        if self._stopped:
            raise RuntimeError("the engine loop has stopped")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def command() -> None:
            try:
                result: Any = fn(self._engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(command)
        return await future

    def post(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run fn(engine) on the engine thread without waiting for it (errors are logged)."""
        if not self._stopped:
            self._commands.put(lambda: fn(self._engine))

    async def open(self, request_id: str, start: Callable[[LLMEngine], None]) -> RequestStream:
        """Register for request_id's outputs, then run start(engine) (add_request, add_handoff, resume)."""
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())

        def register(engine: LLMEngine) -> None:
            if request_id in self._sinks:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._sinks[request_id] = sink
            try:
                start(engine)
            except BaseException:
                del self._sinks[request_id]
                raise

        try:
            await self.call(register)
        except asyncio.CancelledError:
            self.close(request_id, sink, abort=True)  # register may still run after we stop waiting
            raise
        return RequestStream(self, request_id, sink)

    def close(self, request_id: str, sink: _Sink, abort: bool) -> None:
        """Stop delivering request_id's outputs to sink; abort it in the engine too if asked."""

        def command() -> None:
            if self._sinks.get(request_id) is not sink:
                return  # finished, or the id now belongs to another request
            del self._sinks[request_id]
            if abort:
                self._engine.abort(request_id)

        if not self._stopped:
            self._commands.put(command)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        stall = 0.0  # how long to wait for a command before stepping again
        while True:
            busy = self._engine.has_unfinished()
            if not self._run_commands(timeout_s=stall if busy else None):
                return
            if self._engine.has_unfinished():
                produced = self._step()
                stall = 0.0 if produced else min(max(stall * 2, _STALL_FIRST_S), _STALL_MAX_S)
            self._observe(self._engine)

    def _run_commands(self, timeout_s: float | None) -> bool:
        """Run the queued commands, waiting up to timeout_s (None: forever) for the first. False on stop."""
        try:
            command = self._commands.get(timeout=timeout_s) if timeout_s != 0 else self._commands.get_nowait()
        except queue.Empty:
            return True
        while command is not None:
            try:
                command()
            except Exception:  # a command's failure must not end the thread that serves every request
                log.exception("engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _step(self) -> bool:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing every request in flight")
            self._fail_all(exc)
            return False
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted while the step ran
            if out.finished:
                del self._sinks[out.request_id]
            sink.put(out)
        return bool(outputs)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, sink in list(self._sinks.items()):
            sink.put(RuntimeError(f"the engine failed: {exc}"))
            try:
                self._engine.abort(request_id)
            except Exception:
                log.exception("abort of %s failed", request_id)
        self._sinks.clear()


class RequestStream:
    """One request's step outputs. Leaving the `async with` block early aborts the request
    in the engine (caller cancelled), unless `keep()` said the engine now holds it."""

    def __init__(self, loop: EngineLoop, request_id: str, sink: _Sink) -> None:
        self._loop = loop
        self.request_id = request_id
        self._sink = sink
        self._done = False
        self._kept = False

    async def next(self) -> StepOutput:
        """The next output; an engine error for this request is raised as an exception."""
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        if item.finish_reason is FinishReason.ERROR:
            raise engine_error(item)
        return item

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while not self._done:
            yield await self.next()

    def keep(self) -> None:
        """Stop listening without aborting: the request's KV stays held in the engine."""
        self._kept = True

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._done:
            self._loop.close(self.request_id, self._sink, abort=not self._kept)


def engine_error(output: StepOutput) -> Exception:
    message = output.error or "the engine failed this request"
    if output.error_kind is ErrorKind.FEATURE_TIMEOUT:
        return FeatureTimeoutError(message)
    return RequestError(message)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return  # the caller stopped waiting
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
