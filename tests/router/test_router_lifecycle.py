"""The router's drain, SSE keep-alives and client-disconnect cancellation (issue #15, sections 2 and 4), against a
real router (`serve_router`: HTTP + gRPC fronts) in front of a fake decode worker that generates at a set pace
and counts the calls cancelled under it (tests/helpers/router_fakes.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import httpx
import openai
import pytest

import router.core
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from router.drain_forecast import GenerationTracker
from router.lifecycle import IDLE, Lifecycle
from tests.helpers.router_fakes import FakeWorkers, PacedDecode, RouterHarness

PROMPT = {"model": "smollm2", "prompt": "hi", "temperature": 0}


@pytest.fixture()
def paced() -> Iterator[tuple[FakeWorkers, PacedDecode]]:
    decode = PacedDecode()
    workers = FakeWorkers(decode)
    yield workers, decode
    workers.close()


def sse_lines(harness: RouterHarness, body: dict[str, Any], timeout: float = 30) -> list[str]:
    lines = []
    with harness.http.stream("POST", "/v1/completions", json={**PROMPT, "stream": True, **body},
                             timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line:
                lines.append(line)
    return lines


def data_events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def until(predicate: Any, timeout: float, what: str) -> float:
    """Seconds it took for `predicate` to hold."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - start


