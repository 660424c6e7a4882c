"""The fault suite under load (issue #15): a real `kvflow serve` (SmolLM2 on CPU, 1 prefill + 2 decode workers,
its own Redis index) and streaming clients, one fault at a time:

  decode_kill       kill -9 of the decode worker serving requests mid-stream (the router migrates them)
  prefill_kill      kill -9 of the prefill worker mid-transfer (decode workers recompute)
  transfer_faults   5 % injected KV-transfer faults (a cluster started with --kv-transfer-fault-rate 0.05)
  redis_kill        the Redis index killed, then restarted, under load
  client_disconnect clients that drop their streams mid-way
  sigterm           SIGTERM to `kvflow serve` under load: in-flight requests finish within --drain-timeout

After each case: requests that succeeded, lost and duplicated tokens (every stream is compared with the same
request's greedy text from an undisturbed run), KV blocks stranded on every worker (their Info, 10 s after the
fault), worker restarts, and processes left behind. Writes bench/results/chaos_<model>_cpu.json (--out).

    python -m bench.chaos [--requests 40] [--fault-requests 1000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil

from bench.harness.records import RESULTS, log, write_json
from bench.harness.serving import kvflow_serve, metric_total
from kvflow.benchmarks.serve import sse_events
from kvflow.benchmarks.throughput import host_context
from kvflow.launcher import free_port
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

MODEL = "smollm2"
OUTPUT_TOKENS = 48
STRANDED_WAIT_S = 10.0
CASES = ("decode_kill", "prefill_kill", "redis_kill", "client_disconnect", "sigterm", "transfer_faults_5pct")


# ---- processes ---------------------------------------------------------------------------------------------------
class Redis:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", str(self.workdir)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)


class Cluster:
    """`kvflow serve` (1 prefill + 2 decode workers, pinned, on the Redis index) and what the cases read from it."""

    def __init__(self, workdir: Path, redis: Redis, token: str, *extra: str) -> None:
        self.token = token
        self.server = kvflow_serve(
            workdir, "--model", MODEL, "--prefill-workers", "1", "--decode-workers", "2", "--index", redis.url,
            "--max-model-len", "2048", "--kv-cache-memory-bytes", str(512 << 20), "--drain-timeout", "20",
            "--sse-keepalive-s", "2", "--disagg-policy", "static", *extra, env={**os.environ, "KVFLOW_CLUSTER_TOKEN": token})
        self.url = self.server.url
        self.process = self.server.process

    def workers(self) -> list[tuple[str, str, psutil.Process]]:
        """(role, host:port, process) of the live workers."""
        out = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                argv = child.cmdline()
            except psutil.Error:
                continue
            if "kvflow.cli" in argv and argv[argv.index("kvflow.cli") + 1] in ("prefill", "decode"):
                role = argv[argv.index("kvflow.cli") + 1]
                out.append((role, f"127.0.0.1:{argv[argv.index('--port') + 1]}", child))
        return out

    def free_blocks(self) -> dict[str, int]:
        out = {}
        for role, address, _ in self.workers():
            with grpc.insecure_channel(address) as channel:
                stub = kvflow_pb2_grpc.GenerationStub(channel) if role == "decode" else \
                    kvflow_pb2_grpc.PrefillStub(channel)
                try:
                    out[address] = stub.Info(pb.InfoRequest(), metadata=[("x-kvflow-cluster-token", self.token)],
                                             timeout=5).num_free_kv_blocks
                except grpc.RpcError:
                    out[address] = -1
        return out

    def wait_workers(self, count: int, timeout_s: float = 300) -> None:
        """Until `count` workers answer Info again (after a restart)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            blocks = self.free_blocks()
            if len(blocks) >= count and all(v >= 0 for v in blocks.values()):
                return
            time.sleep(1)
        raise TimeoutError("workers did not come back")


# ---- load --------------------------------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""
    dropped: bool = False  # the client itself went away (client_disconnect)
    first_token_at: float | None = None  # monotonic


@dataclass
class Load:
    prompts: list[str]
    results: list[Result] = field(default_factory=list)
    first_tokens: int = 0  # streams that got at least one token (so a fault lands mid-stream)


async def one(client: httpx.AsyncClient, url: str, prompt: str, load: Load, drop_after: int | None) -> Result:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = Result(ok=False)
    seen = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for data in sse_events(response):
                if "error" in data:
                    result.error = str(data["error"].get("message"))
                    return result
                for choice in data.get("choices", []):
                    result.text += choice.get("text") or ""
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if data.get("usage"):
                    result.completion_tokens = data["usage"]["completion_tokens"]
                seen += 1
                if seen == 1:
                    load.first_tokens += 1
                    result.first_token_at = time.monotonic()
                if drop_after is not None and seen >= drop_after:
                    result.dropped = True
                    return result
        result.ok = result.finish_reason == "length"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def drive(url: str, load: Load, concurrency: int, drop_every: int = 0) -> None:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        async def limited(i: int, prompt: str) -> Result:
            async with limit:
                drop = 3 if drop_every and i % drop_every == 0 else None
                return await one(client, url, prompt, load, drop)
        load.results = list(await asyncio.gather(*(limited(i, p) for i, p in enumerate(load.prompts))))


