"""vLLM's utility endpoints beside the OpenAI ones: /tokenize, /detokenize, /version.

Shapes as vLLM's (`vllm bench serve` uses them to align its token counts with the server's):
- POST /tokenize: `{"prompt": str, "add_special_tokens": true}` or `{"messages": [...], "add_generation_prompt":
  true, "continue_final_message": false, "add_special_tokens": false, "chat_template": ...}` (plus an optional
  `model`, `return_token_strs`) -> `{"count", "max_model_len", "tokens", "token_strs"}`.
- POST /detokenize: `{"tokens": [int, ...]}` -> `{"prompt": str}`.
- GET /version: `{"version": "<kvflow version>"}`.
Tokenizing runs in the router's tokenizer pool, with the same chat-template rules (and time limit) as chat requests.
Unlike vLLM's, a prompt whose length bound (router.tokenizer_pool) already passes max_model_len is refused (400)
without tokenizing it: an exact count past max_model_len is still answered, a 20 MB prompt is not.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.errors import InvalidRequest
from router.core import Router, error_from
from router.errors import BadRequest, ModelNotFound
from router.http import PARSE_INLINE_BYTES, IgnoredFields, error_response, read_body
from router.json_body import load_body
from router.openai_protocol import ReadFields, _chat_template_kwargs, _field, _messages


def kvflow_version() -> str:
    try:
        return importlib.metadata.version("kvflow")
    except importlib.metadata.PackageNotFoundError:  # a source checkout without an install
        return "unknown"


def _check_model(router: Router, body: dict[str, Any]) -> None:
    model = _field(body, "model", str)
    if model is not None and model not in router.served_model_names and model != router.model_info.model:
        raise ModelNotFound(f"The model `{model}` does not exist.", "model")


async def _tokenize(router: Router, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_model(router, body)
    tokenizers = await router.ensure_tokenizers()
    if tokenizers.tokenizer is None:
        raise BadRequest("this model has no tokenizer on the router", "prompt")
    limit = router.model_info.max_model_len
    if "messages" in body:
        messages = _messages(body)
        add_generation_prompt = _field(body, "add_generation_prompt", bool, True)
        continue_final = _field(body, "continue_final_message", bool, False)
        if continue_final and add_generation_prompt:
            raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                             "continue_final_message")
        chat_template = _field(body, "chat_template", str)
        if chat_template is not None and not router.config.trust_request_chat_template:
            raise BadRequest("a request's own chat_template is refused: the router does not run --trust-request-"
                             "chat-template", "chat_template")
        add_special = _field(body, "add_special_tokens", bool, False)
        try:
            _, tokens = await tokenizers.chat(messages, add_generation_prompt, chat_template,
                                              router.config.chat_template_timeout_s, None, continue_final,
                                              _chat_template_kwargs(body), limit, add_special)
        except InvalidRequest as exc:
            raise BadRequest(str(exc), exc.param or "messages") from exc
    else:
        prompt = _field(body, "prompt", str)
        if prompt is None:
            raise BadRequest("/tokenize needs 'prompt' (a string) or 'messages'", "prompt")
        tokenizers.check_length(prompt, limit, "prompt")  # O(1), before any work
        tokens = await tokenizers.run(tokenizers.encode, prompt, _field(body, "add_special_tokens", bool, True))
    token_strs = None
    if _field(body, "return_token_strs", bool, False):
        token_strs = await tokenizers.run(tokenizers.tokenizer.convert_ids_to_tokens, tokens)
    return {"count": len(tokens), "max_model_len": router.model_info.max_model_len, "tokens": tokens,
            "token_strs": token_strs}


async def _detokenize(router: Router, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_model(router, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("'tokens' must be a list of token ids", "tokens")
    router.check_token_ids(tokens, "tokens")
    tokenizers = await router.ensure_tokenizers()
    try:
        return {"prompt": await tokenizers.run(tokenizers.decode, tokens)}
    except InvalidRequest as exc:
        raise BadRequest(str(exc), "tokens") from exc


def add_extra_routes(app: FastAPI, router: Router, ignored: IgnoredFields) -> None:
    async def answer(request: Request, handler: Any) -> Response:
        try:
            raw = await read_body(request, router.config)  # the chat endpoints' size and time limits
            body = load_body(raw) if len(raw) <= PARSE_INLINE_BYTES else await asyncio.to_thread(load_body, raw)
            body = ReadFields(body) if isinstance(body, dict) else body
            payload = await handler(router, body)
        except Exception as exc:  # every input problem is a 4xx naming its field
            return error_response(error_from(exc))
        return JSONResponse(payload, headers=ignored.headers(body.ignored()))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await answer(request, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await answer(request, _detokenize)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvflow_version()})
