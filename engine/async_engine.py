"""The engine seen from asyncio: one thread owns the `LLMEngine` and runs its loop; servers talk to it through
commands (functions run on the engine thread between steps) and per-request output queues.

Results reach the event loop with `loop.call_soon_threadsafe`, so nothing on the asyncio side ever touches the
engine's state directly. Step hooks run on the engine thread right after each step (e.g. to stage KV blocks that
just finished computing). Stats, KV-cache events and load are handed over at most every few hundred
milliseconds (or when events exist), off the model loop.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from engine.core.block_pool import KVEvent
from engine.llm_engine import EngineLoad, LLMEngine
from engine.metrics.stats import EngineStats, FinishedRequestTiming
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
StepHook = Callable[[LLMEngine, list[RequestOutput]], None]
IDLE_POLL_S = 0.05
LOAD_INTERVAL_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no more requests are served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, stats_interval_s: float = 0.5,
                 on_stats: Callable[[EngineStats, list[FinishedRequestTiming]], None] | None = None,
                 on_kv_events: Callable[[list[KVEvent], EngineLoad], None] | None = None) -> None:
        self.engine = engine
        self.stats_interval_s = stats_interval_s
        self.on_stats = on_stats
        self.on_kv_events = on_kv_events
        self.step_hooks: list[StepHook] = []
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], asyncio.Future | None]] = \
            queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None

    # ---- asyncio side ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._commands.put((lambda e: None, None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result (or raise its error)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._dead}")
        assert self._loop is not None, "start() first"  # programming error, not input
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put((fn, future))
        return await future

    async def ready_grammar(self, params: SamplingParams | None) -> None:
        """Compile a constrained request's grammar on the compile threads, awaiting it here within the budget, so
        that admitting the request finds it ready: the engine loop never compiles, and keeps stepping the other
        requests meanwhile. Raises InvalidRequest (over a limit, not compilable, or not in time). Call it before
        `call`ing the engine to add the request."""
        constraint = params.structured_outputs if params is not None else None
        if constraint is None:
            return
        manager = self.engine.structured_output
        future = manager.submit(constraint)
        if not future.done():
            try:  # shielded: a caller that gives up must not cancel a compile other callers share
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), manager.limits.timeout_s)
            except asyncio.TimeoutError:
                raise manager.timeout_error(constraint) from None
        manager.result(future, constraint, timeout=0)  # its refusal, if it failed

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire-and-forget `call`: safe from `finally` blocks of cancelled tasks."""
        self._commands.put((fn, None))

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput | BaseException]:
        """Outputs of `request_id` land here; open it before adding the request."""
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """From the engine thread: run `fn(*args)` on the event loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)

    @staticmethod
    def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # ---- engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        engine.bind_thread()
        last_stats = last_load = time.monotonic()
        try:
            while not self._stopping:
                self._run_commands(block=not engine.has_unfinished_requests())
                pending = engine.take_pending_outputs()
                if pending:
                    self.post(self._dispatch, pending)
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                        for hook in self.step_hooks:
                            hook(engine, outputs)
                    except Exception as exc:  # a bug must not hang callers: fail their requests, keep serving
                        logger.exception("engine step failed; aborting the running requests")
                        engine.abort_all()
                        outputs = engine.step() if engine.has_unfinished_requests() else []
                        for hook in self.step_hooks:  # lets hooks see the aborts and release what they hold
                            hook(engine, outputs)
                        self.post(self._fail_all, exc)
                    if outputs:
                        self.post(self._dispatch, outputs)
                else:
                    engine.expire_kv_leases()
                now = time.monotonic()
                events = engine.kv_manager.pool.take_events() if self.on_kv_events is not None else []
                if self.on_kv_events is not None and (events or now - last_load >= LOAD_INTERVAL_S):
                    self.post(self.on_kv_events, events, engine.load())
                    last_load = now
                if self.on_stats is not None and now - last_stats >= self.stats_interval_s:
                    engine.refresh_gauges()
                    self.post(self.on_stats, copy.deepcopy(engine.stats), engine.take_finished_timings())
                    last_stats = now
        except BaseException as exc:  # noqa: BLE001 - report whatever killed the loop to every caller
            logger.exception("engine loop died")
            self._dead = exc
            self.post(self._fail_all, EngineDeadError(str(exc)))
        self._drain_commands_after_stop()

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                result, error = fn(self.engine), None
            except Exception as exc:  # handed to the caller
                result, error = None, exc
            if future is not None:
                self.post(self._settle, future, result, error)
            elif error is not None:
                logger.error("engine command failed: %s", error)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands_after_stop(self) -> None:
        error = self._dead or EngineDeadError("the engine is shutting down")
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and self._loop is not None and not self._loop.is_closed():
                self.post(self._settle, future, None, error)
