"""Streaming relay cost without a GPU: CPU seconds per streamed token of (a) the router process relaying a fake
worker's gRPC stream to SSE, and (b) the benchmark client (`kvflow.benchmarks.serve.one_request` over httpx, as
bench/pd_adaptive.py drives it) parsing a trivial server's SSE events. Each side runs alone in a process of its own,
so its CPU time over a known number of tokens is its per-token cost; `tokens_per_cpu_s` is what one core relays
(router) or parses (client) at most.

    python -m bench.router_stream [--parts router,client] [--concurrency 256] [--output-len 256] [--requests 1024]
        [--rate 3000] [--label before|after] [--code-root DIR [--commit SHA]] [--router-cpu N]
        [--output-json bench/results/router_stream_cpu.json]

`tokens_per_cpu_s` at the offered rate is a core's capacity when the relay keeps up (one event per write);
`--rate 0 --router-cpu 0` saturates the router pinned to one core (its `tokens_per_s` is then what one core relays,
queued events coalesced into fewer writes).

The fake worker and the trivial SSE server emit tokens in steps, as an engine does: every `concurrency / rate`
seconds each open stream gets its next token (one gRPC message / one SSE event each), so a relay that keeps up sees
one event per stream per read rather than a backlog. `--code-root` runs the router and the client of another
checkout (its commit is recorded), e.g. the base commit for `--label before`; records merge into the JSON file by
(part, label).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results"
MODEL_ID = "fake-model"


# ---- the step clock shared by both fakes -------------------------------------------------------------------------
class Steps:
    """A tick every `interval_s`; `await steps.next()` waits for the next one (0: never waits)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._tick: asyncio.Future[None] | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            self._tick = loop.create_future()
            due += self.interval_s
            await asyncio.sleep(max(due - loop.time(), 0.0))
            tick, self._tick = self._tick, None
            tick.set_result(None)

    async def next(self) -> None:
        if self.interval_s <= 0:
            return
        while self._tick is None:
            await asyncio.sleep(0)
        await asyncio.shield(self._tick)


