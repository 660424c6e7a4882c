"""Prometheus exporter of one engine: vLLM's metric names (label `model_name`) plus `kvflow:*` for P/D.

It reads `EngineStats` snapshots and finished-request timings handed over by the engine thread every ~0.5 s
(engine/async_engine.py), never per token. One `CollectorRegistry` per instance: no global registry state.
The MoE expert-load histogram is bucketed in the engine (one observation per layer and expert per step, too many
to hand over one by one) and exported from the last snapshot's cumulative buckets by its own collector.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from engine.metrics.buckets import (
    E2E_BUCKETS,
    KV_TRANSFER_BUCKETS,
    MOE_EXPERT_TOKENS_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
)
from engine.metrics.stats import EngineStats, FinishedRequestTiming

MOE_EXPERT_TOKENS = "kvflow:moe_expert_tokens"


class ExpertLoadCollector:
    """`kvflow:moe_expert_tokens`: tokens routed to one expert of one MoE layer in one step (nothing for dense
    models)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = EngineStats()

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(MOE_EXPERT_TOKENS, "Tokens routed to one expert of one MoE layer in one "
                                     "engine step (one observation per layer and expert per step).",
                                     labels=["model_name"])

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[HistogramMetricFamily]:
        buckets = self.stats.moe_expert_tokens_buckets
        if not buckets:
            return
        family = self._family()
        bounds = [floatToGoString(b) for b in (*MOE_EXPERT_TOKENS_BUCKETS, float("inf"))]
        family.add_metric([self.model_name], list(zip(bounds, buckets, strict=True)),
                          sum_value=self.stats.moe_expert_tokens_sum)
        yield family


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, m, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, m, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "Alias of vllm:kv_cache_usage_perc.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.external_queries = counter("vllm:external_prefix_cache_queries",
                                        "Prompt tokens looked up while the host KV tier is on (--kv-offloading-size).")
        self.external_hits = counter("vllm:external_prefix_cache_hits",
                                     "Prompt tokens loaded back from the host KV tier instead of recomputed.")
        self.offloaded_blocks = counter("kvflow:kv_offloaded_blocks",
                                        "KV blocks copied to the host tier when evicted from the device cache.")
        self.host_dropped_blocks = counter("kvflow:kv_host_dropped_blocks",
                                           "KV blocks a full host tier let go (its least recently used, or the "
                                           "evicted block itself when every slot is held).")
        self.host_cache_usage = gauge("kvflow:kv_host_cache_usage_perc",
                                      "Host KV tier usage (--kv-offloading-size). 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = Counter("vllm:request_success", "Count of finished requests.", ["model_name",
                               "finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token.", TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time spent waiting in the queue.",
                                    E2E_BUCKETS)
        self.transfer_bytes = Counter("kvflow:kv_transfer_bytes", "KV bytes moved between workers, by transfer "
                                      "backend (nccl, gloo, grpc).", ["model_name", "backend"], registry=r)
        self.transfer_seconds = Histogram("kvflow:kv_transfer_seconds", "Duration of one request's KV transfer "
                                          "(overlapping prefill compute), by backend.", ["model_name", "backend"],
                                          buckets=KV_TRANSFER_BUCKETS, registry=r)
        self.itl_prefill_budget = gauge("kvflow:itl_prefill_token_budget",
                                        "Prefill tokens the last step could carry under --itl-target-ms (0: "
                                        "uncapped: the flag is off, no request decoded, or the step-time model "
                                        "is still learning).")
        self.blocks_freed = counter("kvflow:kv_blocks_freed",
                                    "KV blocks freed after a transfer finished, was cancelled or its lease expired.")
        self.fetched_tokens = counter("kvflow:kv_fetched_tokens",
                                      "Prompt tokens received from the worker that prefilled them and had them "
                                      "cached (pulled from its prefix cache or host tier, computed nowhere).")
        self.fallback = Counter("kvflow:disagg_fallback", "Disaggregated prefills that fell back to local "
                                "recompute.", ["model_name", "reason"], registry=r)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.", ["model_name", "position"],
                                             registry=r)
        self._last = EngineStats()
        self.expert_load = ExpertLoadCollector(model_name)
        r.register(self.expert_load)

    def update(self, stats: EngineStats, timings: list[FinishedRequestTiming]) -> None:
        """Apply a stats snapshot (cumulative counters become increments) and observe finished requests."""
        last, self._last = self._last, stats
        self.expert_load.stats = stats
        self.running.set(stats.num_requests_running)
        self.waiting.set(stats.num_requests_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        self.itl_prefill_budget.set(stats.itl_prefill_token_budget)
        self.host_cache_usage.set(stats.kv_host_cache_usage)
        for metric, now, before in (
            (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
            (self.external_queries, stats.external_prefix_cache_queries, last.external_prefix_cache_queries),
            (self.external_hits, stats.external_prefix_cache_hits, last.external_prefix_cache_hits),
            (self.offloaded_blocks, stats.kv_offloaded_blocks, last.kv_offloaded_blocks),
            (self.host_dropped_blocks, stats.kv_host_dropped_blocks, last.kv_host_dropped_blocks),
            (self.preemptions, stats.num_preemptions, last.num_preemptions),
            (self.prompt_tokens, stats.prompt_tokens, last.prompt_tokens),
            (self.generation_tokens, stats.generation_tokens, last.generation_tokens),
            (self.spec_drafts, stats.spec_decode_num_drafts, last.spec_decode_num_drafts),
            (self.spec_draft_tokens, stats.spec_decode_num_draft_tokens, last.spec_decode_num_draft_tokens),
            (self.spec_accepted_tokens, stats.spec_decode_num_accepted_tokens, last.spec_decode_num_accepted_tokens),
        ):
            if now > before:
                metric.inc(now - before)
        before_pos = last.spec_decode_num_accepted_tokens_per_pos
        for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            delta = count - (before_pos[position] if position < len(before_pos) else 0)
            if delta > 0:
                self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(delta)
        for reason, count in stats.request_success.items():
            delta = count - last.request_success.get(reason, 0)
            if delta > 0:
                self.success.labels(self.model_name, reason).inc(delta)
        for timing in timings:
            self.e2e.observe(timing.e2e_s)
            self.queue_time.observe(timing.queue_s)
            if timing.ttft_s is not None:
                self.ttft.observe(timing.ttft_s)
            if timing.mean_tpot_s is not None:
                for _ in range(timing.generation_tokens - 1):  # vLLM observes every inter-token interval
                    self.tpot.observe(timing.mean_tpot_s)

    def record_transfer(self, backend: str, num_bytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(self.model_name, backend).inc(num_bytes)
        self.transfer_seconds.labels(self.model_name, backend).observe(seconds)

    def record_fallback(self, reason: str) -> None:
        self.fallback.labels(self.model_name, reason).inc()

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Plain-HTTP `/metrics` on a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)
