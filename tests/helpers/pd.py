"""Worker processes for the P/D tests (SmolLM2 on CPU): start, wait for health, read Info and /metrics, generate.

`running_pair` and `running_worker` hold workers for a `with` block (a module's shared pair, a test's own doomed
worker): started, healthy inside the block, stopped at its end whatever happens in it.

Workers inherit the environment, so with KVFLOW_CLUSTER_TOKEN set they demand it; the helpers' channels present
`ClusterAuth.from_env()` unless given another credential."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.auth import ClusterAuth
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
KV_BYTES = 512 << 20
MAX_MODEL_LEN = 4096
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, float32 on CPU
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES, BLOCK = 30, 3, 64, 4, 16
BLOCK_BYTES = BLOCK * LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # one block's K and V over every layer
MAX_TOKENS = 12


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Worker:
    role: str
    port: int
    metrics_port: int
    process: subprocess.Popen
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def start_worker(role: str, tmp: Path, *extra: str, port: int | None = None, env: dict[str, str] | None = None,
                 model: str = "smollm2") -> Worker:
    """`env` is added to this process's environment (e.g. a KVFLOW_CLUSTER_TOKEN of the test's own); `extra`
    flags come last, so they override the defaults here."""
    port, metrics_port = port or free_port(), free_port()
    log = tmp / f"{role}-{port}.log"
    cmd = [sys.executable, "-m", "kvflow.cli", role, "--model", model, "--port", str(port),
           "--metrics-port", str(metrics_port), "--kv-cache-memory-bytes", str(KV_BYTES),
           "--max-model-len", str(MAX_MODEL_LEN), *extra]
    with log.open("w") as out:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Worker(role, port, metrics_port, process, log)


def wait_healthy(worker: Worker, timeout: float = 180.0, auth: ClusterAuth | None = None) -> None:
    deadline = time.monotonic() + timeout
    with (auth or ClusterAuth.from_env()).channel(worker.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if worker.process.poll() is not None:
                raise RuntimeError(f"{worker.role} exited:\n{worker.log.read_text()[-3000:]}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"{worker.role} not healthy:\n{worker.log.read_text()[-3000:]}")


@contextmanager
def running_worker(role: str, tmp: Path, *extra: str, port: int | None = None) -> Iterator[Worker]:
    """One worker (`start_worker`'s arguments), healthy for the block."""
    worker = start_worker(role, tmp, *extra, port=port)
    try:
        wait_healthy(worker)
        yield worker
    finally:
        worker.stop()


@contextmanager
def running_pair(tmp: Path, prefill_flags: tuple[str, ...] = (), decode_flags: tuple[str, ...] = (),
                 health_timeout: float = 180.0) -> Iterator[tuple[Worker, Worker]]:
    """A prefill and a decode worker, healthy for the block. Both start before either is waited for, so the two
    load the model side by side."""
    prefill = start_worker("prefill", tmp, *prefill_flags)
    decode = start_worker("decode", tmp, *decode_flags)
    try:
        wait_healthy(prefill, timeout=health_timeout)
        wait_healthy(decode, timeout=health_timeout)
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def channel_to(worker: Worker, auth: ClusterAuth | None = None) -> grpc.Channel:
    """A blocking channel to `worker` presenting `auth` (default: KVFLOW_CLUSTER_TOKEN, if set)."""
    return (auth or ClusterAuth.from_env()).channel(worker.address)


def info(worker: Worker, auth: ClusterAuth | None = None) -> pb.InfoResponse:
    with (auth or ClusterAuth.from_env()).channel(worker.address) as channel:
        if worker.role == "prefill":
            return kvflow_pb2_grpc.PrefillStub(channel).Info(pb.InfoRequest(), timeout=10)
        return kvflow_pb2_grpc.GenerationStub(channel).Info(pb.InfoRequest(), timeout=10)


def metric(worker: Worker, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def settled_metric(worker: Worker, name: str, labels: str = "") -> float:
    """Metrics are exported every ~0.5 s: wait for a value that stopped moving."""
    value = metric(worker, name, labels)
    for _ in range(20):
        time.sleep(0.6)
        again = metric(worker, name, labels)
        if again == value:
            return value
        value = again
    return value


def wait_until(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def abort_mid_transfer(decode: Worker, prefill: Worker, prompt_ids: list[int], prefill_baseline: int,
                       start_timeout_s: float) -> int:
    """Send the prompt to `decode`, prefilled by `prefill`, and abort it (request id "abort-me") once the prefill
    worker holds fewer free blocks than `prefill_baseline` (the transfer started); the final answer's finish
    reason."""
    request = pb.GenerateRequest(request_id="abort-me", token_ids=pb.TokenIds(ids=prompt_ids), stream=False,
                                 sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                 disaggregation=pb.DisaggregationParams(prefill_address=prefill.address))
    with channel_to(decode) as channel:
        stub = kvflow_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(request, timeout=120)
        wait_until(lambda: info(prefill).num_free_kv_blocks < prefill_baseline, start_timeout_s,
                   "the transfer to start")
        assert stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=10).found
        return list(call)[-1].complete.choices[0].finish_reason


def generate(decode: Worker, prompt_ids: list[int], prefill: Worker | None = None, max_tokens: int = MAX_TOKENS,
             request_id: str = "", auth: ClusterAuth | None = None, cache_salt: tuple[str, ...] = (),
             **disagg: int) -> pb.GenerateComplete:
    disaggregation = pb.DisaggregationParams(prefill_address=prefill.address if prefill else "", **disagg)
    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt_ids), stream=True,
                                 cache_salt=list(cache_salt),
                                 sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                 disaggregation=disaggregation)
    streamed: list[int] = []
    with (auth or ClusterAuth.from_env()).channel(decode.address) as channel:
        for response in kvflow_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300):
            kind = response.WhichOneof("response")
            if kind == "chunk":
                streamed.extend(response.chunk.token_ids)
            elif kind == "complete":
                assert list(response.complete.choices[0].token_ids) == streamed
                return response.complete
            else:
                raise AssertionError(f"unexpected response {response}")
    raise AssertionError("the stream ended without a complete message")
