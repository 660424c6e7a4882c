"""`kvflow bench multiturn`: multi-turn conversations through a router, with and without the host KV tier.

Workload: conversations that share one system prompt; turn t's prompt is the system prompt plus turns 1..t (user
text, then assistant text: fixed tokens per conversation and turn, so every mode sends the same prompts shape),
sent one turn after the other per conversation, `max_concurrency` conversations at once. With a working set
larger than the workers' device KV, earlier turns are evicted before the next one arrives.

Modes (each on fresh conversations, so no mode profits from another's cache):
- `no-tier`: prefix routing, device prefix caches only;
- `host-tier`: prefix routing, `--kv-offloading-size` on the prefill workers;
- `round-robin`: `--routing round-robin`, no tier: the baseline without kvflow's router.
(Cross-worker fetch, issue 31 item 3, does not exist yet: no mode claims it.)

Topology: as `kvflow bench routing`, N prefill workers, which the router picks by cached prefix, and decode
workers without a prefix cache, and `--disagg-policy static`, so every prompt's KV comes from the routed prefill
worker and each prompt is looked up once (the decode workers get room for every turn in flight); in `host-tier` mode only the prefill workers get `--kv-offloading-size`. One record per mode: `workload`,
`device`, `mode`, `ttft_p50_s`, `ttft_p99_s`, `prefix_hit_rate` (prompt tokens not computed, over prompt tokens:
`device`, `host` (loaded back from the prefill workers' host tiers) and their `total`), `false_hits`, `itl_p99_s`,
`out_tok_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any

import httpx
import numpy as np

from cluster.auth import ClusterAuth
from cluster.worker.events import HEARTBEAT_S
from engine.arg_utils import EngineArgs
from kvflow.benchmarks.multiturn_workload import MODES, Workload, make_conversations
from kvflow.benchmarks.serve import RequestResult, http_client, one_request
from kvflow.benchmarks.server import ServerProcess
from kvflow.launcher import ClusterSpec, WorkerCluster


async def run_conversations(base: str, conversations: list[list[list[int]]], output_len: int,
                            max_concurrency: int) -> tuple[list[RequestResult], float]:
    async with http_client() as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        limit = asyncio.Semaphore(max_concurrency)

        async def converse(prompts: list[list[int]]) -> list[RequestResult]:
            async with limit:
                return [await one_request(client, f"{base}/v1/completions", model, p, output_len, None)
                        for p in prompts]

        start = time.perf_counter()
        done = await asyncio.gather(*(converse(c) for c in conversations))
        return [r for results in done for r in results], time.perf_counter() - start


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _record(mode: str, workload: Workload, device: str, results: list[RequestResult],
            duration_s: float, metrics: str) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = np.asarray([r.ttft_s for r in ok] or [0.0])
    itl = np.asarray([x for r in ok for x in r.itl_s] or [0.0])
    queries = _metric(metrics, "vllm:prefix_cache_queries_total")
    hits = _metric(metrics, "vllm:prefix_cache_hits_total")
    host = min(_metric(metrics, 'vllm:external_prefix_cache_hits_total{role="prefill"}'), hits)
    return {"workload": {**dataclasses.asdict(workload), "max_prompt_tokens": workload.max_prompt_tokens},
            "device": device, "mode": mode,
            "ttft_p50_s": float(np.median(ttft)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "prefix_hit_rate": {"device": (hits - host) / queries if queries else 0.0,
                                "host": host / queries if queries else 0.0,
                                "total": hits / queries if queries else 0.0},
            "false_hits": int(_metric(metrics, "kvflow:route_false_hits_total")),
            "itl_p99_s": float(np.percentile(itl, 99)),
            "out_tok_s": sum(r.output_tokens for r in ok) / duration_s,
            "completed": len(ok), "failed": len(results) - len(ok)}


def _device_name(engine_args: EngineArgs) -> str:
    import torch

    if engine_args.device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name()


def _run_mode(cluster: WorkerCluster, auth: ClusterAuth, mode: str, workload: Workload, seed: int, vocab: int,
              device: str) -> dict[str, Any]:
    routing = "round-robin" if mode == "round-robin" else "prefix"
    with ServerProcess.kvflow("router", "--prefill", ",".join(cluster.addresses("prefill")), "--decode",
                              ",".join(cluster.addresses("decode")), "--routing", routing, "--disagg-policy", "static",
                              "--disable-log-requests",
                              "--disable-log-stats", env={**os.environ, **auth.env()}) as router:
        router.wait_ready(120)
        conversations = make_conversations(workload, seed, vocab)
        results, duration = asyncio.run(run_conversations(router.url, conversations, workload.output_len,
                                                          workload.max_concurrency))
        time.sleep(HEARTBEAT_S * 2)  # the workers' last cumulative counters arrive with a heartbeat
        metrics = httpx.get(f"{router.url}/metrics").text
    return _record(mode, workload, device, results, duration, metrics)


def _decode_blocks(workload: Workload, block_size: int) -> int:
    """Room on the decode workers for every turn in flight at its longest (plus the null block): a decode worker
    that cannot reserve a prompt prefills it locally, and the prefill workers' caches are what is measured."""
    per_turn = -(-(workload.max_prompt_tokens + workload.output_len) // block_size)
    return workload.max_concurrency * per_turn + 1


def run_multiturn_bench(engine_args: EngineArgs, workload: Workload, prefill_workers: int, decode_workers: int,
                        modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    """One record per mode; the tier's modes and the others run on two clusters of the same shape."""
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown --modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if "host-tier" in modes and engine_args.kv_offloading_size is None:
        raise ValueError("mode host-tier needs --kv-offloading-size (GiB of host memory per worker)")
    auth = ClusterAuth.from_env().with_token()
    device = _device_name(engine_args)
    vocab = 400 if engine_args.model.startswith("tiny") else 30000
    plain = dataclasses.replace(engine_args, kv_offloading_size=None, kv_offloading_backend=None)
    tier = ("--kv-offloading-size", str(engine_args.kv_offloading_size), "--kv-offloading-backend", "native")
    records: dict[str, dict[str, Any]] = {}
    for prefill_args, group in (((), [m for m in modes if m != "host-tier"]), (tier, ["host-tier"])):
        group = [m for m in group if m in modes]
        if not group:
            continue
        spec = ClusterSpec(plain, prefill_workers, decode_workers, auth=auth, prefill_extra_args=prefill_args,
                           decode_extra_args=("--no-enable-prefix-caching", "--num-gpu-blocks-override",
                                              str(_decode_blocks(workload, engine_args.block_size))))
        with WorkerCluster(spec) as cluster:
            cluster.wait_ready()
            for mode in group:
                records[mode] = _run_mode(cluster, auth, mode, workload, 1000 + MODES.index(mode), vocab, device)
    return [records[m] for m in modes]
