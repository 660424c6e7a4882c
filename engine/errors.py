"""Errors that cross the engine's public surface, and the one reader of JSON-object arguments whose refusals are
such errors.

`json_object_argument` lives here, at the bottom of the engine, because every layer that takes a JSON object as a
flag or a config value (engine/spec/config.py, engine/structured/config.py, engine/processing/generation_config.py
and the CLI's flag_compat) reads it the same way: JSON text or a dict in, a dict out, and a ValueError naming the
argument for anything else.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any


class InvalidRequest(ValueError):
    """A request the engine refuses, with the reason; the engine keeps serving everything else.

    `param` names the offending request field where there is one (the OpenAI front reports it). Transports map
    it to HTTP 400 / gRPC INVALID_ARGUMENT.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotAvailable(RuntimeError):
    """The named model cannot be loaded here (missing package, file or unknown preset)."""


def json_object_argument(value: str | dict[str, Any], name: str, keys: Collection[str] | None = None,
                         keys_are: str = "supported") -> dict[str, Any]:
    """`value` (JSON text, or a dict already) as a dict; ValueError, naming the argument `name`, when it is not
    JSON, not an object, or (with `keys`) holds a key outside `keys`, which the message lists as "`keys_are`
    keys"."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}; {name} must be a JSON object") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict), got {type(value).__name__}")
    unknown = sorted(set(value) - set(keys)) if keys is not None else []
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(map(repr, unknown))} ({keys_are} keys: "
                         f"{', '.join(keys)})")
    return value