# ---- keep-alives -----------------------------------------------------------------------------------------------
def test_silent_stream_gets_keepalive_comments(paced: tuple[FakeWorkers, PacedDecode]) -> None:
    workers, decode = paced
    harness = RouterHarness(workers, sse_keepalive_s=0.2)
    try:
        decode.first_gap_s = 1.0  # a long prefill: nothing to send for 1 s
        lines = sse_lines(harness, {"max_tokens": 3})
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
        assert lines[:first_data].count(": keep-alive") >= 3, lines
        assert lines[-1] == "data: [DONE]"
        assert [e["choices"][0]["finish_reason"] for e in data_events(lines)][-1] == "length"
        # The OpenAI SDK skips the comments.
        client = openai.OpenAI(base_url=f"{harness.url}/v1", api_key="x", max_retries=0)
        chunks = list(client.completions.create(model="smollm2", prompt="hi", max_tokens=3, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == "okokok"
        decode.first_gap_s = 0.0  # a quick answer: no comment at all, and the refusal rule still holds
        assert ": keep-alive" not in sse_lines(harness, {"max_tokens": 3})
    finally:
        harness.close()


def test_keepalive_zero_disables_them(paced: tuple[FakeWorkers, PacedDecode]) -> None:
    workers, decode = paced
    harness = RouterHarness(workers, sse_keepalive_s=0)
    try:
        decode.first_gap_s = 0.6
        lines = sse_lines(harness, {"max_tokens": 2})
        assert ": keep-alive" not in lines and lines[-1] == "data: [DONE]"
    finally:
        harness.close()


# ---- client disconnect -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_the_worker_call(paced: tuple[FakeWorkers, PacedDecode], stream: bool) -> None:
    workers, decode = paced
    harness = RouterHarness(workers)
    try:
        decode.interval_s = 0.05  # 200 tokens: 10 s of work
        body = {**PROMPT, "max_tokens": 200, "stream": stream}

        clients = [_send(harness, "/v1/completions", body) for _ in range(4)]
        until(lambda: decode.running == 4, 5, "4 calls on the worker")
        if stream:
            assert b"200 OK" in clients[0].recv(4096)
        for sock in clients:  # the clients go (a timeout, a closed tab)
            sock.close()
        gone = time.monotonic()
        until(lambda: decode.running == 0, 3, "the worker calls to be cancelled")
        assert decode.cancelled == 4
        assert time.monotonic() - gone < 1.5
        value = harness.router.metrics.registry.get_sample_value
        until(lambda: value("vllm:num_requests_running") == 0, 2, "the router to count them out")
    finally:
        harness.close()


def _send(harness: RouterHarness, path: str, body: dict[str, Any]) -> socket.socket:
    """A client mid-request: the request sent on a raw socket, the response not read."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", harness.config.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


# ---- drain -----------------------------------------------------------------------------------------------------
def _background(fn: Any, *args: Any) -> futures.Future:
    pool = futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def _post(harness: RouterHarness, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=harness.url, timeout=30) as http:
        return http.post("/v1/completions", json={**PROMPT, **body})


def _grpc_generate(harness: RouterHarness, max_tokens: int) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(harness.grpc_address) as channel:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), stream=True,
                                     sampling_params=pb.SamplingParams(max_tokens=max_tokens))
        return list(kvflow_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))


def test_drain_lets_in_flight_requests_finish_and_refuses_new_ones(paced: tuple[FakeWorkers, PacedDecode]) -> None:
    workers, decode = paced
    harness = RouterHarness(workers, drain_timeout_s=20)
    decode.interval_s = 0.05  # 30 tokens: 1.5 s
    stream = _background(sse_lines, harness, {"max_tokens": 30})
    whole = _background(_post, harness, {"max_tokens": 30})
    rpc = _background(_grpc_generate, harness, 30)
    until(lambda: decode.running == 3, 5, "3 requests in flight")
    stop = time.monotonic()
    harness.request_stop()
    until(lambda: harness.router.lifecycle.draining, 2, "the drain")
    with httpx.Client(base_url=harness.url, timeout=5) as http:
        health = http.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "shutting down"}
        refused = http.post("/v1/completions", json={**PROMPT, "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "ServiceUnavailableError"
    with pytest.raises(grpc.RpcError) as info:
        _grpc_generate(harness, 2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    lines = stream.result(10)
    assert lines[-1] == "data: [DONE]" and data_events(lines)[-1]["choices"][0]["finish_reason"] == "length"
    response = whole.result(10)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    assert rpc.result(10)[-1].complete.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert harness.stopped(10), "the router did not stop once drained"
    assert time.monotonic() - stop < 5  # it did not wait for the 20 s timeout
    assert decode.cancelled == 0
    harness.close()


def test_drain_timeout_ends_requests_properly(paced: tuple[FakeWorkers, PacedDecode]) -> None:
    workers, decode = paced
    harness = RouterHarness(workers, drain_timeout_s=0.5)
    decode.interval_s = 0.05  # 400 tokens: 20 s, far past the drain timeout
    stream = _background(sse_lines, harness, {"max_tokens": 400, "stream_options": {"include_usage": True}})
    chat = _background(lambda: harness.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}).text)
    whole = _background(_post, harness, {"max_tokens": 400})
    rpc = _background(_grpc_generate, harness, 400)
    until(lambda: decode.running == 4, 5, "4 requests in flight")
    stop = time.monotonic()
    harness.request_stop()
    lines = stream.result(10)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = data_events(lines)
    assert events[-2]["choices"][0]["finish_reason"] == "abort" and events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] >= 0
    chat_lines = [line for line in chat.result(10).splitlines() if line]
    assert chat_lines[-1] == "data: [DONE]"
    assert data_events(chat_lines)[-1]["choices"][0]["finish_reason"] == "abort"
    response = whole.result(10)
    assert response.status_code == 503, response.text
    assert "drain-timeout" in response.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as info:
        rpc.result(10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert harness.stopped(10)
    assert time.monotonic() - stop < 4
    until(lambda: decode.running == 0, 3, "the worker calls to be cancelled")
    assert decode.cancelled == 4
    harness.close()


def test_drain_start_says_how_many_generations_it_will_cut(paced: tuple[FakeWorkers, PacedDecode],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """At the drain's start one line counts the requests in flight and, from each one's remaining max_tokens and
    the measured inter-token latency, how many the deadline will cut and what --drain-timeout would fit."""
    workers, decode = paced
    harness = RouterHarness(workers, drain_timeout_s=3)
    decode.interval_s = 0.05
    long = _background(sse_lines, harness, {"max_tokens": 400})  # ~20 s: cut
    short = _background(sse_lines, harness, {"max_tokens": 30})  # ~1.5 s: finishes
    until(lambda: decode.running == 2, 5, "2 requests in flight")
    time.sleep(0.3)  # a few tokens each: the inter-token latency is measured
    caplog.set_level(logging.INFO, logger="router.lifecycle")
    harness.request_stop()
    assert harness.stopped(10)
    line = next(r for r in caplog.records if r.getMessage().startswith("draining:"))
    message = line.getMessage()
    assert line.levelno == logging.WARNING, message
    assert "2 request(s) in flight, waiting up to 3 s" in message and "2 generation(s) in flight" in message
    assert "1 expected to be cut at the 3 s deadline" in message, message
    needed = float(message.split("--drain-timeout ")[-1].split()[0])
    assert 15 < needed < 40, message  # ~390 tokens left at ~50 ms, plus 20 %
    assert data_events(short.result(5))[-1]["choices"][0]["finish_reason"] == "length"
    assert data_events(long.result(5))[-1]["choices"][0]["finish_reason"] == "abort"
    harness.close()


def test_drain_forecast_unit() -> None:
    tracker = GenerationTracker()
    assert tracker.forecast(30).describe(30) == "no generation in flight"
    measured, done = tracker.start(400, 1), tracker.start(5, 1)
    tracker.start(100, 2)  # nothing streamed yet
    for step in range(11):  # 10 gaps of 0.1 s: 0.1 s per token; 389 tokens left
        measured.add(1, step * 0.1)
    tracker.end(done)
    forecast = tracker.forecast(30)
    assert (forecast.generations, forecast.unknown, forecast.cut) == (2, 1, 1)  # no ITL known yet for the 100-token one
    assert abs(forecast.needed_s - 38.9) < 1e-6 and forecast.most_tokens_left == 389
    tracker.observe_itl(0.5)  # the router's recent latency now covers the other: 100 tokens (2 samples) at 0.5 s
    forecast = tracker.forecast(60)
    assert (forecast.unknown, forecast.cut, forecast.needed_s) == (0, 0, 50.0)
    text = tracker.forecast(30).describe(30)
    assert "2 expected to be cut at the 30 s deadline" in text and "--drain-timeout 60 " in text


# ---- units -----------------------------------------------------------------------------------------------------
def test_relay_times_out_without_losing_items_and_interrupts() -> None:
    async def scenario() -> None:
        lifecycle = Lifecycle()
        closed = asyncio.Event()

        async def source() -> Any:
            try:
                await asyncio.sleep(0.2)
                yield 1
                await asyncio.sleep(10)
                yield 2
            finally:
                closed.set()

        with lifecycle.admitted() as ticket:
            relay = ticket.relay(source())
        assert lifecycle.in_flight == 1  # the relay holds the request after its handler returned
        assert await relay.next(0.05) is IDLE
        assert await relay.next(1.0) == 1
        relay.interrupt(RuntimeError("stop"))
        with pytest.raises(RuntimeError, match="stop"):
            await relay.next(1.0)
        await asyncio.wait_for(closed.wait(), 1)  # the source was closed, not left suspended
        relay.close()
        relay.close()
        assert lifecycle.in_flight == 0
        with lifecycle.admitted():
            assert lifecycle.in_flight == 1
        assert lifecycle.in_flight == 0
        await lifecycle.drain(1.0)
        with pytest.raises(Exception, match="shutting down"), lifecycle.admitted():
            pass

    asyncio.run(scenario())


@pytest.mark.parametrize("value", [-1.0, float("nan")])
@pytest.mark.parametrize("field", ["drain_timeout_s", "sse_keepalive_s"])
def test_bad_lifecycle_values_are_refused(field: str, value: float) -> None:
    from router.config import RouterConfig

    with pytest.raises(ValueError, match="drain-timeout|sse-keepalive"):
        RouterConfig(decode=("x:1",), **{field: value}).validate()


@pytest.mark.parametrize("command", ["router", "serve", "decode", "prefill"])
def test_drain_and_keepalive_flags(command: str) -> None:
    from kvflow.commands import router as router_command
    from kvflow.commands import serve as serve_command
    from kvflow.commands import workers as workers_command

    module = {"router": router_command, "serve": serve_command}.get(command, workers_command)
    parser = argparse.ArgumentParser()
    module.register(parser.add_subparsers())
    base = [command, "--decode", "127.0.0.1:1"] if command == "router" else \
        [command, "--port", "1"] if command in ("decode", "prefill") else [command]
    assert parser.parse_args(base).drain_timeout == 30.0
    assert parser.parse_args([*base, "--drain-timeout", "7.5"]).drain_timeout == 7.5
    if command in ("router", "serve"):
        args = parser.parse_args([*base, "--drain-timeout", "7.5", "--sse-keepalive-s", "0"])
        assert router_command.lifecycle_kwargs(args) == {"drain_timeout_s": 7.5, "sse_keepalive_s": 0.0}
        assert router_command.lifecycle_kwargs(parser.parse_args(base))["sse_keepalive_s"] == 5.0


def test_restart_backoff_doubles_to_its_cap_and_resets_after_a_minute_up() -> None:
    from kvflow.launcher import RestartBackoff

    backoff = RestartBackoff()
    delays, previous = [], None
    for _ in range(7):  # a worker that dies right after each start
        previous = backoff.delay(previous, uptime_s=2.0)
        delays.append(previous)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.delay(30.0, uptime_s=61.0) == 1.0  # it had been up a minute: a fresh streak


class _Unwaited(RouterHarness):
    def _wait_ready(self) -> None:  # the test watches /health itself
        pass


def test_health_waits_for_the_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request waits for the router's first tokenizer load (seconds for a large vocabulary, 7 s on a GPU host
    for Llama-3.1-8B's), so /health says ready only once it has finished: it stays out of the first TTFTs."""
    release = threading.Event()
    real_pool = router.core.TokenizerPool

    def held_pool(*args: Any) -> Any:
        release.wait(60)
        return real_pool(*args)

    monkeypatch.setattr(router.core, "TokenizerPool", held_pool)
    workers = FakeWorkers()
    harness = _Unwaited(workers)
    try:
        def health() -> httpx.Response | None:
            try:
                return harness.http.get("/health", timeout=5)
            except httpx.HTTPError:
                return None

        until(lambda: (r := health()) is not None and r.status_code == 503
              and r.json() == {"status": "loading the tokenizer"}, 60, "the workers, then the tokenizer's load")
        time.sleep(0.3)
        assert health().status_code == 503  # type: ignore[union-attr]
        release.set()
        until(lambda: (r := health()) is not None and r.status_code == 200, 60, "ready")
        assert harness.router.tokenizers is not None
    finally:
        release.set()
        harness.close()
        workers.close()
