"""OpenAI request parsing for /v1/completions and /v1/chat/completions (the response side: router/openai_output.py).

Invariants of a request that parsed:
- The body was strict JSON (no NaN / Infinity literals), nested at most MAX_JSON_DEPTH deep, with no lone UTF-16
  surrogate in any string (router/json_body.py `load_body`).
- Every field has its type, fits its wire type (uint32 / int32 / int64 / float32) and is within the router's
  bounds (`RouterConfig`: n, best_of, logprobs, prompts per request); then the engine's `SamplingParams` checks
  ranges with vLLM's rules. What needs the model (prompt length, token ids against the vocabulary) is checked
  when the request is prepared, before any worker sees it.
- Each refusal is a `BadRequest` naming its field in `param` (`messages[2].role` below the top level).
Unknown fields are accepted (OpenAI clients send extras) but not silently: `ReadFields` records which top-level
fields the parser read, and the rest are logged once per name and listed in the response's
`x-kvflow-ignored-fields` header (router.openai_api). Fields vLLM honours that the router does not implement yet
are refused (`UNSUPPORTED`) rather than dropped.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.wire import FINISH_REASON_FROM_PROTO, sampling_params_to_proto
from engine.errors import InvalidRequest
from engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from protos.kvflow.v1 import kvflow_pb2 as pb
from router.config import RouterConfig
from router.errors import BadRequest
from router.structured_output import check as check_constraint
from router.structured_output import structured_outputs_from_body
from router.tool_calls import ToolRequest, parse_tools

FINISH = FINISH_REASON_FROM_PROTO  # proto enum -> OpenAI's finish_reason
_NUMBER = (int, float)
FLOAT32_MAX = 3.4028234663852886e38  # sampling floats travel as proto float
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGIT_BIAS_ENTRIES = 1024  # each is applied at every sampling step
ROLES = ("system", "user", "assistant", "tool", "developer")


def _accepted(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is type(v) for v in values)


# Fields the router does not implement yet, with the values that mean "not used" (accepted). Anything else is a
# 400 naming the field; the change that implements one removes its entry here.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": _accepted(None, ""),
    "functions": _accepted(None, []),  # the deprecated spelling of tools
    "function_call": _accepted(None, "none"),
    "use_beam_search": _accepted(None, False),
    "guided_decoding_backend": _accepted(None, "auto", "xgrammar"),  # kvflow's one backend is xgrammar
    "guided_whitespace_pattern": _accepted(None),
    "structural_tag": _accepted(None),
    "priority": _accepted(None, 0),
}
# Why, where there is more to say than "not supported yet".
_UNSUPPORTED_WHY = {
    "priority": "requests are scheduled first come, first served (as vLLM without --scheduling-policy priority)",
}
# Keys `chat_template_kwargs` may not set: the arguments of the template call itself, which the request's own fields
# decide (transformers' apply_chat_template would take them as its own).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ReadFields(dict):  # type: ignore[type-arg]
    """A request body that records which of its top-level fields were read (by `get`, `[]` or `in`), so the
    fields no parser looked at can be reported as ignored."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def ignored(self) -> list[str]:
        return sorted(key for key in self if key not in self.read)


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
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage on every chunk (with include_usage)
    logprobs: int | None  # top alternatives per token; None: no logprobs
    echo: bool
    add_generation_prompt: bool
    continue_final_message: bool  # chat: the last (assistant) message is left open, the reply continues it
    chat_template: str | None
    cache_salt: tuple[str, ...]
    max_tokens_param: str  # the field max_tokens came from (chat: max_completion_tokens or max_tokens)
    tools: ToolRequest | None = None  # chat: tools and tool_choice
    prompt_logprobs: int | None = None  # top alternatives per prompt position; None: none (non-streaming only)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len); None: all
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat template variables (vLLM's)


# ---- fields ------------------------------------------------------------------------------------------------
def _field(body: dict[str, Any], name: str, types: tuple[type, ...] | type, default: Any = None,
           what: str = "", param: str | None = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    types = types if isinstance(types, tuple) else (types,)
    param = param or name
    if isinstance(value, bool) and bool not in types:  # bool is an int subclass: refuse true for a number
        raise BadRequest(f"'{param}' must be {what or _type_names(types)}, got a boolean", param)
    if not isinstance(value, types):
        raise BadRequest(f"'{param}' must be {what or _type_names(types)}, got {_json_type(value)}", param)
    return value


def _type_names(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
             dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _int(body: dict[str, Any], name: str, low: int | None = None, high: int | None = None,
         default: int | None = None) -> int | None:
    """An integer within [low, high] (a bound left out: the engine's own range check words the refusal)."""
    value = _field(body, name, int, default)
    if value is not None and ((low is not None and value < low) or (high is not None and value > high)):
        span = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise BadRequest(f"'{name}' must be an integer in {span}, got {value}", name)
    return value


def _float(body: dict[str, Any], name: str) -> float | None:
    """The value as the wire's float32 will carry it, so the range checks judge what a worker will see (1e-308 is
    a valid top_p, its float32 0.0 is not)."""
    value = _field(body, name, _NUMBER)
    if value is None:
        return None
    if not abs(value) <= FLOAT32_MAX:  # also false for inf (JSON's 1e999 parses to it)
        raise BadRequest(f"'{name}' must be a finite number (at most {FLOAT32_MAX:.4g} in magnitude), got {value!r}",
                         name)
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _token_list(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    if {*map(type, value)} == {int}:  # what JSON gives: checked in C (a prompt may hold 100k ids)
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(body: dict[str, Any], max_prompts: int) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_list(p) for p in prompt):
        if len(prompt) > max_prompts:
            raise BadRequest(f"'prompt' may hold at most {max_prompts} prompts, got {len(prompt)}", "prompt")
        return list(prompt)
    raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id "
                     "lists", "prompt")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            shown = json.dumps(role, ensure_ascii=True)
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {shown}",
                             f"messages[{i}].role")
        content = message.get("content")
        param = f"messages[{i}].content"
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"{param}: only text parts are supported", param)
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"{param} must be a string or a list of text parts", param)
        if "name" in message and not isinstance(message["name"], str):
            raise BadRequest(f"messages[{i}].name must be a string", f"messages[{i}].name")
        out.append({**message, "content": content})
    return out


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, accepted in UNSUPPORTED.items():
        if name in body and not accepted(body[name]):
            why = _UNSUPPORTED_WHY.get(name)
            raise BadRequest(f"'{name}' is not supported yet" + (f": {why}" if why else ""), name)


