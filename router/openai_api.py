"""The OpenAI-compatible HTTP front (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics. Transport glue only: parsing is in `openai_protocol`, routing and forwarding in `core`."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from protos.kvflow.v1 import kvflow_pb2 as pb
from router.core import Router, error_from
from router.errors import BadRequest, ModelNotFound, RouterError, Unauthorized
from router.openai_protocol import (
    FINISH,
    ParsedRequest,
    chat_logprobs,
    completion_logprobs,
    envelope,
    parse_request,
    stop_reason,
    usage_json,
)

logger = logging.getLogger(__name__)


@dataclass
class _Prepared:
    request_id: str
    parsed: ParsedRequest
    model: str
    prompts: list[tuple[str | None, list[int]]]  # (text, token ids) per prompt
    created: int = field(default_factory=lambda: int(time.time()))


def error_response(error: RouterError, request_id: str | None = None) -> JSONResponse:
    headers = {"x-request-id": request_id} if request_id else None
    return JSONResponse(error.to_openai(), status_code=error.http_status, headers=headers)


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="kvflow router", docs_url=None, redoc_url=None)
    api_key = router.config.api_key

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(Unauthorized("invalid or missing API key"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if router.is_ready():
            return Response(status_code=200)
        return JSONResponse({"status": "waiting for workers"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        info = router.pool.model_info
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvflow", "root": info.model if info
                 else name, "max_model_len": info.max_model_len if info else None}
                for name in router.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(router, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(router, request, chat=True)

    return app


async def _handle(router: Router, request: Request, chat: bool) -> Response:
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
        parsed = parse_request(body, chat)
        prepared = await _prepare(router, parsed, request_id)
    except Exception as exc:  # every input problem becomes a 4xx with the reason
        return error_response(error_from(exc), request_id)
    if not router.config.disable_log_requests:
        logger.info("request %s: %s, %d prompt(s), %s tokens, stream=%s", request_id,
                    "chat" if chat else "completion", len(prepared.prompts),
                    [len(ids) for _, ids in prepared.prompts], parsed.stream)
    headers = {"x-request-id": request_id}
    if parsed.stream:
        return StreamingResponse(_stream(router, prepared, chat), media_type="text/event-stream", headers=headers)
    try:
        payload = await _collect(router, prepared, chat)
    except Exception as exc:
        return error_response(error_from(exc), request_id)
    return JSONResponse(payload, headers=headers)


async def _prepare(router: Router, parsed: ParsedRequest, request_id: str) -> _Prepared:
    info = router.model_info  # 503 until a worker answered
    names = router.served_model_names
    model = parsed.model or names[0]
    if model not in names and model != info.model:
        raise ModelNotFound(f"The model `{model}` does not exist. Available: {', '.join(names)}", "model")
    tokenizers = await router.ensure_tokenizers()
    prompts: list[tuple[str | None, list[int]]] = []
    if parsed.messages is not None:
        text, ids = await tokenizers.run(tokenizers.chat_prompt, parsed.messages, parsed.add_generation_prompt,
                                         parsed.chat_template)
        prompts.append((text, ids))
    for prompt in parsed.prompts:
        if isinstance(prompt, str):
            prompts.append((prompt, await tokenizers.run(tokenizers.encode, prompt)))
        else:
            prompts.append((None, list(prompt)))
    for _, ids in prompts:
        max_tokens = router.check_prompt(len(ids), parsed.max_tokens)
        if max_tokens is not None and not parsed.params.HasField("max_tokens"):
            parsed.params.max_tokens = max_tokens
    return _Prepared(request_id, parsed, model, prompts)


def _sub_id(prepared: _Prepared, i: int) -> str:
    return prepared.request_id if len(prepared.prompts) == 1 else f"{prepared.request_id}-{i}"


async def _merged(router: Router, prepared: _Prepared) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """Responses of every prompt of the request, interleaved as they come, tagged with the prompt index."""
    if len(prepared.prompts) == 1:
        async for response in router.generate(prepared.request_id, prepared.prompts[0][1], prepared.parsed.params,
                                              prepared.parsed.cache_salt):
            yield 0, response
        return
    queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, ids: list[int]) -> None:
        try:
            async for response in router.generate(_sub_id(prepared, i), ids, prepared.parsed.params,
                                                  prepared.parsed.cache_salt):
                await queue.put((i, response))
            await queue.put((i, None))
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, ids)) for i, (_, ids) in enumerate(prepared.prompts)]
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


async def _collect(router: Router, prepared: _Prepared, chat: bool) -> dict[str, Any]:
    parsed, n = prepared.parsed, prepared.parsed.n
    tokenizers = router.tokenizers
    decode = tokenizers.decode_token if tokenizers is not None else str
    choices: list[dict[str, Any]] = []
    usage = pb.Usage()
    prompt_tokens = 0
    async for i, response in _merged(router, prepared):
        if response.WhichOneof("response") != "complete":
            continue
        complete = response.complete
        prompt_tokens += complete.usage.prompt_tokens
        usage.completion_tokens += complete.usage.completion_tokens
        usage.cached_tokens += complete.usage.cached_tokens
        for choice in complete.choices:
            index = i * n + choice.index
            if chat:
                item: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": choice.text},
                                        "logprobs": chat_logprobs(list(choice.logprobs), decode, parsed.logprobs or 0)
                                        if parsed.logprobs is not None else None}
            else:
                prefix = (prepared.prompts[i][0] or "") if parsed.echo else ""
                item = {"index": index, "text": prefix + choice.text,
                        "logprobs": completion_logprobs(list(choice.logprobs), decode)
                        if parsed.logprobs is not None else None}
            item["finish_reason"] = FINISH.get(choice.finish_reason)
            item["stop_reason"] = stop_reason(choice)
            choices.append(item)
    usage.prompt_tokens = prompt_tokens
    choices.sort(key=lambda c: c["index"])
    kind, prefix = ("chat.completion", "chatcmpl-") if chat else ("text_completion", "cmpl-")
    return {**envelope(kind, prefix + prepared.request_id, prepared.model, prepared.created), "choices": choices,
            "usage": usage_json(usage)}


async def _stream(router: Router, prepared: _Prepared, chat: bool) -> AsyncIterator[str]:
    parsed, n = prepared.parsed, prepared.parsed.n
    tokenizers = router.tokenizers
    decode = tokenizers.decode_token if tokenizers is not None else str
    kind, prefix = ("chat.completion.chunk", "chatcmpl-") if chat else ("text_completion", "cmpl-")
    base = envelope(kind, prefix + prepared.request_id, prepared.model, prepared.created)
    sent_text: dict[int, str] = {}
    usage = pb.Usage()

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

    def choice(index: int, text: str, logprobs: list[pb.TokenLogprob], finish: str | None = None,
               stop: str | int | None = None, role: bool = False) -> dict[str, Any]:
        lp = None
        if parsed.logprobs is not None and logprobs:
            lp = chat_logprobs(logprobs, decode, parsed.logprobs) if chat else completion_logprobs(logprobs, decode)
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text} \
                if text or not finish else {}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, "stop_reason": stop}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop}

    try:
        if chat:
            for i in range(len(prepared.prompts) * n):
                yield event([choice(i, "", [], role=True)])
        async for i, response in _merged(router, prepared):
            kind_ = response.WhichOneof("response")
            if kind_ == "chunk":
                chunk = response.chunk
                index = i * n + chunk.index
                if chunk.text or chunk.logprobs or chunk.token_ids:  # as vLLM: one event per step with tokens,
                    sent_text[index] = sent_text.get(index, "") + chunk.text  # text may be "" (no tokenizer)
                    yield event([choice(index, chunk.text, list(chunk.logprobs))])
            elif kind_ == "complete":
                complete = response.complete
                usage.prompt_tokens += complete.usage.prompt_tokens
                usage.completion_tokens += complete.usage.completion_tokens
                usage.cached_tokens += complete.usage.cached_tokens
                for c in complete.choices:
                    index = i * n + c.index
                    already = sent_text.get(index, "")
                    rest = c.text[len(already):] if c.text.startswith(already) else ""
                    yield event([choice(index, rest, [], FINISH.get(c.finish_reason), stop_reason(c))])
        if parsed.include_usage:
            yield event([], usage=usage_json(usage))
    except Exception as exc:  # the status line is already sent: report in-band, as vLLM does
        error = error_from(exc)
        yield f"data: {json.dumps(error.to_openai())}\n\n"
    yield "data: [DONE]\n\n"
