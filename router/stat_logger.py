"""The router's periodic cluster line (issue #16), vLLM-style: what the cluster did since the last line.

    Router: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s, Running: 8 reqs,
    Waiting: 0 reqs, Requests: 12 (disaggregated 10, local_prefill 2), Route hit rate: 75.0%, Index lag: 3.2 ms,
    Workers healthy: 2/2, KV usage: p:12% d:40%, Prefix cache hit rate: 41.3%, Pools: prefill 1, decode 1 (0 moves)

Rates and shares cover the interval since the previous line (a quiet interval reads 0 / "-"), read from the
router's own Prometheus registry, so the line and /metrics never disagree.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

PATHS = ("disaggregated", "local_prefill", "unknown")


@dataclass(frozen=True)
class WorkerSummary:
    role: str  # the pool it serves now
    healthy: bool
    kv_cache_usage: float


@dataclass(frozen=True)
class _Totals:
    at: float
    prompt_tokens: float
    generation_tokens: float
    requests: dict[str, float]
    routes: float
    route_hits: float
    lag_sum: float
    lag_count: float
    prefix_queries: float
    prefix_hits: float


class RouterStatLogger:
    def __init__(self, registry: CollectorRegistry, now: float | None = None) -> None:
        self.registry = registry
        self.last = self._totals(time.monotonic() if now is None else now)

    def line(self, workers: Sequence[WorkerSummary], now: float | None = None, pools: str = "") -> str:
        cur = self._totals(time.monotonic() if now is None else now)
        last, self.last = self.last, cur
        elapsed = max(cur.at - last.at, 1e-9)
        requests = {p: cur.requests[p] - last.requests[p] for p in PATHS}
        num_requests = sum(requests.values())
        by_path = ", ".join(f"{p} {n:.0f}" for p, n in requests.items() if n)
        routes = cur.routes - last.routes
        lag_n = cur.lag_count - last.lag_count
        queries = cur.prefix_queries - last.prefix_queries
        healthy = [w for w in workers if w.healthy]
        value = self.registry.get_sample_value
        return (f"Router: Avg prompt throughput: {(cur.prompt_tokens - last.prompt_tokens) / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {(cur.generation_tokens - last.generation_tokens) / elapsed:.1f} "
                f"tokens/s, Running: {value('vllm:num_requests_running') or 0:.0f} reqs, "
                f"Waiting: {value('vllm:num_requests_waiting') or 0:.0f} reqs, "
                f"Requests: {num_requests:.0f}{f' ({by_path})' if by_path else ''}, "
                f"Route hit rate: {_share(cur.route_hits - last.route_hits, routes)}, "
                f"Index lag: {f'{1000 * (cur.lag_sum - last.lag_sum) / lag_n:.1f} ms' if lag_n else '-'}, "
                f"Workers healthy: {len(healthy)}/{len(workers)}, "
                f"KV usage: {' '.join(f'{w.role[0]}:{w.kv_cache_usage:.0%}' for w in healthy) or '-'}, "
                f"Prefix cache hit rate: {_share(cur.prefix_hits - last.prefix_hits, queries)}"
                + (f", {pools}" if pools else ""))

    def _totals(self, at: float) -> _Totals:
        value = self.registry.get_sample_value

        def total(name: str, labels: dict[str, str] | None = None) -> float:
            return value(name, labels) or 0.0

        return _Totals(at, total("vllm:prompt_tokens_total"), total("vllm:generation_tokens_total"),
                       {p: total("kvflow:requests_total", {"path": p}) for p in PATHS},
                       self._all_labels("kvflow:route_decisions"),
                       total("kvflow:route_prefix_hits_total"), total("kvflow:index_lag_seconds_sum"),
                       total("kvflow:index_lag_seconds_count"), total("vllm:prefix_cache_queries_total"),
                       total("vllm:prefix_cache_hits_total"))


    def _all_labels(self, family: str) -> float:
        """A labelled counter's total over all its label values."""
        return sum(sample.value for metric in self.registry.collect() if metric.name == family
                   for sample in metric.samples if sample.name == f"{family}_total")


def _share(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"
