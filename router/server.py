"""Run a router: discovery -> worker pool, the OpenAI HTTP app (uvicorn) and the gRPC front in one event loop.

SIGTERM/SIGINT start the drain (router.lifecycle) instead of uvicorn's own shutdown, whose listeners would close
at once and whose in-flight requests would be cut after its graceful timeout: both fronts keep listening and
refuse new requests with 503 / UNAVAILABLE, in-flight requests get up to --drain-timeout, the rest are ended
properly, and only then do the listeners close. A second signal cuts the wait short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from engine.process.cpu_memory import return_large_blocks_to_os
from engine.process.gc_heap import freeze_startup_heap
from router.config import RouterConfig
from router.core import Router
from router.discovery import make_discovery
from router.grpc_server import start_grpc_server
from router.http import with_header_timeout
from router.openai_api import build_app
from router.stat_logger import RouterStatLogger, WorkerSummary

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 10.0
SHUTDOWN_GRACE_S = 5.0  # after the drain: for the last bytes of ended responses, then connections are cut


class _DrainingServer(uvicorn.Server):
    """uvicorn whose exit signals start the router's drain; uvicorn itself exits once `should_exit` is set."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: hand over to the event loop (not recorded, so uvicorn does not raise it again later).
        logger.info("received %s", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._on_signal)


async def serve_router(config: RouterConfig, ready: asyncio.Event | None = None, router: Router | None = None,
                       freeze_heap: bool = False) -> None:
    """Serve until stopped: a signal, or `router.lifecycle.request_stop()` (then drain first). `freeze_heap`: this
    process serves the router alone (`kvflow router`, `kvflow serve`), so its start-up heap, tokenizer included,
    may leave the garbage collector's full collections (engine/process/gc_heap.py); never in a caller's process."""
    return_large_blocks_to_os()  # huge request bodies must not stay in the router's heap
    router = router if router is not None else Router(config)
    discovery = make_discovery(config, router.pool.set_addresses)
    discovery.start()
    grpc_server = await start_grpc_server(router, config.host, config.grpc_port) if config.grpc_port else None
    app = build_app(router)
    uv = _DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                        http=with_header_timeout(config.request_header_timeout_s),
                                        access_log=not config.disable_log_requests,
                                        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S)),
                         router.lifecycle.request_stop)
    stats = None if config.disable_log_stats else asyncio.create_task(_log_stats(router))
    warmup = asyncio.create_task(_load_tokenizer_early(router, freeze_heap))
    planner = asyncio.create_task(router.pools.run())
    logger.info("router: OpenAI API on http://%s:%d/v1, routing=%s, disagg-policy=%s, index=%s", config.host,
                config.port, config.routing, config.disagg_policy, "memory" if config.index == "memory" else "redis")
    serving = asyncio.create_task(uv.serve())
    stop = asyncio.create_task(router.lifecycle.wait_stop_requested())
    try:
        if ready is not None:
            asyncio.get_running_loop().call_later(0.5, ready.set)
        await asyncio.wait((serving, stop), return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            await router.lifecycle.drain(config.drain_timeout_s, router.drain_forecast)
            uv.should_exit = True
        await serving
    finally:
        stop.cancel()
        if not serving.done():  # we were cancelled: so is the HTTP server
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
        warmup.cancel()
        planner.cancel()
        if stats is not None:
            stats.cancel()
        discovery.stop()
        if grpc_server is not None:
            await grpc_server.stop(grace=SHUTDOWN_GRACE_S)
        await router.close()
        logger.info("router stopped")


async def _load_tokenizer_early(router: Router, freeze_heap: bool) -> None:
    """Load the tokenizer as soon as a worker names the model, not on the first request; then, where asked, freeze
    the start-up heap (the tokenizers are its last large part)."""
    while router.pool.model_info is None:
        await asyncio.sleep(0.1)
    try:
        await router.ensure_tokenizers()
    except Exception as exc:  # reported again, as a 4xx/5xx, on the requests that need it
        logger.warning("tokenizer not loaded: %s", exc)
    if freeze_heap:
        freeze_startup_heap("router")


async def _log_stats(router: Router) -> None:
    """vLLM-style periodic cluster line (router/stat_logger.py; off with --disable-log-stats)."""
    stats = RouterStatLogger(router.metrics.registry)
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        logger.info("%s", stats.line([WorkerSummary(w.pool, w.healthy, w.load.kv_cache_usage)
                                      for w in router.pool.all_workers()], pools=router.pools.summary()))