def prompts_for(count: int, seed: int, long: bool = False) -> list[str]:
    rng = random.Random(seed)
    topics = ["copper mining", "the history of tea", "glaciers", "compilers", "bees", "railways", "volcanoes",
              "the printing press", "chess openings", "tides", "bread", "satellites"]
    return [f"Write a long, careful essay about {rng.choice(topics)}, part {i}."
            + (" Give many details." * 60 if long else "") for i in range(count)]


# ---- one case -----------------------------------------------------------------------------------------------------
def run_load(cluster: Cluster, load: Load, concurrency: int, fault: Callable[[], None] | None,
             fault_after_streams: int, drop_every: int) -> list[float]:
    """The load to its end, `fault` fired once `fault_after_streams` streams have a token; when it fired."""
    fault_at: list[float] = []

    async def with_fault() -> None:
        task = asyncio.create_task(asyncio.to_thread(lambda: asyncio.run(drive(cluster.url, load, concurrency,
                                                                               drop_every))))
        if fault is not None:
            while load.first_tokens < fault_after_streams and not task.done():
                await asyncio.sleep(0.02)
            fault_at.append(time.monotonic())
            await asyncio.to_thread(fault)
        await task

    asyncio.run(with_fault())
    return fault_at


def token_accounting(load: Load, reference: dict[str, str]) -> tuple[int, int, int]:
    """(lost, duplicated, mismatched) over the streams that finished and were not dropped by their client."""
    lost = duplicated = mismatched = 0
    for result, prompt in zip(load.results, load.prompts, strict=True):
        if not result.ok or result.dropped:
            continue
        expected = reference.get(prompt)
        mismatched += expected is not None and result.text != expected
        lost += max(0, OUTPUT_TOKENS - result.completion_tokens)
        duplicated += max(0, result.completion_tokens - OUTPUT_TOKENS)
    return lost, duplicated, mismatched


def stranded_blocks(cluster: Cluster, baseline: dict[str, int], wait_s: float) -> dict[str, int]:
    """Blocks each worker holds beyond its baseline, once that is 0 everywhere or `wait_s` has passed."""
    deadline = time.monotonic() + wait_s
    stranded: dict[str, int] = {}
    while time.monotonic() < deadline:
        now = cluster.free_blocks()
        stranded = {a: baseline[a] - now.get(a, -1) for a in baseline if a in now and now[a] >= 0}
        if not any(stranded.values()):
            break
        time.sleep(0.5)
    return stranded


def run_case(name: str, cluster: Cluster, reference: dict[str, str], prompts: list[str], concurrency: int,
             fault: Callable[[], None] | None = None, fault_after_streams: int = 2, drop_every: int = 0,
             final: bool = False) -> dict[str, Any]:
    """`final`: the fault ends the cluster (SIGTERM): blocks are not read afterwards, and the record counts the
    requests in flight at the fault (a first token before it) apart from those sent after it (refused, 503)."""
    counters = ("kvflow:worker_restarts_total", "kvflow:migrations_total", "kvflow:router_retries_total")
    baseline_blocks = cluster.free_blocks()
    before = [metric_total(cluster.url, c) for c in counters]
    load = Load(prompts)
    started = time.monotonic()
    fault_at = run_load(cluster, load, concurrency, fault, fault_after_streams, drop_every)
    duration = time.monotonic() - started
    lost, duplicated, mismatched = token_accounting(load, reference)
    stranded = stranded_blocks(cluster, baseline_blocks, 0 if final else STRANDED_WAIT_S)
    ok = sum(r.ok for r in load.results)
    dropped = sum(1 for r in load.results if r.dropped)
    # After SIGTERM the router is gone: its counters can no longer be read.
    restarts, migrations, retries = (None if final else metric_total(cluster.url, c) - b for c, b in zip(counters, before,
                                                                                              strict=True))
    record = {
        "case": name, "requests": len(prompts), "succeeded": ok, "dropped_by_client": dropped,
        "failed": len(prompts) - ok - dropped, "success_rate": ok / max(len(prompts) - dropped, 1),
        "text_mismatches": mismatched, "lost_tokens": lost, "duplicated_tokens": duplicated,
        "stranded_blocks": stranded, "stranded_blocks_total": sum(max(v, 0) for v in stranded.values()),
        "worker_restarts": restarts, "migrations": migrations, "router_retries": retries,
        "errors": sorted({r.error for r in load.results if r.error})[:5], "duration_s": round(duration, 2),
    }
    if final and fault_at:
        in_flight = [r for r in load.results if r.first_token_at is not None and r.first_token_at <= fault_at[0]]
        record.update(in_flight_at_fault=len(in_flight), in_flight_finished=sum(r.ok for r in in_flight),
                      in_flight_finish_s=round(time.monotonic() - fault_at[0], 1),
                      refused_after_fault=sum(1 for r in load.results if r.first_token_at is None and not r.ok))
    log(f"{name}: {ok}/{record['requests'] - dropped} ok, mismatched {mismatched}, lost {lost}, "
        f"duplicated {duplicated}, stranded {record['stranded_blocks_total']}, restarts {restarts}, "
        f"migrations {migrations}, retries {retries}, errors {record['errors'][:2]}")
    return record


