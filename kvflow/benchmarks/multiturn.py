"""`kvflow bench multiturn` (issue 31): multi-turn conversations whose working set is several times the workers'
KV cache, through `kvflow serve`, once per mode, the same conversations each time.

Each conversation opens with one shared system prompt; every turn appends the user's new tokens, then the model's
answer (its greedy token ids, from the gRPC front), so turn t's prompt extends turn t-1's. Turns run turn-major: turn
t of every conversation (at most `max_concurrency` at once) before turn t + 1, so a conversation's blocks wait while
the others' pass through the cache, as they do between a user's messages.

Modes (each a fresh `kvflow serve` with the same other flags):
- `no_tier`: prefix-aware routing, device KV only, `--no-prefix-fetch`;
- `host_tier`: plus `--kv-offloading-backend native --kv-offloading-size <GiB>`, still `--no-prefix-fetch`;
- `host_tier_fetch`: the host tier plus the cross-worker fetch (`kvflow serve`'s default: a turn routed to a worker
  that misses the conversation's prefix pulls it from the worker holding it, when cheaper; docs/cluster.md);
- `round_robin`: `--routing round-robin`, no tier (what a user without kvflow's router has; with no index it never
  fetches).

Invariants: prompts are token ids drawn from a seeded generator, identical across modes; every answer is greedy,
so each mode's outputs must agree (the record carries a digest of them). Records: `workload`, `device`, `mode`,
`ttft_p50_s`, `ttft_p99_s`, `prefix_hit_rate` (`total` from the requests' cached tokens, and the host tier's share
where the workers count it), `false_hits`, `fetches` (turns whose prefix was pulled from another worker),
`host_dropped_blocks` (blocks the workers' full host tiers let go), `itl_p99_s`, `out_tok_s`; and
`ttft_p50_s_by_turn` (each turn's median over the conversations).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvflow.benchmarks.prom import metric_sum
from kvflow.benchmarks.server import ServerProcess
from kvflow.launcher import free_port

HOST_TIER = ("--kv-offloading-backend", "native", "--kv-offloading-size", "{host_gib}")
MODES: dict[str, tuple[str, ...]] = {
    "no_tier": ("--no-prefix-fetch",),
    "host_tier": (*HOST_TIER, "--no-prefix-fetch"),
    "host_tier_fetch": HOST_TIER,
    "round_robin": ("--routing", "round-robin"),
}


@dataclass(frozen=True)
class Workload:
    conversations: int = 16
    turns: int = 4
    system_len: int = 256
    user_len: int = 48
    output_len: int = 8
    max_concurrency: int = 4
    seed: int = 0
    vocab: int = 30000

    def check(self) -> None:
        for name, value in asdict(self).items():
            if name != "seed" and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    def max_prompt_tokens(self) -> int:
        return self.system_len + self.turns * (self.user_len + self.output_len)


@dataclass
class TurnResult:
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


def user_turns(workload: Workload) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt, and each conversation's user tokens per turn (seeded: the same for every mode)."""
    rng = random.Random(workload.seed)
    draw = lambda n: [rng.randrange(100, workload.vocab) for _ in range(n)]  # noqa: E731
    system = draw(workload.system_len)
    return system, [[draw(workload.user_len) for _ in range(workload.turns)] for _ in range(workload.conversations)]


