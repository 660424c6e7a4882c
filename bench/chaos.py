#!/usr/bin/env python3
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

    python bench/chaos.py [--requests 40] [--fault-requests 1000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import httpx  # noqa: E402
import psutil  # noqa: E402

from kvflow.benchmarks.throughput import host_context  # noqa: E402
from protos.kvflow.v1 import kvflow_pb2 as pb  # noqa: E402
from protos.kvflow.v1 import kvflow_pb2_grpc  # noqa: E402

MODEL = "smollm2"
OUTPUT_TOKENS = 48
STRANDED_WAIT_S = 10.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- processes ---------------------------------------------------------------------------------------------------
class Redis:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

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


class Serve:
    def __init__(self, workdir: Path, redis: Redis, token: str, *extra: str) -> None:
        self.port = free_port()
        self.token = token
        self.log_path = workdir / f"serve-{self.port}.log"
        argv = [sys.executable, "-m", "kvflow.cli", "serve", "--model", MODEL, "--prefill-workers", "1",
                "--decode-workers", "2", "--index", redis.url, "--port", str(self.port), "--grpc-port", "0",
                "--max-model-len", "2048", "--kv-cache-memory-bytes", str(512 << 20), "--drain-timeout", "20",
                "--sse-keepalive-s", "2", "--log-dir", str(workdir / f"workers-{self.port}"), "--disable-log-requests",
                *extra]
        self.process = subprocess.Popen(argv, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1", "KVFLOW_CLUSTER_TOKEN": token})
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvflow serve exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError("kvflow serve not healthy")

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

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()


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
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
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
    out = []
    for i in range(count):
        topic = rng.choice(topics)
        body = f"Write a long, careful essay about {topic}, part {i}." + (" Give many details." * 60 if long else "")
        out.append(body)
    return out


# ---- one case -----------------------------------------------------------------------------------------------------
def run_case(name: str, serve: Serve, reference: dict[str, str], prompts: list[str], concurrency: int,
             fault: Any = None, fault_after_streams: int = 2, drop_every: int = 0,
             final: bool = False) -> dict[str, Any]:
    """`final`: the fault ends the cluster (SIGTERM): blocks are not read afterwards, and the record counts the
    requests in flight at the fault (a first token before it) apart from those sent after it (refused, 503)."""
    baseline_blocks = serve.free_blocks()
    restarts_before = serve.metric("kvflow:worker_restarts_total")
    migrations_before = serve.metric("kvflow:migrations_total")
    retries_before = serve.metric("kvflow:router_retries_total")
    load = Load(prompts)
    started = time.monotonic()
    fault_at: list[float] = []

    async def with_fault() -> None:
        task = asyncio.create_task(asyncio.to_thread(lambda: asyncio.run(drive(serve.url, load, concurrency,
                                                                               drop_every))))
        if fault is not None:
            while load.first_tokens < fault_after_streams and not task.done():
                await asyncio.sleep(0.02)
            fault_at.append(time.monotonic())
            await asyncio.to_thread(fault)
        await task

    asyncio.run(with_fault())
    duration = time.monotonic() - started
    lost = duplicated = mismatched = 0
    ok = [r for r, p in zip(load.results, prompts, strict=True) if r.ok]
    for result, prompt in zip(load.results, prompts, strict=True):
        if not result.ok or result.dropped:
            continue
        expected = reference.get(prompt)
        if expected is not None and result.text != expected:
            mismatched += 1
        lost += max(0, OUTPUT_TOKENS - result.completion_tokens)
        duplicated += max(0, result.completion_tokens - OUTPUT_TOKENS)
    deadline = time.monotonic() + (0 if final else STRANDED_WAIT_S)
    stranded: dict[str, int] = {}
    while time.monotonic() < deadline:
        now = serve.free_blocks()
        stranded = {a: baseline_blocks[a] - now.get(a, -1) for a in baseline_blocks if a in now and now[a] >= 0}
        if not any(stranded.values()):
            break
        time.sleep(0.5)
    dropped = sum(1 for r in load.results if r.dropped)
    record = {
        "case": name, "requests": len(prompts), "succeeded": len(ok), "dropped_by_client": dropped,
        "failed": len(prompts) - len(ok) - dropped, "success_rate": len(ok) / max(len(prompts) - dropped, 1),
        "text_mismatches": mismatched, "lost_tokens": lost, "duplicated_tokens": duplicated,
        "stranded_blocks": stranded, "stranded_blocks_total": sum(max(v, 0) for v in stranded.values()),
        # After SIGTERM the router is gone: its counters can no longer be read.
        "worker_restarts": None if final else serve.metric("kvflow:worker_restarts_total") - restarts_before,
        "migrations": None if final else serve.metric("kvflow:migrations_total") - migrations_before,
        "router_retries": None if final else serve.metric("kvflow:router_retries_total") - retries_before,
        "errors": sorted({r.error for r in load.results if r.error})[:5], "duration_s": round(duration, 2),
    }
    if final and fault_at:
        in_flight = [r for r in load.results if r.first_token_at is not None and r.first_token_at <= fault_at[0]]
        record.update(in_flight_at_fault=len(in_flight), in_flight_finished=sum(r.ok for r in in_flight),
                      in_flight_finish_s=round(time.monotonic() - fault_at[0], 1),
                      refused_after_fault=sum(1 for r in load.results if r.first_token_at is None and not r.ok))
    log(f"{name}: {record['succeeded']}/{record['requests'] - dropped} ok, mismatched {mismatched}, lost {lost}, "
        f"duplicated {duplicated}, stranded {record['stranded_blocks_total']}, restarts {record['worker_restarts']}, "
        f"migrations {record['migrations']}, retries {record['router_retries']}, errors {record['errors'][:2]}")
    return record


def wait_workers(serve: Serve, count: int, timeout_s: float = 300) -> None:
    """Until `count` workers answer Info again (after a restart)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        blocks = serve.free_blocks()
        if len(blocks) >= count and all(v >= 0 for v in blocks.values()):
            return
        time.sleep(1)
    raise TimeoutError("workers did not come back")


CASES = ("decode_kill", "prefill_kill", "redis_kill", "client_disconnect", "sigterm", "transfer_faults_5pct")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40, help="requests per case")
    parser.add_argument("--fault-requests", type=int, default=1000, help="requests of the 5 %% fault case")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chaos_smollm2_cpu.json")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="a subset (default: all)")
    args = parser.parse_args()
    wanted = set(args.cases)
    workdir = Path(tempfile.mkdtemp(prefix="kvflow-chaos-"))
    redis = Redis(workdir)
    redis.start()
    token = secrets.token_urlsafe(24)
    records: list[dict[str, Any]] = []
    prompts = prompts_for(args.requests, seed=1)
    long_prompts = prompts_for(args.requests, seed=2, long=True)
    fault_prompts = prompts_for(args.fault_requests, seed=3)
    serve = Serve(workdir, redis, token)
    try:
        serve.wait()
        log(f"kvflow serve up ({serve.url}); reference run")
        reference: dict[str, str] = {}
        for batch in (prompts, long_prompts, fault_prompts[:100] if "transfer_faults_5pct" in wanted else []):  # faults: a checked sample
            calm = Load(batch)
            asyncio.run(drive(serve.url, calm, args.concurrency))
            reference.update({p: r.text for p, r in zip(batch, calm.results, strict=True) if r.ok})
        records.append(run_case("baseline", serve, reference, prompts, args.concurrency))

        def kill(role: str) -> Any:
            def act() -> None:
                # The busiest one (fewest free KV blocks): the prefix-aware router may keep one worker idle.
                free = serve.free_blocks()
                victims = sorted((free.get(a, 0), a, p) for r, a, p in serve.workers() if r == role)
                victims[0][2].kill()
            return act

        if "decode_kill" in wanted:
            records.append(run_case("decode_kill", serve, reference, prompts, args.concurrency, kill("decode")))
            wait_workers(serve, 3)
        if "prefill_kill" in wanted:
            records.append(run_case("prefill_kill", serve, reference, long_prompts, args.concurrency,
                                    kill("prefill"), fault_after_streams=0))
            wait_workers(serve, 3)

        def redis_flap() -> None:
            redis.kill()
            time.sleep(3)
            redis.start()

        if "redis_kill" in wanted:
            records.append(run_case("redis_kill", serve, reference, prompts, args.concurrency, redis_flap))
        if "client_disconnect" in wanted:
            records.append(run_case("client_disconnect", serve, reference, prompts, args.concurrency,
                                    drop_every=2))
        if "sigterm" in wanted:
            sigterm_start = time.monotonic()
            records.append(run_case("sigterm", serve, reference, prompts, args.concurrency,
                                    lambda: serve.process.send_signal(signal.SIGTERM), fault_after_streams=4,
                                    final=True))
            serve.process.wait(120)
            records[-1]["serve_exit_code"] = serve.process.returncode
            records[-1]["shutdown_s"] = round(time.monotonic() - sigterm_start, 1)
            records[-1]["stranded_blocks"] = {}  # the cluster is gone: nothing to strand
            records[-1]["stranded_blocks_total"] = 0
            leftover = [p.pid for p in psutil.process_iter(["cmdline"])
                        if p.info["cmdline"] and str(workdir) in " ".join(p.info["cmdline"])]
            records[-1]["leftover_processes"] = leftover
        else:
            serve.stop()

        if "transfer_faults_5pct" in wanted:
            faulty = Serve(workdir, redis, token, "--kv-transfer-fault-rate", "0.05")
            try:
                faulty.wait()
                records.append(run_case("transfer_faults_5pct", faulty, reference, fault_prompts,
                                        args.concurrency))
            finally:
                faulty.stop()
    finally:
        serve.stop()
        redis.kill()
    leftover_all = [p.pid for p in psutil.process_iter(["cmdline"])
                    if p.info["cmdline"] and str(workdir) in " ".join(p.info["cmdline"])]
    summary = {
        "workload": f"chaos_{MODEL}_cpu", "device": host_context()["cpu_model"], "model": MODEL,
        "cluster": "1 prefill + 2 decode workers, Redis index, --drain-timeout 20", "output_tokens": OUTPUT_TOKENS,
        "concurrency": args.concurrency, "cases": records, "leftover_processes": leftover_all,
        "command": "python bench/chaos.py " + " ".join(sys.argv[1:]), "context": host_context(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
