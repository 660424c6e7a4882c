"""The OpenAI / vLLM request fields that constrain the output, read into one `StructuredOutputsParams`.

Accepted spellings (at most one per request): `response_format` (`{"type": "json_object"}`,
`{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`; `{"type": "text"}` constrains nothing),
vLLM's extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and their current form
`structured_outputs` (`{"json": ...}`, `{"regex": ...}`, `{"choice": [...]}`, `{"grammar": ...}`,
`{"json_object": true}`). A schema, regex or grammar that xgrammar cannot compile is a 400 naming its field, before
any worker sees the request, and so is one over the workers' size limits (engine/structured/limits.py, the same
functions the workers apply); the workers compile it against the model's vocabulary (once per distinct constraint).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# Imported with the router, not lazily: importing xgrammar (and so transformers) in the event loop while the
# tokenizer pool's threads import transformers races transformers' lazy module (an ImportError).
import xgrammar  # noqa: F401

from engine.errors import InvalidRequest
from engine.structured.grammar import StructuredOutputsParams, check_grammar_syntax
from engine.structured.limits import check_constraint
from router.errors import BadRequest

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _response_format(value: Any) -> StructuredOutputsParams | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise BadRequest("'response_format' must be an object with a 'type'", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequest("'response_format.json_schema' must be an object with a 'schema'",
                             "response_format.json_schema")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise BadRequest("'response_format.json_schema.schema' must be a JSON schema object",
                             "response_format.json_schema.schema")
        return StructuredOutputsParams(json=schema)
    raise BadRequest(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                     "response_format.type")


def structured_outputs_from_body(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (None, None: unconstrained). Raises BadRequest."""
    found: list[tuple[StructuredOutputsParams | None, str]] = []
    try:
        if body.get("response_format") is not None:
            found.append((_response_format(body["response_format"]), "response_format"))
        for name, kind in GUIDED_FIELDS.items():
            if body.get(name) is not None:
                found.append((StructuredOutputsParams.from_dict({kind: body[name]}, name), name))
        if body.get("structured_outputs") is not None:
            found.append((StructuredOutputsParams.from_dict(body["structured_outputs"]), "structured_outputs"))
    except InvalidRequest as exc:
        raise BadRequest(str(exc), exc.param) from exc
    found = [(params, name) for params, name in found if params is not None]
    if not found:
        return None, None
    if len(found) > 1:
        raise BadRequest(f"give one output constraint, not both '{found[0][1]}' and '{found[1][1]}'", found[1][1])
    params, name = found[0]
    assert params is not None
    check(params, name)
    return params, name


def _refs(schema: Any) -> Iterator[str]:
    """Every `$ref` value in a JSON schema (iterative: schemas may be deep)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None:
                yield ref if isinstance(ref, str) else json.dumps(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _check_local_refs(params: StructuredOutputsParams, param: str) -> None:
    """A `$ref` outside the schema itself (a URL, another file) would have to be fetched: refused, never fetched."""
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return  # not JSON: the syntax check words the refusal
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise BadRequest(f"'{param}': only local $ref (\"#/...\") are supported, got "
                             f"{json.dumps(ref[:200], ensure_ascii=True)}; remote schemas are never fetched", param)


def check(params: StructuredOutputsParams, param: str) -> None:
    """The workers' size limits (engine/structured/limits.py), then xgrammar's syntax check (no tokenizer needed):
    an oversized or bad schema / regex / grammar is a 400 naming `param`; so is a schema referring outside
    itself."""
    try:
        check_constraint(params, param)
    except InvalidRequest as exc:
        raise BadRequest(str(exc), param) from exc
    if params.json is not None:
        _check_local_refs(params, param)
    try:
        check_grammar_syntax(params)
    except InvalidRequest as exc:
        raise BadRequest(f"'{param}': {exc}", param) from exc
