"""The router's Prometheus metrics: vLLM's names for what a client sees, `kvflow:*` for routing and the index.

One `CollectorRegistry` per router instance (no module-global state). Worker gauges carry a `worker` label and
come from the workers' heartbeats; latency histograms are measured at the router, i.e. as clients see them.
The `worker` label is the worker's id only with --expose-worker-addresses: ids default to `<role>-<host>-<port>`,
and /metrics is often open, so by default it is an opaque stable name (`opaque_worker_name`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cluster.routing.events import WorkerLoad
from engine.metrics.buckets import (
    INDEX_LAG_BUCKETS,
    ROUTE_BUCKETS,
    ROUTER_E2E_BUCKETS,
    ROUTER_TTFT_BUCKETS,
    TPOT_BUCKETS,
)


def opaque_worker_name(worker_id: str, key: bytes = b"") -> str:
    """A stable name that does not show the worker's id: its HMAC, keyed by the cluster token when there is one, so a
    worker has the same name on every router of its cluster and the name cannot be reversed by guessing hosts and
    ports."""
    return "worker-" + hmac.new(key, worker_id.encode(), hashlib.sha256).hexdigest()[:12]


def worker_namer(expose: bool, key: bytes = b"") -> Callable[[str], str]:
    """How a worker id is shown in metric labels and /v1/models: as it is (`expose`), or opaque."""
    if expose:
        return str
    return lambda worker_id: opaque_worker_name(worker_id, key)


class RouterMetrics:
    def __init__(self, worker_name: Callable[[str], str] = str) -> None:
        self.worker_name = worker_name  # a worker id -> its `worker` label value
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in flight through this router.",
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests being tokenized or routed.",
                             registry=r)
        worker_labels = ["worker", "role"]
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage per worker (1 = full).", worker_labels,
                              registry=r)
        self.gpu_cache_usage = Gauge("vllm:gpu_cache_usage_perc", "Alias of vllm:kv_cache_usage_perc.",
                                     worker_labels, registry=r)
        self.worker_running = Gauge("kvflow:worker_num_requests_running", "Running requests per worker.",
                                    worker_labels, registry=r)
        self.worker_waiting = Gauge("kvflow:worker_num_requests_waiting", "Waiting requests per worker.",
                                    worker_labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions reported by the workers.",
                                   registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in prefix caches.",
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from prefix caches.",
                                   registry=r)
        self.external_prefix_hits = Counter("vllm:external_prefix_cache_hits",
                                            "Prompt tokens the workers loaded back from their host KV tiers, by the "
                                            "role of the worker.", ["role"], registry=r)
        self.host_dropped_blocks = Counter("kvflow:kv_host_dropped_blocks",
                                           "KV blocks the workers' full host tiers let go, by the role of the worker.",
                                           ["role"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.",
                                         registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token at the router.",
                              buckets=ROUTER_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency at the router.",
                             buckets=ROUTER_E2E_BUCKETS, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        self.requests = Counter("kvflow:requests", "Requests by prefill path.", ["path"], registry=r)
        self.prefix_matched_blocks = Counter("kvflow:route_prefix_matched_blocks",
                                             "Cached prefix blocks on the chosen prefill worker.", registry=r)
        self.prefix_matched_host_blocks = Counter(
            "kvflow:route_prefix_matched_host_blocks",
            "Of those, blocks in the worker's host KV tier (loaded back there, not recomputed).", registry=r)
        self.false_hits = Counter(
            "kvflow:route_false_hits",
            "Requests routed for a cached prefix that the worker then recomputed, in part or whole.", registry=r)
        self.route_decisions = Counter("kvflow:route_decisions", "Routing decisions by policy.", ["policy"],
                                       registry=r)
        self.route_prefix_hits = Counter("kvflow:route_prefix_hits",
                                         "Routing decisions whose prefill worker held part of the prompt's prefix.",
                                         registry=r)
        self.index_lag = Histogram("kvflow:index_lag_seconds", "Worker event send -> applied to the index.",
                                   buckets=INDEX_LAG_BUCKETS, registry=r)
        self.index_unavailable = Counter("kvflow:index_unavailable",
                                         "Index operations that failed because the backend was unreachable.",
                                         registry=r)
        self.route_seconds = Histogram("kvflow:route_seconds", "Hashing + index lookup + scoring per request.",
                                       buckets=ROUTE_BUCKETS, registry=r)
        self.retries = Counter("kvflow:router_retries", "Requests re-sent to another worker.", ["reason"],
                               registry=r)
        self.migrations = Counter("kvflow:migrations", "Requests moved mid-stream to another decode worker (the "
                                  "prompt plus the tokens already streamed).", ["reason"], registry=r)
        self.worker_restarts = Counter("kvflow:worker_restarts", "Dead workers restarted by `kvflow serve`.", ["role"],
                                       registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between streamed tokens at the router.",
                             buckets=TPOT_BUCKETS, registry=r)
        self.prefill_path = Counter("kvflow:prefill_path_decisions", "Per-request prefill choices: remote (a "
                                    "prefill-pool worker) or local (the decode worker), by reason.",
                                    ["path", "reason"], registry=r)
        self.fetch_decisions = Counter("kvflow:prefix_fetch_decisions", "Requests whose prompt another worker "
                                       "caches more of than the planned prefiller: pulled from it (fetch) or "
                                       "recomputed, by reason.", ["path", "reason"], registry=r)
        self.worker_pool = Gauge("kvflow:worker_pool", "1 for the pool each worker serves now (prefill or decode), "
                                 "0 for the other.", ["worker", "pool"], registry=r)
        self.pool_moves = Counter("kvflow:pool_moves", "Workers moved between pools by the planner.", ["from", "to"],
                                  registry=r)
        for source, target in (("prefill", "decode"), ("decode", "prefill")):  # exported at 0 before any move
            self.pool_moves.labels(source, target)
        self._cumulative_seen: dict[str, dict[str, int]] = {}  # counter -> worker -> last cumulative value

    def observe_load(self, worker: str, role: str, load: WorkerLoad) -> None:
        labels = (self.worker_name(worker), role)
        self.kv_usage.labels(*labels).set(load.kv_cache_usage)
        self.gpu_cache_usage.labels(*labels).set(load.kv_cache_usage)
        self.worker_running.labels(*labels).set(load.num_running)
        self.worker_waiting.labels(*labels).set(load.num_waiting)
        for counter, name, value in ((self.preemptions, "preemptions", load.num_preemptions),
                                     (self.external_prefix_hits.labels(role), "external_hits",
                                      load.external_prefix_cache_hits),
                                     (self.host_dropped_blocks.labels(role), "host_dropped",
                                      load.host_dropped_blocks)):
            seen = self._cumulative_seen.setdefault(name, {})
            previous = seen.get(worker, value)  # counted from this router's first sight of the worker
            if value > previous:
                counter.inc(value - previous)
            seen[worker] = value

    def set_pool(self, worker: str, pool: str) -> None:
        label = self.worker_name(worker)
        for name in ("prefill", "decode"):
            self.worker_pool.labels(label, name).set(1.0 if name == pool else 0.0)

    def forget_worker(self, worker: str, role: str) -> None:
        for gauge in (self.kv_usage, self.gpu_cache_usage, self.worker_running, self.worker_waiting):
            with contextlib.suppress(KeyError):
                gauge.remove(self.worker_name(worker), role)
        for seen in self._cumulative_seen.values():
            seen.pop(worker, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
