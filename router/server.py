"""Run a router: discovery -> worker pool, the OpenAI HTTP app (uvicorn) and the gRPC front in one event loop."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from router.config import RouterConfig
from router.core import Router
from router.discovery import make_discovery
from router.grpc_server import start_grpc_server
from router.openai_api import build_app

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 10.0


async def serve_router(config: RouterConfig, ready: asyncio.Event | None = None) -> None:
    router = Router(config)
    discovery = make_discovery(config, router.pool.set_addresses)
    discovery.start()
    grpc_server = await start_grpc_server(router, config.host, config.grpc_port) if config.grpc_port else None
    app = build_app(router)
    uv = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                       access_log=not config.disable_log_requests, timeout_graceful_shutdown=5))
    stats = None if config.disable_log_stats else asyncio.create_task(_log_stats(router))
    warmup = asyncio.create_task(_load_tokenizer_early(router))
    logger.info("router: OpenAI API on http://%s:%d/v1, routing=%s, index=%s", config.host, config.port,
                config.routing, "memory" if config.index == "memory" else "redis")
    try:
        if ready is not None:
            asyncio.get_running_loop().call_later(0.5, ready.set)
        await uv.serve()
    finally:
        warmup.cancel()
        if stats is not None:
            stats.cancel()
        discovery.stop()
        if grpc_server is not None:
            await grpc_server.stop(grace=2.0)
        await router.close()


async def _load_tokenizer_early(router: Router) -> None:
    """Load the tokenizer as soon as a worker names the model, not on the first request."""
    while router.pool.model_info is None:
        await asyncio.sleep(0.1)
    try:
        await router.ensure_tokenizers()
    except Exception as exc:  # reported again, as a 4xx/5xx, on the requests that need it
        logger.warning("tokenizer not loaded: %s", exc)


async def _log_stats(router: Router) -> None:
    """vLLM-style periodic stats line (off with --disable-log-stats)."""
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        workers = router.pool.all_workers()
        healthy = [w for w in workers if w.healthy]
        usage = [f"{w.role[0]}:{w.load.kv_cache_usage:.0%}" for w in healthy]
        value = router.metrics.registry.get_sample_value
        queries = value("vllm:prefix_cache_queries_total") or 0.0
        logger.info("Running: %d reqs, Waiting: %d reqs, workers healthy %d/%d, KV usage %s, prefix hit rate %.1f%%",
                    value("vllm:num_requests_running") or 0, value("vllm:num_requests_waiting") or 0, len(healthy),
                    len(workers), " ".join(usage) or "-",
                    100.0 * (value("vllm:prefix_cache_hits_total") or 0.0) / max(queries, 1.0))