# ---- (a) a fake decode worker: the worker gRPC service, tokens as fast as the step clock says -------------------
def serve_fake_worker(port: int, interval_s: float) -> None:
    import grpc

    from protos.kvflow.v1 import kvflow_pb2 as pb
    from protos.kvflow.v1 import kvflow_pb2_grpc

    steps = Steps(interval_s)

    class Worker(kvflow_pb2_grpc.GenerationServicer):
        async def Info(self, request, context):  # noqa: N802, ANN001, ANN201
            return pb.InfoResponse(role=pb.WORKER_ROLE_DECODE, model="smollm2", model_id=MODEL_ID, block_size=16,
                                   max_model_len=65536, vocab_size=49152, worker_id="fake-decode")

        async def StreamKVEvents(self, request, context):  # noqa: N802, ANN001, ANN201
            epoch, sequence = int(time.time() * 1000), 0
            yield pb.KVEventBatch(worker_id="fake-decode", epoch=epoch, sequence=0, load=pb.WorkerLoad(),
                                  events=[pb.KVEvent(cleared=pb.AllBlocksClearedEvent())])
            while True:
                await asyncio.sleep(0.5)
                sequence += 1
                yield pb.KVEventBatch(worker_id="fake-decode", epoch=epoch, sequence=sequence, load=pb.WorkerLoad())

        async def Abort(self, request, context):  # noqa: N802, ANN001, ANN201
            return pb.AbortResponse(found=False)

        async def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
            # What a real decode worker sends per step: the new token, its text, usage and timings.
            n = request.sampling_params.max_tokens or 16
            prompt = len(request.token_ids.ids)
            for step in range(n):
                await steps.next()
                chunk = pb.GenerateChunk(index=0, token_ids=[1000 + step % 100], text=" tok",
                                         usage=pb.Usage(prompt_tokens=prompt, completion_tokens=step + 1),
                                         timings=pb.Timings(ttft_s=0.01))
                if step == n - 1:
                    chunk.finish_reason = pb.FINISH_REASON_LENGTH
                yield pb.GenerateResponse(chunk=chunk)
            usage = pb.Usage(prompt_tokens=prompt, completion_tokens=n)
            yield pb.GenerateResponse(complete=pb.GenerateComplete(
                choices=[pb.CompletionChoice(index=0, token_ids=[1000 + s % 100 for s in range(n)], text=" tok" * n,
                                             finish_reason=pb.FINISH_REASON_LENGTH)],
                usage=usage, timings=pb.Timings(ttft_s=0.01), prefill_path=pb.PREFILL_PATH_LOCAL))

    async def main() -> None:
        server = grpc.aio.server()
        kvflow_pb2_grpc.add_GenerationServicer_to_server(Worker(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ticker = asyncio.create_task(steps.run())
        await server.wait_for_termination()
        ticker.cancel()

    asyncio.run(main())


def serve_router_process(decode: str, port: int) -> None:
    from router.config import RouterConfig
    from router.server import serve_router

    config = RouterConfig(decode=(decode,), port=port, grpc_port=0, disable_log_requests=True,
                          disable_log_stats=True)
    _profiled(lambda: asyncio.run(serve_router(config)))


def _profiled(run: Any) -> Any:
    """`run()`, under cProfile when $ROUTER_STREAM_PROFILE names a file for its stats (the main thread only)."""
    path = os.environ.get("ROUTER_STREAM_PROFILE")
    if not path:
        return run()
    import cProfile

    profile = cProfile.Profile()
    try:
        return profile.runcall(run)
    finally:
        profile.dump_stats(path)


# ---- (b) a trivial SSE server: the router's completion chunks, pre-encoded ---------------------------------------
def serve_sse(port: int, interval_s: float) -> None:
    steps = Steps(interval_s)

    def frame(payload: dict[str, Any] | str) -> bytes:
        data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = json.loads(await reader.readexactly(length)) if length else {}
                if not head.startswith(b"POST"):
                    data = json.dumps({"data": [{"id": MODEL_ID}]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(data), data))
                    continue
                n = body.get("max_tokens", 16)
                base = {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion",
                        "created": int(time.time()), "model": body.get("model", MODEL_ID)}
                token = frame({**base, "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                                    "finish_reason": None, "stop_reason": None}]})
                last = frame({**base, "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                                   "finish_reason": "length", "stop_reason": None}]})
                usage = frame({**base, "choices": [], "usage": {"prompt_tokens": len(body.get("prompt", [])),
                                                                "completion_tokens": n,
                                                                "total_tokens": n + len(body.get("prompt", []))}})
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for step in range(n):
                    await steps.next()
                    writer.write(last if step == n - 1 else token)
                    if writer.transport.get_write_buffer_size() > 1 << 16:
                        await writer.drain()
                writer.write(usage + frame("[DONE]") + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
        ticker = asyncio.create_task(steps.run())
        async with server:
            await server.serve_forever()
        ticker.cancel()

    asyncio.run(main())


# ---- load drivers --------------------------------------------------------------------------------------------------
def _prompts(count: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 30000) for _ in range(length)] for _ in range(count)]


async def _closed_loop(concurrency: int, prompts: list[list[int]], one: Any) -> list[int]:
    queue = list(reversed(prompts))
    done: list[int] = []

    async def slot() -> None:
        while queue:
            done.append(await one(queue.pop()))

    await asyncio.gather(*(slot() for _ in range(concurrency)))
    return done


async def raw_client(port: int, concurrency: int, prompts: list[list[int]], output_len: int) -> list[int]:
    """A cheap client (one read per arrival, events counted by their `data: ` prefix), so the router's CPU is what
    is measured: returns the token events of each request."""

    async def one(prompt: list[int]) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        events, tail = 0, b""
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            events += data.count(b"data: ")
            tail = (tail + data)[-64:]
            if b"data: [DONE]" in tail:
                break
        writer.close()
        if b"data: [DONE]" not in tail:
            raise RuntimeError(f"stream ended without [DONE]: {tail!r}")
        return events - 2  # the usage event and [DONE] are not tokens (the last token event ends the choice)

    return await _closed_loop(concurrency, prompts, one)


async def serve_client(port: int, concurrency: int, prompts: list[list[int]], output_len: int) -> list[int]:
    """bench/pd_adaptive.py's client: `one_request` over `http_client()`."""
    from kvflow.benchmarks.serve import http_client, one_request

    async with http_client() as client:
        async def one(prompt: list[int]) -> int:
            result = await one_request(client, f"http://127.0.0.1:{port}/v1/completions", MODEL_ID, prompt,
                                       output_len, None)
            if not result.ok:
                raise RuntimeError(result.error)
            return result.output_tokens

        return await _closed_loop(concurrency, prompts, one)


def client_process(port: int, concurrency: int, requests: int, prompt_len: int, output_len: int) -> None:
    """Runs `serve_client`; prints its own CPU seconds, wall seconds and tokens as JSON."""
    prompts = _prompts(requests, prompt_len)
    cpu, wall = time.process_time(), time.perf_counter()
    tokens = sum(_profiled(lambda: asyncio.run(serve_client(port, concurrency, prompts, output_len))))
    print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall, "tokens": tokens}))


# ---- orchestration -------------------------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(role: str, code_root: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    return subprocess.Popen([sys.executable, str(HERE), role, *args], env=env, cwd=code_root)


def _wait_http(url: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer")


def _cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def measure_router(args: argparse.Namespace) -> dict[str, Any]:
    worker_port, router_port = _free_port(), _free_port()
    interval = args.concurrency / args.rate if args.rate else 0.0
    procs = [_spawn("fake-worker", args.code_root, str(worker_port), str(interval))]
    try:
        procs.append(_spawn("router-proc", args.code_root, f"127.0.0.1:{worker_port}", str(router_port)))
        if args.router_cpu is not None:  # the router alone on one core, the load (worker, client) on the others
            import psutil

            others = sorted(set(range(os.cpu_count() or 1)) - {args.router_cpu})
            psutil.Process(procs[1].pid).cpu_affinity([args.router_cpu])
            for pid in (procs[0].pid, os.getpid()):
                psutil.Process(pid).cpu_affinity(others)
        _wait_http(f"http://127.0.0.1:{router_port}/health")
        warm = _prompts(args.concurrency, args.prompt_len)
        asyncio.run(raw_client(router_port, args.concurrency, warm, 16))  # connections, tokenizer, caches
        prompts = _prompts(args.requests, args.prompt_len)
        cpu0, wall0 = _cpu_s(procs[1].pid), time.perf_counter()
        tokens = sum(asyncio.run(raw_client(router_port, args.concurrency, prompts, args.output_len)))
        cpu, wall = _cpu_s(procs[1].pid) - cpu0, time.perf_counter() - wall0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    return _record("router", args, tokens, cpu, wall)


def measure_client(args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    interval = args.concurrency / args.rate if args.rate else 0.0
    server = _spawn("sse-server", args.code_root, str(port), str(interval))
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models")
        done = subprocess.run([sys.executable, str(HERE), "client-proc", str(port), str(args.concurrency),
                               str(args.requests), str(args.prompt_len), str(args.output_len)],
                              env={**os.environ, "PYTHONPATH": str(args.code_root)}, cwd=args.code_root,
                              capture_output=True, text=True, check=True)
        out = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        server.terminate()
        server.wait(30)
    return _record("client", args, out["tokens"], out["cpu_s"], out["wall_s"])


def _record(part: str, args: argparse.Namespace, tokens: int, cpu_s: float, wall_s: float) -> dict[str, Any]:
    expected = args.requests * args.output_len
    return {
        "part": part, "mode": args.label,
        "workload": f"{part}: {args.concurrency} concurrent streams, {args.prompt_len}-token prompts, "
                    f"{args.output_len} out, {args.requests} requests, offered {args.rate or 'max'} tok/s",
        "device": _cpu_model(), "commit": args.commit or _commit(args.code_root),
        "tokens": tokens, "tokens_expected": expected, "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1), "cpu_s": round(cpu_s, 3),
        "cpu_s_per_1k_tokens": round(1e3 * cpu_s / max(tokens, 1), 4),
        "tokens_per_cpu_s": round(tokens / cpu_s, 1) if cpu_s else None,
        "cores": os.cpu_count(), "router_cpu": args.router_cpu if part == "router" else None,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _commit(root: Path) -> str:
    """The checkout's commit, "-dirty" with changes outside bench/results (where the records go)."""
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", ".", ":!bench/results"],
                             capture_output=True, text=True)
    return (head.stdout.strip() or "unknown") + ("-dirty" if changed.stdout.strip() else "")


def merge(path: Path, records: list[dict[str, Any]]) -> None:
    old = json.loads(path.read_text())["records"] if path.exists() else []
    keys = {(r["part"], r["mode"]) for r in records}
    kept = [r for r in old if (r["part"], r["mode"]) not in keys]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "bench/router_stream.py", "records": kept + records}, indent=2) + "\n")
    print(f"wrote {path}", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ROLES:  # a child process of this benchmark
        role, rest = sys.argv[1], sys.argv[2:]
        ROLES[role](*rest)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="router,client")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rate", type=float, default=3000.0, help="offered tokens/s over all streams (0: max)")
    parser.add_argument("--label", default="after", help="the record's mode (before/after)")
    parser.add_argument("--code-root", type=Path, default=HERE.parents[1],
                        help="checkout whose router and client are measured")
    parser.add_argument("--router-cpu", type=int, default=None,
                        help="pin the router to this core and the fake worker and client to the others (with "
                             "--rate 0: the most one core relays)")
    parser.add_argument("--commit", default=None, help="the measured code's commit, where --code-root is no git "
                                                         "checkout (e.g. a `git archive` of it)")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    args.code_root = args.code_root.resolve()
    records = []
    for part in args.parts.split(","):
        record = (measure_router if part == "router" else measure_client)(args)
        print(json.dumps(record), flush=True)
        records.append(record)
    if args.output_json is not None:
        merge(args.output_json, records)


ROLES = {
    "fake-worker": lambda port, interval: serve_fake_worker(int(port), float(interval)),
    "router-proc": lambda decode, port: serve_router_process(decode, int(port)),
    "sse-server": lambda port, interval: serve_sse(int(port), float(interval)),
    "client-proc": lambda port, c, n, p, o: client_process(int(port), int(c), int(n), int(p), int(o)),
}

if __name__ == "__main__":
    main()
