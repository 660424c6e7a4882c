"""The router's periodic cluster line (router/stat_logger.py, issue #16): throughput, requests per path, route hit
rate and index lag over the interval since the previous line, read from the router's own metrics."""

from __future__ import annotations

import re

from router.metrics import RouterMetrics
from router.stat_logger import RouterStatLogger, WorkerSummary


def test_cluster_line_reports_the_interval_since_the_last_line() -> None:
    m = RouterMetrics()
    stats = RouterStatLogger(m.registry, now=100.0)
    workers = [WorkerSummary("prefill", True, 0.12), WorkerSummary("decode", True, 0.4),
               WorkerSummary("decode", False, 0.9)]
    idle = stats.line(workers, now=110.0)
    assert "Avg prompt throughput: 0.0 tokens/s" in idle and "Requests: 0," in idle
    assert "Route hit rate: -" in idle and "Index lag: -" in idle and "Workers healthy: 2/3" in idle
    assert "KV usage: p:12% d:40%" in idle

    m.prompt_tokens.inc(2000)
    m.generation_tokens.inc(500)
    m.requests.labels("disaggregated").inc(3)
    m.requests.labels("local_prefill").inc(1)
    for hit in (True, True, True, False):
        m.route_decisions.labels("prefix_aware").inc()
        if hit:
            m.route_prefix_hits.inc()
    m.index_lag.observe(0.002)
    m.index_lag.observe(0.004)
    m.prefix_queries.inc(2000)
    m.prefix_hits.inc(500)
    m.running.set(4)
    busy = stats.line(workers, now=120.0)
    assert busy.startswith("Router: Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: 50.0 tokens/s")
    assert "Running: 4 reqs" in busy and "Requests: 4 (disaggregated 3, local_prefill 1)" in busy
    assert "Route hit rate: 75.0%" in busy and "Index lag: 3.0 ms" in busy and "Prefix cache hit rate: 25.0%" in busy

    again = stats.line(workers, now=130.0)  # nothing new: the interval is quiet again
    assert re.search(r"Avg generation throughput: 0\.0 tokens/s.*Requests: 0,.*Route hit rate: -", again)
