"""POST /v1/responses: OpenAI's Responses API for plain-text conversations, non-streaming and streaming.

A request becomes a chat request (instructions -> a system message, `input` -> messages, max_output_tokens ->
max_tokens), so it is validated, routed and generated exactly as /v1/chat/completions; only the response shape
differs. The stream is the Responses event sequence (`event: <type>` + `data: {..., "sequence_number"}`):
response.created, response.in_progress, response.output_item.added, response.content_part.added, one
response.output_text.delta per generated step, response.output_text.done, response.content_part.done,
response.output_item.done, response.completed (its response carries the usage; status "incomplete" with
incomplete_details when max_output_tokens ended it).

Refused with a 400 naming the field, never dropped: tools / non-text input parts / previous_response_id /
non-text `text.format` / reasoning / background / `store: true` / `n` other than 1. Responses are not stored
(`store` has nothing to keep them in), so there is no GET /v1/responses/{id}. vLLM's extras pass to the chat request
as they are (`chat_template`, `chat_template_kwargs`, `truncate_prompt_tokens`, ...), which honours or refuses
each.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from protos.kvflow.v1 import kvflow_pb2 as pb
from router.core import Router, error_from
from router.errors import BadRequest, ShuttingDown
from router.http import SSE_KEEPALIVE
from router.lifecycle import Idle
from router.openai_protocol import FINISH, ParsedRequest, parse_request
from router.prepared import PreparedRequest

# Sampling fields passed through to the chat request as they are (vLLM's ResponsesRequest takes these extras too).
_PASSED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
           "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "cache_salt", "model", "logit_bias",
           "chat_template", "chat_template_kwargs", "truncate_prompt_tokens", "priority", "allowed_token_ids",
           "bad_words", "skip_special_tokens", "include_stop_str_in_output")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _unsupported(body: dict[str, Any]) -> None:
    if body.get("previous_response_id") is not None:
        raise BadRequest("'previous_response_id' is not supported: kvflow does not store responses",
                         "previous_response_id")
    if body.get("tools"):
        raise BadRequest("'tools' is not supported on /v1/responses", "tools")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise BadRequest("'tool_choice' is not supported on /v1/responses", "tool_choice")
    if body.get("reasoning") is not None:
        raise BadRequest("'reasoning' is not supported: this is not a reasoning model", "reasoning")
    if body.get("background"):
        raise BadRequest("'background' is not supported", "background")
    if body.get("store"):  # OpenAI's default is true; kvflow keeps nothing, so a client must not expect it to
        raise BadRequest("'store' must be false: kvflow does not store responses", "store")
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise BadRequest("'n' must be 1 on /v1/responses (one output per response)", "n")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and fmt != {"type": "text"}):
            raise BadRequest("only text output is supported ('text.format' must be {\"type\": \"text\"})",
                             "text.format")


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or \
                    not isinstance(part.get("text"), str):
                raise BadRequest(f"{param}[{j}]: only text parts are supported", f"{param}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{param} must be a string or a list of text parts", param)


def to_chat_body(body: Any) -> dict[str, Any]:
    """The chat request a Responses request means (raises BadRequest naming the field)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _unsupported(body)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
                raise BadRequest(f"input[{i}]: only messages (with a 'role') are supported", f"input[{i}]")
            messages.append({"role": item["role"], "content": _content(item.get("content"), f"input[{i}].content")})
    else:
        raise BadRequest("'input' must be a string or a non-empty list of messages", "input")
    chat: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream", False))}
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in _PASSED:
        if body.get(name) is not None:
            chat[name] = body[name]
    return chat


def parse_responses_request(body: Any, config: Any) -> ParsedRequest:
    chat = to_chat_body(body)
    try:
        return parse_request(chat, True, config)
    except BadRequest as exc:  # name the Responses field, not the chat one it became
        if exc.param in ("max_tokens", "max_completion_tokens"):
            exc.param = "max_output_tokens"
        elif exc.param and exc.param.startswith("messages"):
            exc.param = "input"
        raise exc


# ---- responses ---------------------------------------------------------------------------------------------
def _usage(usage: pb.Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
        else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _response(prepared: PreparedRequest, status: str, output: list[dict[str, Any]], usage: pb.Usage | None,
              finish: str | None = None) -> dict[str, Any]:
    params = prepared.prompts[0].params
    if status == "completed" and finish == "length":
        status = "incomplete"
    return {
        "id": f"resp_{prepared.request_id}", "object": "response", "created_at": prepared.created,
        "status": status, "model": prepared.model, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None, "metadata": {}, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
        "temperature": params.temperature if params.HasField("temperature") else None,
        "top_p": params.top_p if params.HasField("top_p") else None,
        "max_output_tokens": prepared.parsed.max_tokens, "text": {"format": {"type": "text"}},
        "usage": _usage(usage) if usage is not None else None,
    }


async def collect_response(router: Router, prepared: PreparedRequest,
                           responses: AsyncIterator[tuple[int, pb.GenerateResponse]]) -> dict[str, Any]:
    async for _, response in responses:
        if response.WhichOneof("response") == "complete":
            complete = response.complete
            choice = complete.choices[0]
            message = _message(f"msg_{prepared.request_id}", choice.text, "completed")
            return _response(prepared, "completed", [message], complete.usage, FINISH.get(choice.finish_reason))
    raise ShuttingDown("the request ended without a result")


async def stream_response(router: Router, prepared: PreparedRequest,
                          responses: AsyncIterator[tuple[int, pb.GenerateResponse] | Idle]) -> AsyncIterator[str]:
    item_id = f"msg_{prepared.request_id}"
    sequence = 0
    text: list[str] = []
    opened = False

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def place(**fields: Any) -> dict[str, Any]:
        return {"item_id": item_id, "output_index": 0, "content_index": 0, **fields}

    def open_item() -> list[str]:
        return [event("response.output_item.added", output_index=0, item=_message(item_id, "", "in_progress")),
                event("response.content_part.added", **place(part={"type": "output_text", "text": "",
                                                                    "annotations": [], "logprobs": []}))]

    yield event("response.created", response=_response(prepared, "in_progress", [], None))
    yield event("response.in_progress", response=_response(prepared, "in_progress", [], None))
    try:
        async for item in responses:
            if isinstance(item, Idle):
                yield SSE_KEEPALIVE
                continue
            _, response = item
            kind = response.WhichOneof("response")
            if not opened:
                opened = True
                for line in open_item():
                    yield line
            if kind == "chunk" and (response.chunk.text or response.chunk.token_ids):
                text.append(response.chunk.text)
                yield event("response.output_text.delta", **place(delta=response.chunk.text, logprobs=[]))
            elif kind == "complete":
                complete = response.complete
                choice = complete.choices[0]
                full = choice.text
                if full.startswith("".join(text)) and len(full) > len("".join(text)):  # text held back till the end
                    yield event("response.output_text.delta", **place(delta=full[len("".join(text)):], logprobs=[]))
                part = {"type": "output_text", "text": full, "annotations": [], "logprobs": []}
                message = _message(item_id, full, "completed")
                yield event("response.output_text.done", **place(text=full, logprobs=[]))
                yield event("response.content_part.done", **place(part=part))
                yield event("response.output_item.done", output_index=0, item=message)
                yield event("response.completed", response=_response(
                    prepared, "completed", [message], complete.usage, FINISH.get(choice.finish_reason)))
                return
    except Exception as exc:  # the status line is already sent: report in-band
        error = error_from(exc)
        yield event("error", code=error.error_type, message=error.message, param=error.param)
        return
    yield event("error", code="internal_error", message="the request ended without a result", param=None)
