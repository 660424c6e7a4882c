"""Tool calling for /v1/chat/completions, as vLLM does it: `tools` + `tool_choice`.

- `none`: the tools reach the chat template; the output is plain content.
- `required` and a named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained
  by a JSON schema built from the tools' parameters (the structured-output machinery), then turned into
  `tool_calls`: a named choice's output is the arguments object; `required`'s is a list of
  `{"name": ..., "parameters": {...}}`.
- `auto` (the default when tools are given): needs the router's `--enable-auto-tool-choice` and a
  `--tool-call-parser` (else 400, as in vLLM); the parser of the model family finds tool calls in free text:
  `hermes` (Hermes / Qwen: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`) or `llama3_json`
  (`{"name": ..., "parameters": ...}` objects separated by `;`, optionally after `<|python_tag|>`).

Responses carry `tool_calls` with finish_reason `tool_calls`; streams carry them as deltas (a named choice streams
its arguments as they come; `required` and `auto` send each call whole once it is complete).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequest
from engine.structured.grammar import StructuredOutputsParams
from engine.structured.limits import check_schema, check_tool_count, check_tool_name
from router.errors import BadRequest

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as sent (the chat template renders them)
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    parser: str | None = None  # auto: the --tool-call-parser

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        """The JSON schema enforcing `required` / a named choice (vLLM's construction)."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self._parameters(self.name))
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                       "parameters": self._parameters(t["function"]["name"])},
                      "required": ["name", "parameters"]} for t in self.tools]
            return StructuredOutputsParams(json={"type": "array", "minItems": 1,
                                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})
        return None

    def _parameters(self, name: str | None) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or _EMPTY_PARAMETERS

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def parse_tools(body: dict[str, Any], enable_auto_tool_choice: bool, parser: str | None) -> ToolRequest | None:
    """`tools` and `tool_choice` of a chat request (None: no tools). Raises BadRequest naming the field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("'tools' must be a list of function tools", "tools")
        if choice not in (None, "none"):
            raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of function tools", "tools")
    _check_limit(check_tool_count, len(tools), "tools")
    names = [_tool_name(i, tool) for i, tool in enumerate(tools)]
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise BadRequest("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                             "{\"name\": ...}}", "tool_choice")
        if name not in names:
            raise BadRequest(f"'tool_choice' names {name!r}, which is not among the tools ({', '.join(names)})",
                             "tool_choice")
        return ToolRequest(tools, "named", name)
    if choice in ("none", "required"):
        return ToolRequest(tools, choice)
    if choice == "auto":
        if not enable_auto_tool_choice or parser is None:
            raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                             "set", "tool_choice")
        return ToolRequest(tools, "auto", parser=parser)
    raise BadRequest(f"'tool_choice' must be none, auto, required or a named function, got {choice!r}",
                     "tool_choice")


def _tool_name(i: int, tool: Any) -> str:
    """One tool's checked name: a function with an OpenAI-style name and parameters within the schema limits
    (engine/structured/limits.py: the tools become the workers' grammar, and reach the chat template)."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise BadRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise BadRequest(f"{where}.function must be an object with a non-empty 'name'", f"{where}.function.name")
    _check_limit(check_tool_name, function["name"], f"{where}.function.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise BadRequest(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
    if parameters is not None:
        _check_limit(check_schema, parameters, f"{where}.function.parameters")
    return function["name"]


def _check_limit(check: Callable[[Any, str], None], value: Any, field: str) -> None:
    try:
        check(value, field)
    except InvalidRequest as exc:
        raise BadRequest(str(exc), field) from exc


# ---- turning text into calls --------------------------------------------------------------------------------
def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call_from(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return new_call(obj["name"], _arguments(args))


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    if _HERMES_START not in text:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text):
        try:
            call = _call_from(json.loads(body))
        except ValueError:
            return text, []  # a malformed call: the text stays content, as vLLM's parser does
        if call is None:
            return text, []
        calls.append(call)
    content = text[: text.index(_HERMES_START)]
    return (content if content.strip() else None), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.lstrip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_from(obj)
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def extract(request: ToolRequest, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished output."""
    if request.choice == "named":
        return None, [new_call(request.name or "", text)]
    if request.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut short (finish_reason length): no complete calls
        calls = [new_call(item["name"], _arguments(item.get("parameters", {}))) for item in items
                 if isinstance(item, dict) and isinstance(item.get("name"), str)] if isinstance(items, list) else []
        return (None, calls) if calls else (text, [])
    if request.choice == "auto":
        return parse_hermes(text) if request.parser == "hermes" else parse_llama3_json(text)
    return text, []


def chat_message(request: ToolRequest | None, text: str, finish_reason: str | None
                 ) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice, and its finish_reason (`tool_calls` when calls were made)."""
    if request is None or not request.parses:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = extract(request, text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, \
        "tool_calls" if finish_reason == "stop" else finish_reason


# ---- streaming ---------------------------------------------------------------------------------------------
@dataclass
class ToolStream:
    """One streamed choice: turns text pieces into chat deltas (`content` and / or `tool_calls`)."""

    request: ToolRequest
    text: str = ""
    sent_content: int = 0  # characters of `text` sent as content
    held: bool = False  # auto: a tool call started; the rest waits for the end
    named_call: dict[str, Any] | None = field(default=None, repr=False)

    def feed(self, piece: str) -> dict[str, Any] | None:
        """The delta for a new piece of text (None: nothing to send yet)."""
        self.text += piece
        request = self.request
        if request.choice == "named":
            if self.named_call is None:
                self.named_call = new_call(request.name or "", "")
                return {"tool_calls": [{"index": 0, **self.named_call,
                                        "function": {"name": request.name, "arguments": piece}}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else None
        if request.choice == "required" or self.held:
            return None
        safe = self._safe_content_end()
        if safe <= self.sent_content:
            return None
        content, self.sent_content = self.text[self.sent_content:safe], safe
        return {"content": content}

    def _safe_content_end(self) -> int:
        """auto: how much of the text is surely content (a tool call may start after it)."""
        if self.request.parser == "hermes":
            start = self.text.find(_HERMES_START)
            if start >= 0:
                self.held = True
                return start
            for keep in range(min(len(_HERMES_START) - 1, len(self.text)), 0, -1):  # a marker may be forming
                if _HERMES_START.startswith(self.text[-keep:]):
                    return len(self.text) - keep
            return len(self.text)
        stripped = self.text.lstrip()
        if not stripped:
            return self.sent_content
        if stripped.startswith("{") or stripped.startswith(_PYTHON_TAG) or _PYTHON_TAG.startswith(stripped):
            self.held = self.held or stripped.startswith(("{", _PYTHON_TAG))
            return self.sent_content
        return len(self.text)

    def finish(self, full_text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The last delta of the choice (what was held back) and its finish_reason."""
        rest = full_text[len(self.text):] if full_text.startswith(self.text) else ""
        self.text += rest
        finish = "tool_calls" if finish_reason == "stop" else finish_reason
        if self.request.choice == "named":  # its arguments were streamed as they came
            if self.named_call is None:
                self.named_call = new_call(self.request.name or "", self.text)
                return {"tool_calls": [{"index": 0, **self.named_call}]}, finish
            return ({"tool_calls": [{"index": 0, "function": {"arguments": rest}}]} if rest else {}), finish
        content, calls = extract(self.request, self.text)
        delta: dict[str, Any] = {}
        if not calls:
            if len(self.text) > self.sent_content:
                delta["content"] = self.text[self.sent_content:]
            return delta, finish_reason
        if content and len(content) > self.sent_content:
            delta["content"] = content[self.sent_content:]
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return delta, finish
