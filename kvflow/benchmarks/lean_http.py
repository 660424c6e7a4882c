"""A lean HTTP/1.1 transport for the benchmark clients' httpx client: plain `http://` over asyncio streams, one
connection per request (`connection: close`), the response body handed on as it is read (chunked, sized or up to
the close).

Why: httpx's default transport (httpcore over anyio and h11) spends ~100 us of Python per network read, and its
pool scans every open connection for every request that starts or ends (quadratic in the connections open): a
load generator with ~300 streams open parsed at most ~7k SSE events per second on one core, under what the
cluster streams. Here a read costs one `StreamReader.read` and a little chunk framing.

Invariants: the request goes out as httpx built it (its headers, `connection: close` added) and the response is an
`httpx.Response` (httpx decodes any content-encoding); failures are httpx's exceptions (ConnectError, ReadError,
ReadTimeout, RemoteProtocolError, WriteError), so callers catching `httpx.HTTPError` see no difference. A read
timeout is one timer per response, re-armed lazily (not one per read). Other schemes go to httpx's own transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

READ_BYTES = 1 << 16


class LeanTransport(httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self._fallback: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            if self._fallback is None:
                self._fallback = httpx.AsyncHTTPTransport(  # no connection limit, as for http://
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
            return await self._fallback.handle_async_request(request)
        timeouts = request.extensions.get("timeout", {})
        host, port = request.url.host, request.url.port or 80
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=READ_BYTES),
                                                    timeouts.get("connect"))
        except (OSError, asyncio.TimeoutError) as exc:
            kind = httpx.ConnectTimeout if isinstance(exc, asyncio.TimeoutError) else httpx.ConnectError
            raise kind(f"{type(exc).__name__}: {exc}", request=request) from exc
        try:
            body = await request.aread()
            target = request.url.raw_path.decode("ascii")
            head = [f"{request.method} {target} HTTP/1.1"]
            head += [f"{name.decode('latin-1')}: {value.decode('latin-1')}" for name, value in request.headers.raw
                     if name.lower() != b"connection"]
            writer.write(("\r\n".join([*head, "connection: close", "", ""])).encode("latin-1") + body)
            stream = _Body(reader, writer, request, timeouts.get("read"))
            status, headers = await stream.read_head()
            return httpx.Response(status, headers=headers, stream=stream, extensions={"http_version": b"HTTP/1.1"})
        except BaseException:
            writer.close()
            raise

    async def aclose(self) -> None:
        if self._fallback is not None:
            await self._fallback.aclose()


class _Body(httpx.AsyncByteStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: httpx.Request,
                 read_timeout_s: float | None) -> None:
        self._reader, self._writer, self._request = reader, writer, request
        self._timeout_s = read_timeout_s
        self._loop = asyncio.get_running_loop()
        self._last_read = self._loop.time()
        self._timer = None if read_timeout_s is None else self._loop.call_later(read_timeout_s, self._check_idle)
        self._timed_out = False
        self._buffer = b""
        self._chunked = False
        self._length: int | None = None

    def _check_idle(self) -> None:
        """The read timeout: nothing read for `read_timeout_s` closes the connection (the read then fails)."""
        assert self._timeout_s is not None
        idle = self._loop.time() - self._last_read
        if idle >= self._timeout_s:
            self._timed_out = True
            self._writer.transport.abort()
        else:
            self._timer = self._loop.call_later(self._timeout_s - idle, self._check_idle)

    async def _read(self) -> bytes:
        try:
            data = await self._reader.read(READ_BYTES)
        except OSError as exc:
            if self._timed_out:
                raise httpx.ReadTimeout("no data within the read timeout", request=self._request) from exc
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}", request=self._request) from exc
        if self._timed_out:
            raise httpx.ReadTimeout("no data within the read timeout", request=self._request)
        self._last_read = self._loop.time()
        return data

    async def read_head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            data = await self._read()
            if not data:
                raise httpx.RemoteProtocolError("the server closed the connection before its response",
                                                request=self._request)
            self._buffer += data
        head, self._buffer = self._buffer[:end].split(b"\r\n"), self._buffer[end + 4:]
        try:
            status = int(head[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise httpx.RemoteProtocolError(f"bad status line {head[0][:80]!r}", request=self._request) from None
        headers = []
        for line in head[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip(), value.strip()
            headers.append((name, value))
            if name.lower() == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
            elif name.lower() == b"content-length":
                self._length = int(value)
        return status, headers

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._chunked:
            async for part in self._dechunked():
                yield part
            return
        left = self._length
        data, self._buffer = self._buffer, b""
        while True:
            if data:
                if left is not None:
                    data = data[:left]
                    left -= len(data)
                yield data
            if left == 0:
                return
            data = await self._read()
            if not data:
                if left:
                    raise httpx.RemoteProtocolError("the response body ended early", request=self._request)
                return

    async def _dechunked(self) -> AsyncIterator[bytes]:
        buffer = self._buffer
        size = -1  # the current chunk's bytes still to come; -1: its size line is next
        while True:
            out = []
            while True:
                if size < 0:
                    line_end = buffer.find(b"\r\n")
                    if line_end < 0:
                        break
                    try:
                        size = int(buffer[:line_end].split(b";", 1)[0], 16)
                    except ValueError:
                        raise httpx.RemoteProtocolError("bad chunk size line", request=self._request) from None
                    if size == 0:  # the last chunk (trailers are not read)
                        if out:
                            yield b"".join(out)
                        return
                    buffer = buffer[line_end + 2:]
                if len(buffer) < size + 2:
                    if size and buffer:  # hand on what is here, without the framing still to come
                        take = min(size, len(buffer))
                        out.append(buffer[:take])
                        buffer, size = buffer[take:], size - take
                    break
                out.append(buffer[:size])
                buffer, size = buffer[size + 2:], -1
            if out:
                yield b"".join(out)
            data = await self._read()
            if not data:
                raise httpx.RemoteProtocolError("the chunked body ended early", request=self._request)
            buffer += data

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._writer.close()
