"""OpenAI request parsing and response shaping for /v1/completions and /v1/chat/completions.

Parsing checks types field by field (so `"temperature": "hot"` is a 400 naming the field, not a crash), then
lets the engine's `SamplingParams` check ranges with vLLM's rules. Unknown fields are accepted and ignored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from protos.kvflow.v1 import kvflow_pb2 as pb
from router.errors import BadRequest

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
_NUMBER = (int, float)


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    prompts: list[str | list[int]]  # completions; empty for chat
    messages: list[dict[str, Any]] | None  # chat
    params: pb.SamplingParams  # max_tokens not filled yet (it depends on the prompt length)
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token; None: no logprobs
    echo: bool
    add_generation_prompt: bool
    chat_template: str | None
    cache_salt: tuple[str, ...]


def _field(body: dict[str, Any], name: str, types: tuple[type, ...] | type, default: Any = None,
           what: str = "") -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:  # bool is an int subclass: refuse true for a number
        raise BadRequest(f"'{name}' must be {what or _type_names(types)}, got a boolean", name)
    if not isinstance(value, types):
        raise BadRequest(f"'{name}' must be {what or _type_names(types)}, got {type(value).__name__}", name)
    return value


def _type_names(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
             dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if _token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_list(p) for p in prompt):
        return list(prompt)
    raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id "
                     "lists", "prompt")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({**message, "content": content})
    return out


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = _field(body, "model", str, "")
    prompts: list[str | list[int]] = [] if chat else _prompts(body)
    messages = _messages(body) if chat else None
    n = _field(body, "n", int, 1)
    stream = _field(body, "stream", bool, False)
    stream_options = _field(body, "stream_options", dict, {})
    include_usage = bool(stream_options.get("include_usage", False))
    if chat:
        max_tokens = _field(body, "max_completion_tokens", int, None)
        max_tokens = _field(body, "max_tokens", int, None) if max_tokens is None else max_tokens
        want_logprobs = _field(body, "logprobs", bool, False)
        top = _field(body, "top_logprobs", int, 0)
        if top and not want_logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = top if want_logprobs else None
    else:
        max_tokens = _field(body, "max_tokens", int, 16)
        logprobs = _field(body, "logprobs", int, None)
    kwargs: dict[str, Any] = {"n": n, "max_tokens": max_tokens if max_tokens is not None else None}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _field(body, name, _NUMBER)
        if value is not None:
            kwargs[name] = float(value)
    for name in ("top_k", "seed", "min_tokens"):
        value = _field(body, name, int)
        if value is not None:
            kwargs[name] = value
    if kwargs.get("top_k") == 0:
        kwargs["top_k"] = -1  # vLLM: 0 disables top-k too
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("'stop' must be a string or a list of strings", "stop")
        kwargs["stop"] = [s for s in stop if s]
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in stop_ids):
            raise BadRequest("'stop_token_ids' must be a list of integers", "stop_token_ids")
        kwargs["stop_token_ids"] = stop_ids
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        value = _field(body, name, bool)
        if value is not None:
            kwargs[name] = value
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    try:
        checked = SamplingParams(**kwargs)  # vLLM's range rules and messages
    except InvalidRequest as exc:
        raise BadRequest(str(exc)) from exc
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string", "cache_salt")
    return ParsedRequest(
        model=model, prompts=prompts, messages=messages, params=to_proto(checked, set(kwargs)),
        max_tokens=max_tokens, n=n, stream=stream, include_usage=include_usage, logprobs=logprobs,
        echo=_field(body, "echo", bool, False) if not chat else False,
        add_generation_prompt=_field(body, "add_generation_prompt", bool, True),
        chat_template=_field(body, "chat_template", str, None), cache_salt=(salt,) if salt else ())


def to_proto(params: SamplingParams, explicit: set[str]) -> pb.SamplingParams:
    """Only explicitly set fields are sent, so the worker's generation-config defaults fill the rest."""
    out = pb.SamplingParams(n=params.n)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "logprobs"):
        if name in explicit and getattr(params, name) is not None:
            setattr(out, name, getattr(params, name))
    if params.max_tokens is not None:
        out.max_tokens = params.max_tokens
    out.stop.extend(params.stop or [])
    out.stop_token_ids.extend(params.stop_token_ids or [])
    out.include_stop_str_in_output = params.include_stop_str_in_output
    out.ignore_eos = params.ignore_eos
    out.min_tokens = params.min_tokens
    out.skip_special_tokens_false = not params.skip_special_tokens
    return out


# ---- responses -------------------------------------------------------------------------------------------
Decode = Callable[[int], str]


def usage_json(usage: pb.Usage) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                           "total_tokens": usage.prompt_tokens + usage.completion_tokens}
    if usage.cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return out


def completion_logprobs(entries: list[pb.TokenLogprob], decode: Decode, offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        token = decode(entry.token_id)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        token_logprobs.append(entry.logprob)
        tops.append({(t.token or decode(t.token_id)): t.logprob for t in entry.top} or None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[pb.TokenLogprob], decode: Decode, top_n: int) -> dict[str, Any]:
    content = []
    for entry in entries:
        token = decode(entry.token_id)
        top = [{"token": (t.token or decode(t.token_id)), "logprob": t.logprob,
                "bytes": list((t.token or decode(t.token_id)).encode())} for t in entry.top][:top_n]
        content.append({"token": token, "logprob": entry.logprob, "bytes": list(token.encode()),
                        "top_logprobs": top})
    return {"content": content}


def stop_reason(choice: pb.CompletionChoice) -> str | int | None:
    kind = choice.WhichOneof("stop_reason")
    return getattr(choice, kind) if kind else None


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}