def _truncate_prompt_tokens(body: dict[str, Any]) -> int | None:
    value = _int(body, "truncate_prompt_tokens", -1, UINT32_MAX)
    if value == 0:
        raise BadRequest("'truncate_prompt_tokens' must be -1 (max_model_len) or a positive integer, got 0",
                         "truncate_prompt_tokens")
    return value


def _chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    kwargs = _field(body, "chat_template_kwargs", dict)
    for key in kwargs or ():
        if not key.isidentifier() or key.startswith("_") or key in _RESERVED_TEMPLATE_KWARGS:
            shown = json.dumps(key, ensure_ascii=True)
            raise BadRequest(f"'chat_template_kwargs' keys must be template variable names other than the "
                             f"template call's own arguments; got {shown}", "chat_template_kwargs")
    return kwargs or None


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous usage); as vLLM: options only with stream: true, and continuous_usage_stats
    only counts with include_usage."""
    options = _field(body, "stream_options", dict)
    if options is None:
        return False, False
    if not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", "stream_options")
    include = bool(_field(options, "include_usage", bool, False, param="stream_options.include_usage"))
    continuous = bool(_field(options, "continuous_usage_stats", bool, False,
                             param="stream_options.continuous_usage_stats"))
    return include, include and continuous


def _prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    """vLLM's rules: a count of alternatives per prompt position, not with stream (beyond 0)."""
    value = _field(body, "prompt_logprobs", int)
    if value is None:
        return None
    if value < 0:
        raise BadRequest(f"'prompt_logprobs' must be a non-negative integer, got {value}", "prompt_logprobs")
    if stream and value > 0:
        raise BadRequest("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    return value


def _logit_bias(body: dict[str, Any]) -> dict[int, float] | None:
    """OpenAI's map of token id (a decimal string) to a bias in [-100, 100]; ids are checked against the vocabulary
    when the request is prepared."""
    bias = _field(body, "logit_bias", dict)
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise BadRequest(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}",
                         "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= UINT32_MAX):
            raise BadRequest(f"'logit_bias' keys must be token ids, got {json.dumps(key, ensure_ascii=True)}",
                             "logit_bias")
        if isinstance(value, bool) or not isinstance(value, _NUMBER) or not abs(value) <= MAX_LOGIT_BIAS:
            raise BadRequest(f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for token {key}",
                             "logit_bias")
        out[int(key)] = float(value)
    return out


def _allowed_token_ids(body: dict[str, Any]) -> list[int] | None:
    """Checked against the vocabulary (and its size) when the request is prepared."""
    ids = body.get("allowed_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in ids):
        raise BadRequest("'allowed_token_ids' must be a non-empty list of token ids (non-negative integers)",
                         "allowed_token_ids")
    return ids


def _bad_words(body: dict[str, Any]) -> list[str] | None:
    """Counted and bounded by SamplingParams; each worker tokenizes them."""
    words = body.get("bad_words")
    if not words:
        return None
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise BadRequest("'bad_words' must be a list of non-empty strings", "bad_words")
    return words


def _n_and_best_of(body: dict[str, Any], max_n: int) -> int:
    n = _int(body, "n", 1, max_n, default=1)
    best_of = _int(body, "best_of", 1, max_n)
    if best_of is not None and best_of != n:
        raise BadRequest(f"'best_of' is not supported yet unless it equals n ({n}), got {best_of}", "best_of")
    return n if n is not None else 1


def _logprobs(body: dict[str, Any], chat: bool, max_logprobs: int) -> int | None:
    """Top alternatives per token; None: no logprobs."""
    if not chat:
        return _int(body, "logprobs", 0, max_logprobs)
    want = _field(body, "logprobs", bool, False)
    top = _int(body, "top_logprobs", 0, max_logprobs, default=0)
    if top and not want:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return top if want else None


def parse_request(body: Any, chat: bool, config: RouterConfig) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _refuse_unsupported(body)
    model = _field(body, "model", str, "")
    prompts: list[str | list[int]] = [] if chat else _prompts(body, config.max_prompts_per_request)
    messages = _messages(body) if chat else None
    n = _n_and_best_of(body, config.max_n)
    stream = _field(body, "stream", bool, False)
    include_usage, continuous_usage = _stream_options(body, stream)
    prompt_logprobs = _prompt_logprobs(body, stream)
    add_generation_prompt = _field(body, "add_generation_prompt", bool, True) if chat else True
    continue_final = _field(body, "continue_final_message", bool, False) if chat else False
    if continue_final and add_generation_prompt:
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                         "continue_final_message")
    if continue_final and messages and messages[-1].get("role") != "assistant":
        raise BadRequest("'continue_final_message' needs the last message to be the assistant's",
                         "continue_final_message")
    max_tokens_param = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens_param = "max_completion_tokens"
    max_tokens = _int(body, max_tokens_param, high=UINT32_MAX, default=None if chat else 16)
    logprobs = _logprobs(body, chat, config.max_logprobs)
    chat_template = _field(body, "chat_template", str) if chat else None
    if chat_template is not None and not config.trust_request_chat_template:
        raise BadRequest("a request's own chat_template is refused: the router does not run --trust-request-chat-"
                         "template", "chat_template")
    kwargs: dict[str, Any] = {"n": n, "max_tokens": max_tokens}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _float(body, name)
        if value is not None:
            kwargs[name] = value
    for name, low, high in (("top_k", None, INT32_MAX), ("seed", INT64_MIN, INT64_MAX),
                            ("min_tokens", None, UINT32_MAX)):
        value = _int(body, name, low, high)
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
                                                     and 0 <= t <= UINT32_MAX for t in stop_ids):
            raise BadRequest("'stop_token_ids' must be a list of token ids (non-negative integers)", "stop_token_ids")
        kwargs["stop_token_ids"] = stop_ids
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        value = _field(body, name, bool)
        if value is not None:
            kwargs[name] = value
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    logit_bias = _logit_bias(body)
    if logit_bias:
        kwargs["logit_bias"] = logit_bias
    for name, value in (("allowed_token_ids", _allowed_token_ids(body)), ("bad_words", _bad_words(body))):
        if value is not None:
            kwargs[name] = value
    tools = _tools(body, chat, config, kwargs)
    try:
        checked = SamplingParams(**kwargs)  # vLLM's range rules and messages
    except InvalidRequest as exc:
        raise BadRequest(str(exc), _body_name(exc.param, chat, max_tokens_param)) from exc
    salt = _field(body, "cache_salt", str)
    return ParsedRequest(
        model=model, prompts=prompts, messages=messages,
        params=sampling_params_to_proto(checked, explicit_only=True),  # the workers' generation defaults fill the rest
        max_tokens=max_tokens, n=n, stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
        logprobs=logprobs, echo=_field(body, "echo", bool, False) if not chat else False,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
        chat_template=chat_template, cache_salt=(salt,) if salt else (), max_tokens_param=max_tokens_param,
        prompt_logprobs=prompt_logprobs, tools=tools, truncate_prompt_tokens=_truncate_prompt_tokens(body),
        chat_template_kwargs=_chat_template_kwargs(body) if chat else None)


