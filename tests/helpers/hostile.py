"""Hostile inputs of issue 27 that several tests send."""

from __future__ import annotations

from typing import Any


def nested_any_of(depth: int) -> dict[str, Any]:
    """The hostile schema of issue 27: each level refers to the one below four times (4^depth values; the issue's
    0.9 MB at depth 7)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "object", "properties": {"a": schema, "b": schema}, "required": ["a"]},
                            {"type": "array", "items": schema}, schema]}
    return schema