async def _one_turn(client: Any, prompt: list[int], output_len: int) -> TurnResult:
    from kvflow.client import KvflowError

    result = TurnResult(ok=False, prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async for item in client.generate_stream(prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True):
            now = time.perf_counter()
            if item.final:
                result.cached_tokens = item.cached_tokens
                result.output_ids = list(item.choices[0].token_ids)
                result.ok = len(result.output_ids) == output_len
                break
            if item.token_ids:
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except KvflowError as exc:
        result.error = str(exc)
    return result


async def run_conversations(grpc_target: str, workload: Workload) -> tuple[list[list[TurnResult]], float]:
    """Every conversation's turns, turn-major; returns the results [conversation][turn] and the wall time."""
    from kvflow.client import AsyncClient

    system, turns = user_turns(workload)
    history = [list(system) for _ in range(workload.conversations)]
    results: list[list[TurnResult]] = [[] for _ in range(workload.conversations)]
    limit = asyncio.Semaphore(workload.max_concurrency)
    client = AsyncClient(grpc_target, timeout=600.0)

    async def turn(conversation: int, index: int) -> None:
        prompt = history[conversation] + turns[conversation][index]
        async with limit:
            result = await _one_turn(client, prompt, workload.output_len)
        results[conversation].append(result)
        history[conversation] = prompt + result.output_ids

    start = time.perf_counter()
    try:
        for index in range(workload.turns):
            await asyncio.gather(*(turn(c, index) for c in range(workload.conversations)))
    finally:
        await client.close()
    return results, time.perf_counter() - start


def summarize(mode: str, device: str, workload: Workload, results: list[list[TurnResult]], duration_s: float,
              metrics: str) -> dict[str, Any]:
    flat = [r for conversation in results for r in conversation]
    ok = [r for r in flat if r.ok]
    ttft = np.asarray([r.ttft_s for r in ok] or [0.0])
    itl = np.asarray([x for r in ok for x in r.itl_s] or [0.0])
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    digest = hashlib.sha256(repr([[r.output_ids for r in c] for c in results]).encode()).hexdigest()[:16]
    # The router's sums of its workers' counters: vllm:external_prefix_cache_hits_total{role} (tokens loaded back from
    # host tiers) and kvflow:route_false_hits_total.
    host_hits = metric_sum(metrics, "vllm:external_prefix_cache_hits_total")
    return {
        "workload": {**asdict(workload), "working_set_tokens": workload.conversations * workload.max_prompt_tokens()},
        "device": device, "mode": mode,
        "ttft_p50_s": float(np.median(ttft)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        # per turn: turn 0 misses everywhere but the system prompt; later turns are where the history's KV counts
        "ttft_p50_s_by_turn": [float(np.median([r.ttft_s for r in turn if r.ok] or [0.0]))
                               for turn in zip(*results, strict=False)],
        "prefix_hit_rate": {"total": sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
                            "host": host_hits / prompt_tokens if host_hits is not None and prompt_tokens else None},
        "false_hits": metric_sum(metrics, "kvflow:route_false_hits_total"),
        "fetches": metric_sum(metrics, "kvflow:prefix_fetch_decisions_total", path="fetch"),  # turns pulled from a holder
        "host_dropped_blocks": metric_sum(metrics, "kvflow:kv_host_dropped_blocks_total"),  # full tiers' LRU drops
        "itl_p99_s": float(np.percentile(itl, 99)),
        "out_tok_s": sum(len(r.output_ids) for r in ok) / duration_s,
        "completed": len(ok), "failed": len(flat) - len(ok),
        "errors": sorted({r.error for r in flat if r.error})[:3],
        "outputs_sha256": digest,
    }


def _serve(serve_flags: list[str], mode: str, host_gib: float, log_path: Path) -> tuple[ServerProcess, str]:
    port, grpc_port = free_port(), free_port()
    extra = [flag.format(host_gib=host_gib) for flag in MODES[mode]]
    argv = [sys.executable, "-m", "kvflow.cli", "serve", *serve_flags, *extra, "--port", str(port),
            "--grpc-port", str(grpc_port)]
    return ServerProcess(argv, port, log_path=log_path), f"127.0.0.1:{grpc_port}"


def _device(base_url: str) -> str:
    """The workers' devices, as the router's /v1/models lists them ("cpu" is named by the host's CPU model)."""
    from kvflow.benchmarks.throughput import host_context

    data = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]
    devices = sorted({d for worker in data["parallel"]["workers"] for d in worker["devices"]})
    cpu = host_context()["cpu_model"]
    return ", ".join(f"cpu ({cpu})" if d == "cpu" else d for d in devices) or "unknown"


def run_multiturn(serve_flags: list[str], modes: list[str], workload: Workload, host_gib: float,
                  timeout_s: float, log_dir: Path) -> list[dict[str, Any]]:
    """One record per mode, in the order given."""
    workload.check()
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    log_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for mode in modes:
        server, target = _serve(serve_flags, mode, host_gib, log_dir / f"multiturn-{mode}.log")
        with server:
            server.wait_ready(timeout_s)
            results, duration = asyncio.run(run_conversations(target, workload))
            metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
            records.append(summarize(mode, _device(server.url), workload, results, duration, metrics))
    return records


def format_line(record: dict[str, Any]) -> str:
    hit = record["prefix_hit_rate"]
    return (f"{record['mode']:>15}: TTFT p50 {record['ttft_p50_s'] * 1e3:8.1f} ms  p99 {record['ttft_p99_s'] * 1e3:8.1f}"
            f" ms  hit rate {hit['total']:.2f}  ITL p99 {record['itl_p99_s'] * 1e3:7.1f} ms  "
            f"{record['out_tok_s']:7.1f} tok/s  failed {record['failed']}  outputs {record['outputs_sha256']}")
