"""Drain, supervision, keep-alives and client disconnects with real processes on SmolLM2 (CPU), issue #15 sections
2 and 4: a decode worker's own SIGTERM drain; then one `kvflow serve` (1 prefill + 1 decode worker) that keeps a
stream alive through a stalled prefill worker, stops generating for clients that gave up, restarts a SIGKILLed
decode worker, and on SIGTERM lets short requests finish while ending long ones at --drain-timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvflow.launcher import free_port
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from tests.helpers.pd import start_worker, wait_healthy

ENGINE = ["--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "1024"]
DRAIN_S = 6.0
PROMPT = "The capital of France is"
LONG = 900  # tokens: far more than a CPU worker makes within DRAIN_S
RUNNING = "kvflow:worker_num_requests_running"  # per worker, from its heartbeats (every 0.1 s)


def _until(predicate: Any, timeout: float, what: str, every: float = 0.05) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(every)
    return time.monotonic() - start


def _in_background(fn: Any, *args: Any) -> futures.Future:
    pool = futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


# ---- one worker's drain --------------------------------------------------------------------------------------
def _worker_stream(address: str, max_tokens: int, first: threading.Event) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(text=PROMPT, stream=True, sampling_params=pb.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        out = []
        for response in kvflow_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
            out.append(response)
            first.set()
        return out


def test_decode_worker_drains_on_sigterm(tmp_path: Path) -> None:
    """In flight: a short request finishes, a long one ends UNAVAILABLE at the drain timeout (so a router can move
    it elsewhere); meanwhile health is NOT_SERVING and new calls get UNAVAILABLE; the process exits 0."""
    worker = start_worker("decode", tmp_path, "--drain-timeout", str(DRAIN_S))
    try:
        wait_healthy(worker)
        short_started, long_started = threading.Event(), threading.Event()
        short = _in_background(_worker_stream, worker.address, 24, short_started)
        long = _in_background(_worker_stream, worker.address, LONG, long_started)
        assert short_started.wait(60) and long_started.wait(60)
        worker.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        with grpc.insecure_channel(worker.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            _until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status ==
                   health_pb2.HealthCheckResponse.NOT_SERVING, 5, "NOT_SERVING")
            with pytest.raises(grpc.RpcError) as refused:
                list(kvflow_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                    text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=2)), timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finished = short.result(30)[-1].complete
        assert finished.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(finished.choices[0].token_ids) == 24
        # A single-sample stream cut by the drain ends UNAVAILABLE: the router migrates it (tests/router/test_migration.py).
        cut = long.result(30)
        assert cut[-1].WhichOneof("response") == "error" and cut[-1].error.code == "UNAVAILABLE"
        assert 0 < sum(len(r.chunk.token_ids) for r in cut if r.WhichOneof("response") == "chunk") < LONG
        assert worker.process.wait(30) == 0
        took = time.monotonic() - signalled
        assert DRAIN_S - 0.5 <= took <= DRAIN_S + 10, took
        print(f"decode worker: SIGTERM -> exit {took:.1f} s with --drain-timeout {DRAIN_S:g}")
    finally:
        worker.stop()


# ---- kvflow serve ----------------------------------------------------------------------------------------------
class Serve:
    def __init__(self, process: subprocess.Popen, port: int, log: Path) -> None:
        self.process, self.log = process, log
        self.url = f"http://127.0.0.1:{port}"

    def workers(self) -> dict[str, int]:
        """role -> pid of the live worker processes."""
        out = {}
        for task in Path(f"/proc/{self.process.pid}/task").glob("*"):
            for pid in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                out[cmdline[3].decode()] = int(pid)  # python -m kvflow.cli ROLE ...
        return out

    def metric(self, name: str, labels: str = "") -> float | None:
        """The sum of `name`'s samples whose labels contain `labels`; None if it has none."""
        values = [float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines()
                  if line.startswith((name + "{", name + " ")) and labels in line]
        return sum(values) if values else None

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvflow.cli", "serve", "--model", "smollm2", "--port", str(port), "--grpc-port",
             "0", "--drain-timeout", str(DRAIN_S), "--sse-keepalive-s", "0.5", "--disagg-policy", "static", *ENGINE],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Serve(process, port, log)
    try:
        _until(lambda: process.poll() is None and server.healthy() or process.poll() is not None, 300,
               "kvflow serve to be healthy", every=0.5)
        assert process.poll() is None, log.read_text()[-3000:]
        _until(lambda: server.metric(RUNNING, 'role="prefill"') is not None, 30, "the router to follow the prefill worker")
        assert _completion(server, 2, stream=False).status_code == 200  # warm: the router's tokenizer is loaded
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def _completion(serve: Serve, max_tokens: int, stream: bool, timeout: float = 120) -> httpx.Response | list[str]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        return httpx.post(f"{serve.url}/v1/completions", json=body, timeout=timeout)
    with httpx.stream("POST", f"{serve.url}/v1/completions", json=body, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line]


