"""Size limits on output constraints and tool definitions, as pure functions the router and the engine share.

A grammar's compile time grows with its size: a 1 MiB tool name, a deeply nested `anyOf`, a regex such as
`.{0,1000000}` each took xgrammar from seconds to minutes. These checks refuse such inputs in linear time,
before anything compiles; the engine's compile time budget (`--structured-outputs-timeout-s`) catches whatever
passes them and is still slow. Every refusal is an `InvalidRequest` naming the field.

This module imports nothing heavy (no torch, no xgrammar): the router imports it without loading the runner.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest

# OpenAI's rule for function names (vLLM's protocol does not check it; OpenAI refuses anything else with a 400).
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# JSON-schema keywords whose value xgrammar unrolls into that many grammar repetitions.
REPEAT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUND = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class StructuredOutputLimits:
    """What one request's constraint may hold. The defaults pass every schema, regex and grammar a real
    application sends (OpenAI's own limits are stricter: 100 properties, depth 5 for strict schemas)."""

    timeout_s: float = 5.0  # the engine's compile budget per constraint (`--structured-outputs-timeout-s`)
    max_schema_chars: int = 256 << 10  # a JSON schema's canonical text
    max_schema_depth: int = 64  # nesting of objects and arrays in a schema
    max_schema_nodes: int = 10_000  # JSON values in a schema (objects, arrays, scalars)
    max_regex_chars: int = 16 << 10
    max_grammar_chars: int = 64 << 10
    max_choices: int = 1_000
    max_choice_chars: int = 64 << 10  # all the choices together
    max_repeat: int = 10_000  # a counted repetition ({m,n}, maxLength, ...), nested ones multiplied
    max_tools: int = 128  # OpenAI's limit

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"--structured-outputs-timeout-s must be > 0, got {self.timeout_s}")


DEFAULT_LIMITS = StructuredOutputLimits()


def check_tool_name(name: Any, field: str) -> None:
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        shown = json.dumps(name[:40] + ("..." if len(name) > 40 else "")) if isinstance(name, str) else repr(name)
        raise InvalidRequest(f"'{field}' must be 1 to 64 letters, digits, '_' or '-' (^[a-zA-Z0-9_-]{{1,64}}$), "
                             f"got {shown} ({len(name) if isinstance(name, str) else 0} characters)", field)


def check_tool_count(count: int, field: str, limits: StructuredOutputLimits = DEFAULT_LIMITS) -> None:
    if count > limits.max_tools:
        raise InvalidRequest(f"'{field}' has {count} tools; at most {limits.max_tools} are allowed", field)


def check_schema(schema: Any, field: str, limits: StructuredOutputLimits = DEFAULT_LIMITS) -> None:
    """Depth, node count, repetition keywords and `pattern`s of a JSON schema (parsed); then its text size."""
    nodes = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]  # iterative: a hostile schema may be deeper than the stack
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > limits.max_schema_nodes:
            raise InvalidRequest(f"'{field}': the JSON schema has more than {limits.max_schema_nodes} values",
                                 field)
        if isinstance(node, dict):
            _check_depth(depth, field, limits)
            _check_schema_keywords(node, field, limits)
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            _check_depth(depth, field, limits)
            stack.extend((value, depth + 1) for value in node)
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > limits.max_schema_chars:
        raise InvalidRequest(f"'{field}': the JSON schema is {size} characters; at most {limits.max_schema_chars} "
                             "are allowed", field)


def _check_depth(depth: int, field: str, limits: StructuredOutputLimits) -> None:
    if depth > limits.max_schema_depth:
        raise InvalidRequest(f"'{field}': the JSON schema nests deeper than {limits.max_schema_depth} levels", field)


def _check_schema_keywords(node: dict[str, Any], field: str, limits: StructuredOutputLimits) -> None:
    for keyword in REPEAT_KEYWORDS:
        value = node.get(keyword)
        if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_repeat:
            raise InvalidRequest(f"'{field}': {keyword} {value} is over the limit of {limits.max_repeat}", field)
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        check_regex(pattern, field, limits)


def check_regex(regex: str, field: str, limits: StructuredOutputLimits = DEFAULT_LIMITS) -> None:
    _check_text(regex, "regex", limits.max_regex_chars, field, limits, quoted=False)


def check_grammar(grammar: str, field: str, limits: StructuredOutputLimits = DEFAULT_LIMITS) -> None:
    _check_text(grammar, "grammar", limits.max_grammar_chars, field, limits, quoted=True)


def check_choices(choices: list[str], field: str, limits: StructuredOutputLimits = DEFAULT_LIMITS) -> None:
    if len(choices) > limits.max_choices:
        raise InvalidRequest(f"'{field}': {len(choices)} choices; at most {limits.max_choices} are allowed", field)
    size = sum(len(c) for c in choices)
    if size > limits.max_choice_chars:
        raise InvalidRequest(f"'{field}': the choices hold {size} characters; at most {limits.max_choice_chars} "
                             "are allowed", field)


def _check_text(text: str, what: str, max_chars: int, field: str, limits: StructuredOutputLimits,
                quoted: bool) -> None:
    if len(text) > max_chars:
        raise InvalidRequest(f"'{field}': the {what} is {len(text)} characters; at most {max_chars} are allowed",
                             field)
    repeat = max_repeat(text, quoted)
    if repeat > limits.max_repeat:
        raise InvalidRequest(f"'{field}': the {what} repeats up to {repeat} times ({{m,n}} bounds, nested ones "
                             f"multiplied); at most {limits.max_repeat} are allowed", field)


def max_repeat(text: str, quoted: bool = False) -> int:
    """The largest unrolled repetition count of a regex (or, `quoted`, an EBNF grammar, whose string literals are
    skipped): each `{m,n}` bound times the bounds of the groups around it. Brackets and escapes are skipped; an
    unbalanced text is measured as far as it goes (xgrammar words its syntax error)."""
    stack = [1]  # per open group: the largest count inside it so far
    i, last = 0, 1  # last: the count of the atom just closed, for a bound that follows it
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i, last = i + 2, 1
            continue
        if ch == "[" or (quoted and ch in "\"'"):
            i, last = _skip_span(text, i, "]" if ch == "[" else ch), 1
            continue
        if ch == "(":
            stack.append(1)
            last = 1
        elif ch == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
        elif ch == "{" and (match := _BOUND.match(text, i)):
            bound = max(int(match.group(1)), int(match.group(2) or 0))
            last *= max(bound, 1)
            stack[-1] = max(stack[-1], last)
            i = match.end()
            continue
        else:
            last = 1
        i += 1
    return max(stack)


def _skip_span(text: str, start: int, close: str) -> int:
    """The index after the `close` ending the span opened at `start` (escapes skipped)."""
    i = start + 1
    while i < len(text) and text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def check_constraint(params: Any, field: str, limits: StructuredOutputLimits = DEFAULT_LIMITS) -> None:
    """The limits for one `StructuredOutputsParams` (duck-typed: this module does not import grammar.py)."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            if len(schema) > limits.max_schema_chars * 4:  # parsing it at all must stay cheap
                raise InvalidRequest(f"'{field}': the JSON schema text is {len(schema)} characters; at most "
                                     f"{limits.max_schema_chars} are allowed", field)
            schema = json.loads(schema)  # validated JSON by StructuredOutputsParams
        check_schema(schema, field, limits)
    elif kind == "regex":
        check_regex(params.regex, field, limits)
    elif kind == "grammar":
        check_grammar(params.grammar, field, limits)
    elif kind == "choice":
        check_choices(params.choice, field, limits)
