"""A router's graceful drain, and the relay that makes every request interruptible.

Invariants:
- Once the drain began, `admitted()` refuses new requests with `ShuttingDown` (HTTP 503 with OpenAI error JSON,
  gRPC UNAVAILABLE) and `/health` answers 503, so load balancers stop sending traffic; the listeners stay open.
- A request counts as in flight from `admitted()` until its handler returns or, when it opened a `Relay`, until that
  relay closes, so the drain also waits for streaming responses that outlive their handler.
- A `Relay` runs a request's worker responses (`Router.generate`, or several merged) in a task of its own and hands
  them to the front through a bounded queue (back pressure is kept). The front can then wait with a timeout (SSE
  keep-alives) and be interrupted (drain deadline, client gone) without cancelling an async generator mid-step:
  an interrupt cancels the relay's task, which closes the worker call, which frees the request's KV on the decode
  and prefill workers.
- At the drain deadline every open relay is interrupted with `ShuttingDown`; each front then ends its response
  properly (SSE: finish_reason "abort" and [DONE]; non-streaming HTTP: OpenAI error JSON; gRPC: UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Generic, TypeVar

from router.drain_forecast import DrainForecast
from router.errors import ShuttingDown

logger = logging.getLogger(__name__)

T = TypeVar("T")
RELAY_QUEUE = 64  # responses a relay buffers ahead of a slow client
POLL_S = 0.05
FLUSH_S = 5.0  # after the deadline: time for interrupted responses to end before the listeners close


class Idle:
    """What `Relay.next` returns when nothing arrived within its timeout."""


IDLE = Idle()


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


class _End:
    pass


_END = _End()


class _Wake:
    """Put by `interrupt` to wake a consumer waiting on an empty queue."""


_WAKE = _Wake()


class _Failed:
    def __init__(self, error: Exception) -> None:
        self.error = error


class Relay(Generic[T]):
    """`source`'s items through a queue filled by a task of their own (see the module docstring)."""

    def __init__(self, source: AsyncIterator[T], on_close: Callable[[Relay[T]], None]) -> None:
        self._queue: asyncio.Queue[T | _End | _Failed | _Wake | Idle] = asyncio.Queue(RELAY_QUEUE)
        self._interrupt: BaseException | None = None
        self._on_close = on_close
        self._closed = False
        self._task = asyncio.create_task(self._pump(source))
        # `next(timeout_s)`'s timeout without a timer per call (a call per streamed token): while the consumer
        # waits, `_idle_at` is when it gets IDLE; one timer, re-armed lazily, puts IDLE in the queue then.
        self._idle_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def _pump(self, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                await self._queue.put(item)
            await self._queue.put(_END)
        except Exception as exc:  # handed to the consumer, which raises it
            await self._queue.put(_Failed(exc))
        finally:  # cancelled while waiting for room in the queue: the source is suspended at a yield
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    def __aiter__(self) -> Relay[T]:
        return self

    async def __anext__(self) -> T:
        item = await self.next()
        assert not isinstance(item, Idle)  # no timeout was given
        return item

    async def next(self, timeout_s: float | None = None) -> T | Idle:
        """The next item, or IDLE when none came within `timeout_s`. Raises StopAsyncIteration at the end, the
        source's error, or the interrupt (once the items already queued are taken)."""
        if self._queue.empty():
            if self._interrupt is not None:
                raise self._interrupt
            if timeout_s is not None:
                self._wait_until(asyncio.get_running_loop().time() + timeout_s)
            try:
                item = await self._queue.get()
            finally:
                self._idle_at = None
        else:
            item = self._queue.get_nowait()
        if isinstance(item, Idle):
            return IDLE
        if isinstance(item, _Wake):
            assert self._interrupt is not None  # only `interrupt` puts it
            raise self._interrupt
        if isinstance(item, _End):
            raise StopAsyncIteration
        if isinstance(item, _Failed):
            raise item.error
        return item

    def _wait_until(self, idle_at: float) -> None:
        self._idle_at = idle_at
        if self._timer is None or self._timer.when() > idle_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_at(idle_at, self._on_timer)

    def _on_timer(self) -> None:
        """IDLE for a consumer that has waited until its `_idle_at` (not when an item is on its way: the queue is
        not empty then); a consumer that waits again later re-arms the timer for its new deadline."""
        self._timer = None
        if self._idle_at is None or not self._queue.empty():
            return
        loop = asyncio.get_running_loop()
        if loop.time() >= self._idle_at:
            self._idle_at = None
            self._queue.put_nowait(IDLE)
        else:
            self._timer = loop.call_at(self._idle_at, self._on_timer)

    def ready(self) -> bool:
        """Whether `next` would return (or raise) at once: an item, the end or a failure is queued."""
        return not self._queue.empty()

    def interrupt(self, error: BaseException) -> None:
        """Stop the source now; the consumer raises `error` after the items already queued."""
        if self._interrupt is None:
            self._interrupt = error
        self._task.cancel()
        with contextlib.suppress(asyncio.QueueFull):  # a full queue means the consumer is not waiting
            self._queue.put_nowait(_WAKE)

    def close(self) -> None:
        """The consumer is done (or gone): stop the source. Synchronous, so it is safe in a cancelled finally."""
        if not self._closed:
            self._closed = True
            self._task.cancel()
            if self._timer is not None:
                self._timer.cancel()
            self._on_close(self)


class Ticket:
    """One admitted request: in flight until its handler returns or, once it opened its relay, until that closes."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle
        self.relayed = False

    def relay(self, source: AsyncIterator[T]) -> Relay[T]:
        """Run the request's worker responses through a relay, which now holds the request in flight."""
        if self.relayed:
            raise RuntimeError("a request opens one relay")
        self.relayed = True
        return self._lifecycle._open(source)


class Lifecycle:
    """Admission and in-flight accounting of one router; `drain` runs its shutdown."""

    def __init__(self) -> None:
        self.draining = False
        self._expired = False  # past the drain deadline: a relay opened now is interrupted at once
        self._stop = asyncio.Event()
        self._force = False
        self.in_flight = 0  # admitted requests not yet answered
        self._relays: set[Relay] = set()

    def request_stop(self) -> None:
        """(On the event loop.) The first call starts the drain; a second one cuts its wait short."""
        if self._stop.is_set():
            self._force = True
            logger.warning("second stop signal: ending the requests still in flight now")
        self._stop.set()

    async def wait_stop_requested(self) -> None:
        await self._stop.wait()

    @contextlib.contextmanager
    def admitted(self) -> Iterator[Ticket]:
        """Count a request while it runs; refuse it once the drain began."""
        if self.draining:
            raise ShuttingDown("the server is shutting down; retry on another replica")
        ticket = Ticket(self)
        self.in_flight += 1
        try:
            yield ticket
        finally:
            if not ticket.relayed:
                self.in_flight -= 1

    def _open(self, source: AsyncIterator[T]) -> Relay[T]:
        relay = Relay(source, self._closed)
        self._relays.add(relay)
        if self._expired:
            relay.interrupt(_deadline_error())
        return relay

    def _closed(self, relay: Relay) -> None:
        self._relays.discard(relay)
        self.in_flight -= 1

    async def drain(self, timeout_s: float, forecast: Callable[[float], DrainForecast] | None = None) -> None:
        """Refuse new requests, wait up to `timeout_s` for those in flight, then end the rest. `forecast` says at
        the start how many generations the deadline is expected to cut (a warning then names a timeout that fits)."""
        self.draining = True
        self._stop.set()
        loop = asyncio.get_running_loop()
        started = loop.time()
        expected = forecast(timeout_s) if forecast is not None else None
        logger.log(logging.WARNING if expected is not None and expected.cut else logging.INFO,
                   "draining: %d request(s) in flight, waiting up to %g s (--drain-timeout)%s", self.in_flight,
                   timeout_s, f"; {expected.describe(timeout_s)}" if expected is not None else "")
        if await self._wait_idle(started + timeout_s):
            logger.info("drained in %.1f s", loop.time() - started)
            return
        self._expired = True
        logger.warning("drain timeout: ending %d request(s) still in flight", self.in_flight)
        for relay in list(self._relays):
            relay.interrupt(_deadline_error())
        self._force = False
        if not await self._wait_idle(loop.time() + FLUSH_S):
            logger.warning("%d request(s) did not end within %.0f s of the drain timeout", self.in_flight, FLUSH_S)

    async def _wait_idle(self, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        while self.in_flight and loop.time() < deadline and not self._force:
            await asyncio.sleep(POLL_S)
        return not self.in_flight


def _deadline_error() -> ShuttingDown:
    return ShuttingDown("the request was aborted: the server shut down before it finished (--drain-timeout)")


__all__ = ["IDLE", "ClientGone", "Idle", "Lifecycle", "Relay", "Ticket"]
