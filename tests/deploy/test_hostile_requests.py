"""Issue 27's hostile requests against the session's live `kvflow serve` (SmolLM2, P/D, API key): each is refused
with a 4xx, never a 5xx, while another client's 1-token request completes within 2 s (the issue's measure of "no
stall"), and the serve process (launcher and router) ends the set within 1.1x its resident memory before it."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.hostile import nested_any_of
from tests.helpers.serve import API_KEY, Server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
JSON_HEADERS = {**HEADERS, "Content-Type": "application/json"}
STALL_S = 2.0


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


HOSTILE: dict[str, tuple[str, dict[str, Any]]] = {
    "1 MiB tool name": ("/v1/chat/completions", _chat(
        tools=[{"type": "function", "function": {"name": "f" * (1 << 20)}}], tool_choice="required")),
    "nested anyOf schema": ("/v1/chat/completions", _chat(guided_json=nested_any_of(7))),  # the 0.9 MB
    "unbounded regex": ("/v1/chat/completions", _chat(guided_regex=".{0,1000000}")),
    "21 MB tokenize": ("/tokenize", {"model": "smollm2", "prompt": "ab " * 7_000_000}),
    "21 MB completion": ("/v1/completions", {"model": "smollm2", "prompt": "ab " * 7_000_000, "max_tokens": 1}),
}


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _one_token(server: Server) -> float:
    started = time.monotonic()
    reply = httpx.post(f"{server.url}/v1/completions", headers=HEADERS, timeout=60,
                       json={"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    return time.monotonic() - started


def _beside(server: Server, hostile: Callable[[], Any]) -> tuple[Any, float]:
    """The hostile call's outcome, and the slowest of the 1-token requests sent while it ran."""
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(hostile()))
    thread.start()
    slowest = 0.0
    while thread.is_alive() or slowest == 0.0:
        slowest = max(slowest, _one_token(server))
    thread.join()
    return outcome[0], slowest


def test_hostile_requests_are_refused_without_stalling_others(server: Server) -> None:
    for _ in range(3):
        _one_token(server)  # warm: the first requests compile and cache
    idle_rss = _rss(server.process.pid)
    for name, (path, body) in HOSTILE.items():
        raw = json.dumps(body).encode()  # here, not in the sending thread: this process's GIL would stall the probe
        reply, slowest = _beside(server, lambda p=path, r=raw: httpx.post(f"{server.url}{p}", headers=JSON_HEADERS,
                                                                           content=r, timeout=120))
        assert 400 <= reply.status_code < 500, (name, reply.status_code, reply.text[:300])
        assert reply.json()["error"]["message"], name
        assert slowest <= STALL_S, f"{name}: another client's 1-token request took {slowest:.2f} s"
        print(f"{name}: {reply.status_code}; slowest 1-token request beside it {slowest:.2f} s")
    after = _rss(server.process.pid)
    print(f"serve process RSS: idle {idle_rss / 2**20:.0f} MiB, after the set {after / 2**20:.0f} MiB")
    assert after <= 1.1 * idle_rss, (after, idle_rss)


@pytest.mark.parametrize("length", ["10000000000000000000000000", "-1", "abc"])
def test_a_malformed_content_length_gets_openai_json(server: Server, length: str) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{}}".encode())
        chunks = []
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            chunks.append(chunk)
    answer = b"".join(chunks).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 400"), answer[:200]
    assert '"error"' in answer, answer[-300:]