def _events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_keepalives_while_the_prefill_worker_is_stalled(serve: Serve) -> None:
    """A stopped (SIGSTOP) prefill worker holds the request before its first token: the stream gets comments."""
    prefill = serve.workers()["prefill"]
    os.kill(prefill, signal.SIGSTOP)
    try:
        lines: list[tuple[float, str]] = []
        body = {"prompt": PROMPT + " (stalled)", "max_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{serve.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            started = time.monotonic()
            for line in response.iter_lines():
                if line:
                    lines.append((time.monotonic() - started, line))
                if len(lines) == 4:  # ~2 s of keep-alives, then let the prefill worker go on
                    os.kill(prefill, signal.SIGCONT)
        texts = [line for _, line in lines]
        first_data = next(i for i, line in enumerate(texts) if line.startswith("data:"))
        assert first_data >= 4 and set(texts[:first_data]) == {": keep-alive"}
        gaps = [b - a for (a, _), (b, _) in zip(lines[:first_data], lines[1:first_data], strict=False)]
        assert all(0.3 < gap < 1.5 for gap in gaps), gaps
        assert texts[-1] == "data: [DONE]" and _events(texts)[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        os.kill(prefill, signal.SIGCONT)


def test_generation_stops_when_non_streaming_clients_give_up(serve: Serve) -> None:
    """8 clients that time out: the decode worker runs nothing shortly after they left."""
    def client() -> None:
        with pytest.raises(httpx.ReadTimeout):
            _completion(serve, LONG, stream=False, timeout=3.0)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    _until(lambda: serve.metric(RUNNING, 'role="decode"') == 8, 3, "8 requests running")
    for thread in threads:
        thread.join()
    gone = time.monotonic()
    took = _until(lambda: serve.metric(RUNNING, 'role="decode"') == 0, 5, "the decode worker to stop generating",
                  every=0.1)
    print(f"8 clients gone -> decode worker idle in {took:.2f} s")
    assert serve.metric("vllm:num_requests_running") == 0
    assert time.monotonic() - gone < 5


def test_killed_decode_worker_is_restarted(serve: Serve) -> None:
    decode = serve.workers()["decode"]
    os.kill(decode, signal.SIGKILL)
    killed = time.monotonic()
    _until(lambda: not serve.healthy(), 10, "/health to notice")
    back = _until(serve.healthy, 180, "/health back to 200", every=0.2)
    print(f"decode worker SIGKILL -> /health 200 again in {time.monotonic() - killed:.1f} s")
    assert serve.workers()["decode"] != decode
    assert serve.metric("kvflow:worker_restarts_total", 'role="decode"') == 1
    response = _completion(serve, 4, stream=False)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    assert "restarted decode worker" in serve.log.read_text()
    assert back > 0


def test_sigterm_drains_then_stops_everything(serve: Serve) -> None:
    """Short requests finish; long ones end at --drain-timeout (SSE: finish_reason abort + [DONE]; non-streaming:
    503 OpenAI JSON); new requests get 503 JSON meanwhile; nothing outlives kvflow serve."""
    workers = list(serve.workers().values())
    assert len(workers) == 2
    short_stream = _in_background(_completion, serve, 24, True)
    short_whole = _in_background(_completion, serve, 24, False)
    long_stream = _in_background(_completion, serve, LONG, True)
    long_whole = _in_background(_completion, serve, LONG, False)
    _until(lambda: serve.metric(RUNNING, 'role="decode"') == 4, 60, "4 requests running")
    serve.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    _until(lambda: not serve.healthy(), 2, "/health 503")
    refused = httpx.post(f"{serve.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "ServiceUnavailableError"
    lines = short_stream.result(30)
    assert lines[-1] == "data: [DONE]" and _events(lines)[-1]["choices"][0]["finish_reason"] == "length"
    whole = short_whole.result(30)
    assert whole.status_code == 200 and whole.json()["choices"][0]["finish_reason"] == "length"
    lines = long_stream.result(30)
    assert lines[-1] == "data: [DONE]" and _events(lines)[-1]["choices"][0]["finish_reason"] == "abort"
    whole = long_whole.result(30)
    assert whole.status_code == 503 and "drain-timeout" in whole.json()["error"]["message"]
    aborted_at = time.monotonic() - signalled
    assert DRAIN_S - 0.5 <= aborted_at <= DRAIN_S + 3, aborted_at
    assert serve.process.wait(DRAIN_S + 30) == 0
    print(f"kvflow serve: SIGTERM -> long requests ended {aborted_at:.1f} s, exit "
          f"{time.monotonic() - signalled:.1f} s (--drain-timeout {DRAIN_S:g})")
    _until(lambda: not any(_alive(pid) for pid in workers), 15, "the workers to exit")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return False
    return "zombie" not in state.lower()
