"""The OpenAI-compatible HTTP front (FastAPI): /v1/completions, /v1/chat/completions, /v1/responses
(`openai_responses`), /v1/models, /health, /metrics, and vLLM's /tokenize, /detokenize, /version
(`openai_extras`). Transport glue only: parsing is in `openai_protocol`, routing and forwarding in `core`.
Streams follow vLLM's chunk sequence (`chunk_stream`).

With --api-key every path needs the key except /health and /version (and /metrics, unless
--metrics-require-api-key): /tokenize and /detokenize cost work too. Worker addresses and ids appear in /v1/models
and /metrics labels only with --expose-worker-addresses (router.metrics.worker_namer). Requests are owned by their caller
(router/ownership.py: the key presented, or the connection) and have no owner token, so the gRPC front's `Abort`
cannot reach them by their `x-request-id`.

Every error response, the framework's own (404, 405) included, is OpenAI error JSON. A request is validated
completely before a worker sees it, and a streaming response starts once the first worker response is in, or after
--sse-keepalive-s without one: a refusal within that time is always a status code, never an error inside a 200
stream (later failures are in-band, then [DONE]). A silent stream gets an SSE comment (": keep-alive") every
--sse-keepalive-s, e.g. while a decode worker prefills again after its prefill worker died.

Requests end with their client: a streaming response is cancelled by the framework when the connection drops; a
non-streaming one is watched for the ASGI disconnect. Either way the request's relay (router.lifecycle) closes,
which cancels the worker call and frees its KV on the decode and prefill workers. While the router drains,
requests are refused with 503 (router.lifecycle); those still running at the drain deadline end with
finish_reason "abort" and [DONE] (streaming) or a 503 error (non-streaming).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.request_ids import request_id_or_new
from protos.kvflow.v1 import kvflow_pb2 as pb
from router import openai_responses
from router.chunk_stream import ChunkStream
from router.config import RouterConfig
from router.core import Router, error_from
from router.errors import BadRequest, HTTPError, RouterError, ShuttingDown, Unauthorized
from router.http import PARSE_INLINE_BYTES, IgnoredFields, error_response, read_body
from router.json_body import load_body
from router.lifecycle import ClientGone, Idle, Relay, Ticket
from router.openai_extras import add_extra_routes
from router.openai_output import (
    chat_logprobs,
    completion_id,
    completion_logprobs,
    envelope,
    prompt_logprobs_json,
    stop_reason,
    usage_json,
)
from router.openai_protocol import (
    FINISH,
    ParsedRequest,
    ReadFields,
    parse_request,
)
from router.ownership import caller_identity, presented_key
from router.prepared import PreparedRequest, Prompt, prepare
from router.tool_calls import chat_message

logger = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health", "/version"})  # probes: answered without the API key (and /metrics by default)


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="kvflow router", docs_url=None, redoc_url=None)
    app.state.ignored_fields = ignored = IgnoredFields()
    keys = router.config.accepted_keys
    metrics_need_key = router.config.metrics_require_api_key

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(HTTPError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return error_response(BadRequest(first.get("msg", "invalid request"), param))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:  # a bug: still OpenAI JSON
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(RouterError(f"internal error: {type(exc).__name__}"))

    open_paths = OPEN_PATHS if metrics_need_key else OPEN_PATHS | {"/metrics"}

    app.add_middleware(_Authenticate, keys=keys, open_paths=open_paths)

    @app.get("/health")
    async def health() -> Response:
        if router.lifecycle.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503, headers={"connection": "close"})
        if not router.is_ready():
            return JSONResponse({"status": "waiting for workers"}, status_code=503)
        if not router.tokenizers_settled:  # the first requests would wait for it, seconds, inside their TTFT
            return JSONResponse({"status": "loading the tokenizer"}, status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        info = router.pool.model_info
        # kvflow's extra field: each worker's parallel layout (addresses only when the operator asks for them)
        layout = router.pool.parallel_layout(None if router.config.expose_worker_addresses else router.worker_name)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvflow", "root": info.model if info
                 else name, "max_model_len": info.max_model_len if info else None, "parallel": layout}
                for name in router.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(router, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(router, request, chat=True)

    responses_api = _Api(openai_responses.parse_responses_request, openai_responses.stream_response,
                         openai_responses.collect_response)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _handle(router, request, chat=True, api=responses_api)

    add_extra_routes(app, router, ignored)  # /tokenize, /detokenize, /version
    return app


class _Authenticate:
    """The API key check, as plain ASGI middleware: it sets `request.state.api_key` (the key presented, or None) and
    answers 401 where a key is needed and none of the configured ones came. Not `@app.middleware("http")`: that
    (Starlette's BaseHTTPMiddleware) relays every body chunk of a response through a memory stream and a task, which
    cost a quarter of the router's CPU per streamed token."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], open_paths: frozenset[str]) -> None:
        self._app, self._keys, self._open_paths = app, keys, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        request = Request(scope, receive)
        request.state.api_key = None
        if self._keys and request.url.path not in self._open_paths:  # every path that costs work (or may exist later)
            request.state.api_key = presented_key(self._keys, request.headers.get("authorization", ""))
            if request.state.api_key is None:
                await error_response(Unauthorized("invalid or missing API key"))(scope, receive, send)
                return
        await self._app(scope, receive, send)


@dataclass(frozen=True)
class _Api:
    """Another request/response shape over the chat path (e.g. /v1/responses): its parser and its shapers."""
    parse: Callable[[Any, RouterConfig], ParsedRequest]
    stream: Callable[[Router, PreparedRequest, AsyncIterator[Any]], AsyncIterator[str]]
    collect: Callable[[Router, PreparedRequest, AsyncIterator[Any]], Awaitable[dict[str, Any]]]


async def _handle(router: Router, request: Request, chat: bool, api: _Api | None = None) -> Response:
    request_id = request_id_or_new(request.headers.get("x-request-id"))
    try:
        with router.lifecycle.admitted() as ticket:
            return await _respond(router, request, chat, request_id, ticket, api)
    except ShuttingDown as exc:  # the client should reconnect elsewhere, not reuse this connection
        response = error_response(exc, request_id)
        response.headers["connection"] = "close"
        return response


async def _respond(router: Router, request: Request, chat: bool, request_id: str, ticket: Ticket,
                   api: _Api | None = None) -> Response:
    try:
        raw = await read_body(request, router.config)

        def parse() -> tuple[Any, ParsedRequest]:
            body = load_body(raw)
            body = ReadFields(body) if isinstance(body, dict) else body
            return body, api.parse(body, router.config) if api else parse_request(body, chat, router.config)

        # A large body is parsed and checked in a thread (a schema's limits walk every node): the loop keeps
        # switching to other requests meanwhile.
        body, parsed = parse() if len(raw) <= PARSE_INLINE_BYTES else await asyncio.to_thread(parse)
        peer = f"http:{request.client.host}:{request.client.port}" if request.client else "http"
        prepared = await prepare(router, parsed, request_id, caller_identity(request.state.api_key, peer))
    except Exception as exc:  # every input problem becomes a 4xx with the reason
        return error_response(error_from(exc), request_id)
    if not router.config.disable_log_requests:
        logger.info("request %s: %s, %d prompt(s), %s tokens, stream=%s", request_id,
                    "chat" if chat else "completion", len(prepared.prompts),
                    [len(p.token_ids) for p in prepared.prompts], parsed.stream)
    headers = {"x-request-id": request_id, **request.app.state.ignored_fields.headers(body.ignored())}
    relay = ticket.relay(_merged(router, prepared))
    watcher = asyncio.create_task(_interrupt_on_disconnect(request, relay))
    try:
        if parsed.stream:
            keepalive_s = router.config.sse_keepalive_s or None
            try:  # the first response decides the status: a refusal before any output is a 4xx/5xx, not a 200
                first = await relay.next(keepalive_s)  # unless none came in time: then keep-alives hold the line
            except StopAsyncIteration:
                first = None
            watcher.cancel()  # the streaming response watches the connection itself from here on
            paced = _paced(relay, first, keepalive_s)
            body_stream = api.stream(router, prepared, paced) if api else \
                ChunkStream(router, prepared, chat).events(paced, relay.ready)
            response = _RelayedStream(body_stream, relay, media_type="text/event-stream", headers=headers)
            relay = None  # the response closes it
            return response
        payload = await (api.collect(router, prepared, relay) if api else _collect(router, prepared, chat, relay))
    except ClientGone:
        logger.info("request %s: the client disconnected; generation cancelled", request_id)
        return Response(status_code=499)  # never read: nobody is listening
    except Exception as exc:
        return error_response(error_from(exc), request_id)
    finally:
        watcher.cancel()
        if relay is not None:
            relay.close()
    return JSONResponse(payload, headers=headers)


class _RelayedStream(StreamingResponse):
    """A streaming response that closes its relay however it ends: Starlette cancels it when the client goes, and
    then possibly before its body (which closes the relay too) ever started."""

    def __init__(self, content: AsyncIterator[str], relay: Relay, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._relay.close()


async def _interrupt_on_disconnect(request: Request, relay: Relay) -> None:
    """Cancel the request's generation when its client goes (the body was read: only a disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    relay.interrupt(ClientGone())


def _sub_id(prepared: PreparedRequest, i: int) -> str:
    return prepared.request_id if len(prepared.prompts) == 1 else f"{prepared.request_id}-{i}"


async def _merged(router: Router, prepared: PreparedRequest) -> AsyncGenerator[tuple[int, pb.GenerateResponse], None]:
    """Responses of every prompt of the request, interleaved as they come, tagged with the prompt index."""
    if len(prepared.prompts) == 1:
        prompt = prepared.prompts[0]
        async for response in router.generate(prepared.request_id, prompt.token_ids, prompt.params,
                                              prepared.parsed.cache_salt, prepared.owner):
            yield 0, response
        return
    queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, prompt: Prompt) -> None:
        try:
            async for response in router.generate(_sub_id(prepared, i), prompt.token_ids, prompt.params,
                                                  prepared.parsed.cache_salt, prepared.owner):
                await queue.put((i, response))
            await queue.put((i, None))
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, prompt)) for i, prompt in enumerate(prepared.prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _collect(router: Router, prepared: PreparedRequest, chat: bool,
                   responses: AsyncIterator[tuple[int, pb.GenerateResponse]]) -> dict[str, Any]:
    parsed, n = prepared.parsed, prepared.parsed.n
    tokenizers = router.tokenizers
    decode = tokenizers.decode_token if tokenizers is not None else str
    choices: list[dict[str, Any]] = []
    usage = pb.Usage()
    prompt_tokens = 0
    prompt_lps: dict[int, list[dict[str, Any] | None]] = {}  # per prompt, with prompt_logprobs
    async for i, response in responses:
        if response.WhichOneof("response") != "complete":
            continue
        complete = response.complete
        if parsed.prompt_logprobs is not None:
            prompt_lps[i] = prompt_logprobs_json(list(complete.prompt_logprobs), decode)
        prompt_tokens += complete.usage.prompt_tokens
        usage.completion_tokens += complete.usage.completion_tokens
        usage.cached_tokens += complete.usage.cached_tokens
        for choice in complete.choices:
            index = i * n + choice.index
            finish = FINISH.get(choice.finish_reason)
            if chat:
                message, finish = chat_message(parsed.tools, choice.text, finish)
                item: dict[str, Any] = {"index": index, "message": message,
                                        "logprobs": chat_logprobs(list(choice.logprobs), decode, parsed.logprobs or 0)
                                        if parsed.logprobs is not None else None}
            else:
                prefix = (prepared.prompts[i].text or "") if parsed.echo else ""
                item = {"index": index, "text": prefix + choice.text,
                        "logprobs": completion_logprobs(list(choice.logprobs), decode)
                        if parsed.logprobs is not None else None}
            item["finish_reason"] = finish
            item["stop_reason"] = stop_reason(choice)
            if not chat and parsed.prompt_logprobs is not None:  # vLLM: per choice for completions
                item["prompt_logprobs"] = prompt_lps.get(i)
            choices.append(item)
    usage.prompt_tokens = prompt_tokens
    choices.sort(key=lambda c: c["index"])
    kind = "chat.completion" if chat else "text_completion"
    out = {**envelope(kind, completion_id(prepared.request_id, chat), prepared.model, prepared.created),
           "choices": choices, "usage": usage_json(usage)}
    if chat and parsed.prompt_logprobs is not None:  # vLLM: once, at the top, for chat
        out["prompt_logprobs"] = prompt_lps.get(0)
    return out


async def _paced(relay: Relay[tuple[int, pb.GenerateResponse]], first: tuple[int, pb.GenerateResponse] | Idle | None,
                 keepalive_s: float | None) -> AsyncIterator[tuple[int, pb.GenerateResponse] | Idle]:
    """`first` (None: the responses had ended), then the relay's items, with IDLE after every `keepalive_s` of
    silence; closes the relay however the stream ends."""
    try:
        if first is None:
            return
        yield first
        while True:
            try:
                yield await relay.next(keepalive_s)
            except StopAsyncIteration:
                return
    finally:  # a client that hangs up ends the worker calls now, not when the generator is collected
        relay.close()