# ---- the suite ----------------------------------------------------------------------------------------------------
def leftovers(workdir: Path) -> list[int]:
    """Processes still running whose command line names the suite's working directory."""
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and str(workdir) in " ".join(p.info["cmdline"])]


def kill_busiest(cluster: Cluster, role: str) -> Callable[[], None]:
    def act() -> None:
        # The busiest one (fewest free KV blocks): the prefix-aware router may keep one worker idle.
        free = cluster.free_blocks()
        victims = sorted((free.get(a, 0), a, p) for r, a, p in cluster.workers() if r == role)
        victims[0][2].kill()
    return act


def reference_texts(cluster: Cluster, batches: list[list[str]], concurrency: int) -> dict[str, str]:
    """Each prompt's greedy text from an undisturbed run."""
    reference: dict[str, str] = {}
    for batch in batches:
        calm = Load(batch)
        asyncio.run(drive(cluster.url, calm, concurrency))
        reference.update({p: r.text for p, r in zip(batch, calm.results, strict=True) if r.ok})
    return reference


def sigterm_case(cluster: Cluster, workdir: Path, reference: dict[str, str], prompts: list[str],
                 concurrency: int) -> dict[str, Any]:
    started = time.monotonic()
    record = run_case("sigterm", cluster, reference, prompts, concurrency,
                      lambda: cluster.process.send_signal(signal.SIGTERM), fault_after_streams=4, final=True)
    cluster.process.wait(120)
    record.update(serve_exit_code=cluster.process.returncode, shutdown_s=round(time.monotonic() - started, 1),
                  stranded_blocks={}, stranded_blocks_total=0,  # the cluster is gone: nothing to strand
                  leftover_processes=leftovers(workdir))
    return record


def cases_on_one_cluster(cluster: Cluster, redis: Redis, workdir: Path, wanted: set[str],
                         prompt_sets: dict[str, list[str]], concurrency: int) -> list[dict[str, Any]]:
    prompts, long_prompts = prompt_sets["short"], prompt_sets["long"]
    faults_sample = prompt_sets["faults"][:100] if "transfer_faults_5pct" in wanted else []  # a checked sample
    reference = reference_texts(cluster, [prompts, long_prompts, faults_sample], concurrency)
    records = [run_case("baseline", cluster, reference, prompts, concurrency)]
    if "decode_kill" in wanted:
        records.append(run_case("decode_kill", cluster, reference, prompts, concurrency,
                                kill_busiest(cluster, "decode")))
        cluster.wait_workers(3)
    if "prefill_kill" in wanted:
        records.append(run_case("prefill_kill", cluster, reference, long_prompts, concurrency,
                                kill_busiest(cluster, "prefill"), fault_after_streams=0))
        cluster.wait_workers(3)

    def redis_flap() -> None:
        redis.kill()
        time.sleep(3)
        redis.start()

    if "redis_kill" in wanted:
        records.append(run_case("redis_kill", cluster, reference, prompts, concurrency, redis_flap))
    if "client_disconnect" in wanted:
        records.append(run_case("client_disconnect", cluster, reference, prompts, concurrency, drop_every=2))
    if "sigterm" in wanted:
        records.append(sigterm_case(cluster, workdir, reference, prompts, concurrency))
    cluster.server.stop(120)
    if "transfer_faults_5pct" in wanted:
        faulty = Cluster(workdir, redis, cluster.token, "--kv-transfer-fault-rate", "0.05")
        try:
            faulty.server.wait_ready(600)
            records.append(run_case("transfer_faults_5pct", faulty, reference, prompt_sets["faults"], concurrency))
        finally:
            faulty.server.stop(120)
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40, help="requests per case")
    parser.add_argument("--fault-requests", type=int, default=1000, help="requests of the 5 %% fault case")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "chaos_smollm2_cpu.json")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="a subset (default: all)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvflow-chaos-"))
    redis = Redis(workdir)
    redis.start()
    prompt_sets = {"short": prompts_for(args.requests, seed=1), "long": prompts_for(args.requests, seed=2, long=True),
                   "faults": prompts_for(args.fault_requests, seed=3)}
    cluster = Cluster(workdir, redis, secrets.token_urlsafe(24))
    try:
        cluster.server.wait_ready(600)
        log(f"kvflow serve up ({cluster.url}); reference run")
        records = cases_on_one_cluster(cluster, redis, workdir, set(args.cases), prompt_sets, args.concurrency)
    finally:
        cluster.server.stop(120)
        redis.kill()
    write_json(args.out, {
        "workload": f"chaos_{MODEL}_cpu", "device": host_context()["cpu_model"], "model": MODEL,
        "cluster": "1 prefill + 2 decode workers, Redis index, --drain-timeout 20", "output_tokens": OUTPUT_TOKENS,
        "concurrency": args.concurrency, "cases": records, "leftover_processes": leftovers(workdir),
        "command": "python -m bench.chaos " + " ".join(sys.argv[1:]), "context": host_context(),
    }, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
