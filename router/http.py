"""HTTP plumbing shared by the router's endpoints (`openai_api`, `openai_extras`, `openai_responses`, `chunk_stream`):
reading a request body within the router's limits, error responses, and the SSE keep-alive.

Invariants:
- A body is read whole before anything parses it: at most --max-request-body-bytes (413, refused at once when its
  declared length is larger) and within --request-body-timeout (408).
- Every error response is OpenAI error JSON with the error's HTTP status, and carries the request's
  `x-request-id` when the request has one; so is the HTTP server's own 400 for a request it cannot parse (a
  malformed `Content-Length`, say), which never reaches the app (`JsonErrorsH11Protocol`).
- A request's headers arrive within --request-header-timeout of its first byte (or of the connection, for its first
  request): a client that trickles header lines, or connects and sends nothing, is answered 408 (or, having sent
  nothing, closed) instead of holding a connection forever. uvicorn bounds only the idle gap between requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

import h11
from fastapi import Request
from fastapi.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.config import RouterConfig
from router.errors import BadRequest, PayloadTooLarge, RequestTimeout, RouterError

logger = logging.getLogger(__name__)
# An SSE comment: clients skip it, while proxies' idle timeouts see bytes on a silent stream.
SSE_KEEPALIVE = ": keep-alive\n\n"
PARSE_INLINE_BYTES = 1 << 20  # larger bodies are parsed in a thread, so the event loop keeps serving meanwhile
IGNORED_FIELDS_HEADER = "x-kvflow-ignored-fields"
_MAX_LISTED_FIELDS = 32  # a header lists at most this many names, each cut to _MAX_FIELD_CHARS
_MAX_FIELD_CHARS = 64
_MAX_LOGGED_FIELDS = 1024  # names remembered for "log once": clients can invent names without end
# A declared length with more digits than this is larger than any limit a router can be given.
_MAX_LENGTH_DIGITS = 20


def error_response(error: RouterError, request_id: str | None = None) -> Response:
    headers = {"x-request-id": request_id} if request_id else None
    return Response(error.to_json(), status_code=error.http_status, headers=headers, media_type="application/json")


async def read_body(request: Request, config: RouterConfig) -> bytes:
    """The body, at most max_request_body_bytes (413) and received within request_body_timeout_s (408)."""
    limit = config.max_request_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > _MAX_LENGTH_DIGITS or int(declared) > limit):
        raise _too_large(limit)
    try:
        return await asyncio.wait_for(_receive(request, limit), config.request_body_timeout_s)
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        raise RequestTimeout(f"the request body did not arrive within {config.request_body_timeout_s:g} s "
                             "(--request-body-timeout)") from None


async def _receive(request: Request, limit: int) -> bytes:
    """The body's chunks as they come, refused as soon as they pass `limit` (a missing or false content-length
    must not let a client make the router buffer more)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class IgnoredFields:
    """Request fields no parser read: logged once per name (vLLM logs them on every request) and listed in the
    response's `x-kvflow-ignored-fields` header, so a client sees them. One per app: the names seen are its state."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def headers(self, names: Sequence[str]) -> dict[str, str]:
        if not names:
            return {}
        shown = [_header_safe(name) for name in names[:_MAX_LISTED_FIELDS]]
        new = [name for name in shown if name not in self._logged]
        if new and len(self._logged) < _MAX_LOGGED_FIELDS:
            self._logged.update(new)
            logger.warning("The following fields were present in the request but ignored: %s (each name is logged "
                           "once)", ", ".join(new))
        return {IGNORED_FIELDS_HEADER: ", ".join(shown) + (", ..." if len(names) > _MAX_LISTED_FIELDS else "")}


def _header_safe(name: str) -> str:
    """A field name as printable ASCII without commas (it is a header value, in a comma-separated list)."""
    return json.dumps(name, ensure_ascii=True)[1:-1].replace(",", "\\u002c")[:_MAX_FIELD_CHARS]


class JsonErrorsH11Protocol(H11Protocol):
    """uvicorn's h11 server, whose 400 for an unparseable request (bad request line, headers or Content-Length) is
    OpenAI error JSON instead of plain text, and whose request headers must arrive within `header_timeout_s`
    (`with_header_timeout` sets it)."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes = False  # some of the awaited request's head arrived (then the timeout answers 408)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        awaiting_head = self.conn.their_state is h11.IDLE
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still no complete head: the clock runs from its first byte
            self._header_bytes = self._header_bytes or (awaiting_head and bool(data))
            self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._header_bytes = False

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._header_bytes:  # h11 cannot answer a request it has not parsed: the response is written as is
            body = RequestTimeout(f"the request headers did not arrive within {self.header_timeout_s:g} s "
                                  "(--request-header-timeout)").to_json().encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        body = BadRequest(f"malformed HTTP request: {msg}").to_json().encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def with_header_timeout(seconds: float) -> type[JsonErrorsH11Protocol]:
    """The router's h11 protocol class with request headers bounded to `seconds` (uvicorn takes a class)."""
    return type("RouterH11Protocol", (JsonErrorsH11Protocol,), {"header_timeout_s": seconds})


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is larger than {limit} bytes (--max-request-body-bytes)")
