"""A request body's JSON, before any field is read: strict (no NaN / Infinity literals), nested at most
MAX_JSON_DEPTH deep, and no lone UTF-16 surrogate in any string or key. Each refusal is a `BadRequest` naming the
top-level field where it can."""

from __future__ import annotations

import json
import re
from typing import Any

from router.errors import BadRequest

MAX_JSON_DEPTH = 32  # a chat body with text parts is 5 deep
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads lets "\\ud800" through; no tokenizer or encoder takes it
# What a surrogate looks like in UTF-8 JSON text before parsing: an escape, or its (surrogatepass) UTF-8 bytes.
_RAW_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_CONTAINERS = frozenset((dict, list))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_body(raw: bytes) -> Any:
    """Strict JSON; refuses deep nesting and lone surrogates (they fail later, deep inside, as 500s)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity, an integer of 4300+ digits
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    _check_depth(body)
    if json.detect_encoding(raw) != "utf-8" or _RAW_SURROGATE.search(raw):  # else no string can hold one
        _check_strings(body)
    return body


def _check_depth(body: Any) -> None:
    """Iterative (a recursive walk is what the limit protects against). A list holding no container is skipped at C
    speed (`set(map(type, ...))`): a 32 MiB prompt of token ids costs a fraction of its parse."""
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        value, depth, top = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", top)
        if isinstance(value, dict):
            stack.extend((item, depth + 1, key if top is None else top) for key, item in value.items()
                         if type(item) in _CONTAINERS)
        elif isinstance(value, list) and not _CONTAINERS.isdisjoint(set(map(type, value))):
            stack.extend((item, depth + 1, top) for item in value if type(item) in _CONTAINERS)


def _check_strings(body: Any) -> None:
    """No lone surrogate in any string or key; the error names the top-level field holding it."""
    stack: list[tuple[Any, str | None]] = [(body, None)]
    while stack:
        value, top = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise BadRequest("strings must be valid Unicode: a lone UTF-16 surrogate is not a character", top)
        elif isinstance(value, dict):
            for key, item in value.items():
                where = key if top is None else top
                if _SURROGATE.search(key):
                    raise BadRequest("object keys must be valid Unicode: a lone UTF-16 surrogate is not a character",
                                     where)
                stack.append((item, where))
        elif isinstance(value, list):
            stack.extend((item, top) for item in value)
