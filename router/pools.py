"""The router's two pools of workers, prefill and decode, and the planner that moves role-free workers between them
(cluster/routing/planner.py decides; this module applies, shows and logs). A move only changes where the router
sends new work (`Worker.pool`): nothing restarts, running decodes finish where they are, transfers complete.

Shown as `kvflow:worker_pool{worker,pool}` (1 for the current pool), `kvflow:pool_moves_total{from,to}`, one log
line per move with its reason, and the pools in the router's stats line.
"""

from __future__ import annotations

import asyncio
import logging
import time

from cluster.routing.planner import POOLS, Member, PlannerConfig, PoolPlanner
from router.metrics import RouterMetrics
from router.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

PLAN_INTERVAL_S = 1.0


class PoolManager:
    """Pool state and moves (the router's event loop only)."""

    def __init__(self, workers: WorkerPool, metrics: RouterMetrics, planner: PlannerConfig, adaptive: bool) -> None:
        self.workers = workers
        self.metrics = metrics
        self.planner = PoolPlanner(planner)
        self.adaptive = adaptive  # static: the pools stay as discovery listed them

    def move(self, worker: Worker, target: str, reason: str) -> bool:
        """Route new `target` work to `worker` from now on; False if it is already there."""
        if target not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(POOLS)}, got {target!r}")
        if not worker.role_free:
            raise ValueError(f"worker {worker.address} is pinned to {worker.role} (kvflow {worker.role}); only "
                             "role-free workers (kvflow worker) move between pools")
        if worker.pool == target:
            return False
        if worker.pool == "decode" and not [w for w in self.workers.workers("decode") if w is not worker]:
            raise ValueError(f"worker {worker.address} is the last decode worker; the decode pool cannot be empty")
        source, worker.pool, worker.pool_since = worker.pool, target, time.monotonic()
        name = worker.worker_id or worker.address
        self.metrics.pool_moves.labels(source, target).inc()
        self.metrics.set_pool(name, target)
        logger.info("pool move: worker %s (%s) %s -> %s: %s", name, worker.address, source, target, reason)
        return True

    def tick(self, now: float | None = None) -> None:
        """Refresh the pool gauges; apply the planner's move, if it wants one now."""
        now = time.monotonic() if now is None else now
        healthy = [w for w in self.workers.all_workers() if w.healthy]
        for w in healthy:
            self.metrics.set_pool(w.worker_id or w.address, w.pool)
        if not self.adaptive:
            return
        members = [Member(w.worker_id or w.address, w.pool, w.role_free, w.view().compute_domain, w.load,
                          w.pool_since) for w in healthy]
        move = self.planner.tick(now, members)
        if move is None:
            return
        worker = next(w for w in healthy if (w.worker_id or w.address) == move.worker_id)
        try:
            self.move(worker, move.target, move.reason)
        except ValueError as exc:  # it changed since the tick looked (it left, or the last decode worker did)
            logger.warning("pool move of %s skipped: %s", move.worker_id, exc)

    async def run(self, interval_s: float = PLAN_INTERVAL_S) -> None:
        while True:
            self.tick()
            await asyncio.sleep(interval_s)

    def summary(self) -> str:
        """The stats line's part: pool sizes (healthy workers) and moves so far."""
        healthy = [w for w in self.workers.all_workers() if w.healthy]
        sizes = ", ".join(f"{pool} {sum(w.pool == pool for w in healthy)}" for pool in POOLS)
        moves = sum(sample.value for metric in self.metrics.registry.collect() if metric.name == "kvflow:pool_moves"
                    for sample in metric.samples if sample.name.endswith("_total"))
        return f"Pools: {sizes} ({moves:.0f} moves)"
