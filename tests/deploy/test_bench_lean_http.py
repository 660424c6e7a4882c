"""The benchmark client's transport (kvflow/benchmarks/lean_http.py) and SSE parser: bodies chunked, sized or up to
the close arrive whole however the server splits its writes; `sse_events` yields the same payloads as line-wise
parsing; failures are httpx's exceptions (so `one_request` reports them as before)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest

from kvflow.benchmarks.lean_http import LeanTransport
from kvflow.benchmarks.serve import http_client, one_request, sse_events

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _request_of(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")), 0)
    return head, await reader.readexactly(length)


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


EVENTS = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ["a", " b\n", "caf\u00e9", '"q"']]
SSE = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in EVENTS) + b": keep-alive\n\ndata: [DONE]\n\n"


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
@pytest.mark.parametrize("split", [1, 7, 1000])
def test_bodies_arrive_whole_however_split(framing: str, split: int) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, body = await _request_of(reader)
        assert b"connection: close" in head and json.loads(body) == {"x": 1}
        if framing == "chunked":
            wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked([SSE[:50], SSE[50:]])
        elif framing == "length":
            wire = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(SSE), SSE)
        else:
            wire = b"HTTP/1.1 200 OK\r\n\r\n" + SSE
        for i in range(0, len(wire), split):
            writer.write(wire[i:i + split])
            await writer.drain()
            await asyncio.sleep(0)
        writer.close()

    async def main() -> None:
        server, url = await _serve(handler)
        async with server, httpx.AsyncClient(transport=LeanTransport(), timeout=10) as client:
            async with client.stream("POST", f"{url}/v1/completions", json={"x": 1}) as response:
                assert response.status_code == 200
                assert [e async for e in sse_events(response)] == EVENTS
            async with client.stream("POST", f"{url}/v1/completions", json={"x": 1}) as response:
                assert await response.aread() == SSE

    asyncio.run(main())


def test_one_request_counts_tokens_and_reports_errors_as_before() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    stream = SSE.replace(b"data: [DONE]", b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]")

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await _request_of(reader)
        if b"/bad" in head:
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked([stream]))
        await writer.drain()
        writer.close()

    async def main() -> None:
        server, url = await _serve(handler)
        async with server, http_client() as client:
            ok = await one_request(client, f"{url}/v1/completions", "m", [1, 2, 3], 4, "key")
            assert ok.ok and ok.output_tokens == 4 and ok.ttft_s > 0 and len(ok.itl_s) == 3
            bad = await one_request(client, f"{url}/bad", "m", [1], 4, None)
            assert not bad.ok and bad.error == "HTTP 503: busy"
            server.close()
            await server.wait_closed()
            gone = await one_request(client, f"{url}/v1/completions", "m", [1], 4, None)
            assert not gone.ok and gone.error.startswith("ConnectError")

    asyncio.run(main())


def test_a_silent_server_is_a_read_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_of(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked([b"data: {}\n\n"])[:-5])
        await asyncio.sleep(5)

    async def main() -> None:
        server, url = await _serve(handler)
        async with server, httpx.AsyncClient(transport=LeanTransport(), timeout=httpx.Timeout(10, read=0.3)) as client:
            async with client.stream("POST", url, json={}) as response:
                with pytest.raises(httpx.ReadTimeout):
                    await response.aread()
            server.close()

    asyncio.run(main())
