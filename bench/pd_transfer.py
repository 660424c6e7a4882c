"""Benchmark: KV transfer over loopback gRPC, and the time it adds to the first token.

    python bench/pd_transfer.py [--model smollm2] [--prompt-lens 1024 4096] [--reps 3]

Starts one prefill and one decode worker (real processes on 127.0.0.1) and measures:
- transfer throughput (GB/s): pulling an already-cached prompt's KV from the prefill worker (compute is one token,
  so the time is serialization + gRPC + writing into a local cache), end to end on the decode side;
- TTFT through the decode worker, local prefill vs disaggregated (both workers chunk prefill with the same token
  budget), on fresh random prompts; the difference is what the transfer adds on this machine.
Writes bench/results/pd_transfer.json. Reports numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from decode_worker.grpc_transport import GrpcKVTransport  # noqa: E402
from prefill_worker.common import layout_from_proto  # noqa: E402

from engine.kv_transfer import DTYPES, KVSlice, PullJob, write_blocks  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from protos.kvflow.v1 import kvflow_pb2 as pb  # noqa: E402
from protos.kvflow.v1 import kvflow_pb2_grpc  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(role: str, model: str, kv_bytes: int, max_len: int, log_dir: Path, *extra: str
          ) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (log_dir / f"{role}.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli", role, "--model", model, "--port", str(port), "--kv-cache-memory-bytes",
         str(kv_bytes), "--max-model-len", str(max_len), *extra], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return process, f"127.0.0.1:{port}"


def wait_healthy(address: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(address)


def ttft(decode: str, prompt: list[int], prefill: str | None) -> tuple[float, int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), stream=True,
                                 sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=2),
                                 disaggregation=pb.DisaggregationParams(prefill_address=prefill or ""))
    started = time.perf_counter()
    first = None
    path = 0
    with grpc.insecure_channel(decode) as channel:
        for response in kvflow_pb2_grpc.GenerationStub(channel).Generate(request, timeout=600):
            if first is None and response.HasField("chunk"):
                first = time.perf_counter() - started
            if response.HasField("complete"):
                path = response.complete.prefill_path
    assert first is not None
    return first, path


async def pull_throughput(prefill: str, layout_msg: pb.KVLayout, prompt: list[int], reps: int) -> dict:
    layout = layout_from_proto(layout_msg)
    num_blocks = -(-len(prompt) // layout.block_size)
    shape = (num_blocks + 1, layout.block_size, layout.num_kv_heads, layout.head_dim)
    caches = [(torch.zeros(shape, dtype=DTYPES[layout.dtype]), torch.zeros(shape, dtype=DTYPES[layout.dtype]))
              for _ in range(layout.num_layers)]
    transport = GrpcKVTransport(layout, "bench")

    def sink(block_ids: list[int], part: KVSlice, data: bytes) -> None:
        write_blocks(caches, layout, block_ids, part, data)

    job = PullJob("bench", prompt, SamplingParams(temperature=0.0), list(range(1, num_blocks + 1)), 0, (), 10.0)
    await transport.pull(prefill, job, sink)  # warm: the prefill worker now caches the prompt
    runs = []
    for _ in range(reps):
        result = await transport.pull(prefill, job, sink)
        runs.append((result.num_bytes, result.seconds))
    await transport.close()
    best = min(runs, key=lambda r: r[1])
    return {"prompt_tokens": len(prompt), "bytes": best[0], "seconds": best[1], "gb_per_s": best[0] / best[1] / 1e9,
            "median_gb_per_s": statistics.median(b / s / 1e9 for b, s in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="both workers' token budget (prefill chunk): the prefill worker streams each chunk's "
                             "KV while the next computes; the same chunking on the local path keeps the comparison "
                             "about the transfer only")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--out", default=str(REPO / "bench/results/pd_transfer.json"))
    args = parser.parse_args()
    max_len = max(args.prompt_lens) + 16
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "kvflow_pd_bench"
    log_dir.mkdir(exist_ok=True)
    prefill_proc, prefill = start("prefill", args.model, args.kv_cache_memory_bytes, max_len, log_dir,
                                  "--max-num-batched-tokens", str(args.max_num_batched_tokens))
    decode_proc, decode = start("decode", args.model, args.kv_cache_memory_bytes, max_len, log_dir,
                                "--max-num-batched-tokens", str(args.max_num_batched_tokens))
    try:
        wait_healthy(prefill)
        wait_healthy(decode)
        with grpc.insecure_channel(decode) as channel:
            info = kvflow_pb2_grpc.GenerationStub(channel).Info(pb.InfoRequest())
        rng = random.Random(0)
        vocab = info.vocab_size

        def fresh(n: int) -> list[int]:
            return [rng.randrange(100, vocab) for _ in range(n)]

        throughput = [asyncio.run(pull_throughput(prefill, info.kv_layout, fresh(n), args.reps))
                      for n in args.prompt_lens]
        ttft_rows = []
        ttft(decode, fresh(64), None)  # warm both paths
        ttft(decode, fresh(64), prefill)
        for n in args.prompt_lens:
            local, disagg = [], []
            for _ in range(args.reps):
                seconds, path = ttft(decode, fresh(n), None)
                assert path == pb.PREFILL_PATH_LOCAL
                local.append(seconds)
                seconds, path = ttft(decode, fresh(n), prefill)
                assert path == pb.PREFILL_PATH_DISAGGREGATED
                disagg.append(seconds)
            local_s, disagg_s = statistics.median(local), statistics.median(disagg)
            ttft_rows.append({"prompt_tokens": n, "local_ttft_s": local_s, "disagg_ttft_s": disagg_s,
                              "added_s": disagg_s - local_s, "added_pct": 100 * (disagg_s - local_s) / local_s,
                              "local_runs_s": local, "disagg_runs_s": disagg})
        result = {
            "command": "python bench/pd_transfer.py " + " ".join(sys.argv[1:]),
            "model": args.model, "max_num_batched_tokens": args.max_num_batched_tokens, "kv_layout": str(layout_from_proto(info.kv_layout)), "device": info.device,
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "load_avg_1m": os.getloadavg()[0]},
            "transfer": throughput, "ttft": ttft_rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        for process in (prefill_proc, decode_proc):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