def _tools(body: dict[str, Any], chat: bool, config: RouterConfig, kwargs: dict[str, Any]) -> ToolRequest | None:
    """Output constraints (response_format, guided_*, structured_outputs) and tools into `kwargs`."""
    if not chat and body.get("tools"):
        raise BadRequest("'tools' is only supported by /v1/chat/completions", "tools")
    tools = parse_tools(body, config.enable_auto_tool_choice, config.tool_call_parser) if chat else None
    guided, guided_field = structured_outputs_from_body(body)
    constraint = tools.constraint if tools is not None else None
    if constraint is not None:
        if guided is not None:
            raise BadRequest(f"'{guided_field}' cannot be combined with tool_choice {tools.choice!r} (it constrains "
                             "the output to the tools' schema)", guided_field)
        check_constraint(constraint, "tools")
        guided = constraint
    if guided is not None:
        kwargs["structured_outputs"] = guided
    if tools is not None and tools.parser == "hermes" and "skip_special_tokens" not in kwargs:
        kwargs["skip_special_tokens"] = False  # <tool_call> is a special token of Hermes / Qwen vocabularies
    return tools


def _body_name(param: str | None, chat: bool, max_tokens_param: str) -> str | None:
    """The request field behind a SamplingParams field (chat spells two of them differently)."""
    if chat and param == "logprobs":
        return "top_logprobs"
    if param == "max_tokens":
        return max_tokens_param
    return param
