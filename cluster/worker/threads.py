"""Running blocking work off a worker's event loop on threads that end with it.

Why not asyncio.to_thread: each thread that runs parallel torch ops on the CPU keeps an OpenMP thread pool for as
long as it lives, and with more pooled threads than cores libgomp stops spinning between parallel regions, so every
region pays a futex wake-up. A model loaded on the executor's long-lived thread made the engine thread's decode
step 41-44 -> 51-56 ms (SmolLM2 fp32, batch 8, 2 cores; bench/CPU_PROFILE.md). So the model load and the gRPC
backend's KV writes each run on a passing thread, and the engine thread keeps the process's only long-lived pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a thread of its own that ends with it, awaited. The call runs to its end even if the caller is
    cancelled meanwhile (its result is then dropped)."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    done.set_running_or_notify_cancel()  # running from now on: a cancelled caller cannot cancel the call itself

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            done.set_exception(exc)

    waiter = asyncio.wrap_future(done)  # settled on the caller's loop, thread-safely
    threading.Thread(target=run, name=f"passing-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await waiter
