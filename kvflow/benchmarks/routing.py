"""`kvflow bench routing`: shared-prefix traffic through a router under each policy, same workers.

One cluster (N prefill workers, decode workers without a prefix cache so prompt KV always comes from the
chosen prefill worker), one `kvflow router` subprocess per policy, fresh prefixes per policy (caches of earlier
runs cannot help). Ends with one JSON line: {policy: {ttft_p50_s, ttft_p99_s, prefix_hit_rate, ...}}.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx

from cluster.auth import ClusterAuth
from cluster.routing.policy import POLICY_NAMES
from engine.arg_utils import EngineArgs
from kvflow.benchmarks.prom import histogram_quantile, metric_sum
from kvflow.benchmarks.serve import make_prompts, run_benchmark, summarize
from kvflow.benchmarks.server import ServerProcess
from kvflow.launcher import ClusterSpec, WorkerCluster


def _policy_result(base: str, prompts: list[list[int]], output_len: int, max_concurrency: int) -> dict[str, Any]:
    outcome, duration = asyncio.run(run_benchmark(base, None, prompts, output_len, float("inf"), max_concurrency,
                                                  None))
    summary = summarize(outcome, duration)
    metrics = httpx.get(f"{base}/metrics").text
    queries = metric_sum(metrics, "vllm:prefix_cache_queries_total") or 0.0
    hits = metric_sum(metrics, "vllm:prefix_cache_hits_total") or 0.0
    return {"ttft_p50_s": summary["median_ttft_ms"] / 1e3, "ttft_p99_s": summary["p99_ttft_ms"] / 1e3,
            "ttft_mean_s": summary["mean_ttft_ms"] / 1e3, "e2el_p50_s": summary["median_e2el_ms"] / 1e3,
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "matched_blocks": metric_sum(metrics, "kvflow:route_prefix_matched_blocks_total") or 0.0,
            "index_lag_p99_s_upper_bound": histogram_quantile(metrics, "kvflow:index_lag_seconds", 0.99),
            "completed": summary["completed"], "failed": summary["failed"],
            "request_throughput": summary["request_throughput"]}


def run_routing_bench(engine_args: EngineArgs, prefill_workers: int, decode_workers: int, num_prefixes: int,
                      prefix_len: int, input_len: int, output_len: int, repeats: int, max_concurrency: int,
                      policies: tuple[str, ...] = POLICY_NAMES) -> dict[str, Any]:
    auth = ClusterAuth.from_env().with_token()  # the workers' token; each router gets it in its environment
    spec = ClusterSpec(engine_args, prefill_workers, decode_workers,
                       decode_extra_args=("--no-enable-prefix-caching",), auth=auth)
    results: dict[str, Any] = {}
    with WorkerCluster(spec) as cluster:
        cluster.wait_ready()
        for n, policy in enumerate(policies):
            with ServerProcess.kvflow(
                    "router", "--prefill", ",".join(cluster.addresses("prefill")), "--decode",
                    ",".join(cluster.addresses("decode")), "--routing", policy, "--disable-log-requests",
                    "--disable-log-stats", env={**os.environ, **auth.env()}) as router:
                router.wait_ready(120)
                prompts = make_prompts("shared-prefix", num_prefixes * repeats, input_len, prefix_len,
                                       num_prefixes, seed=1000 + n, vocab=400 if engine_args.model.startswith(
                                           "tiny") else 30000)
                results[policy] = _policy_result(router.url, prompts, output_len, max_concurrency)
    return results
