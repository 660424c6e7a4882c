"""The engine-wide structured-output configuration, in vLLM's form.

`structured_outputs_config` (`--structured-outputs-config`) is a dict, or its JSON text on the command line, with
vLLM's keys; `guided_decoding_backend` (`--guided-decoding-backend`) is vLLM's older spelling of its `backend`.
kvflow has one backend, xgrammar, so:
  backend                 "auto" or "xgrammar" (both are xgrammar); outlines, guidance, lm-format-enforcer: refused
  disable_any_whitespace  honoured: every JSON grammar (schemas, json_object, tool calls) allows no free whitespace
  disable_fallback        honoured as it stands: there is no other backend to fall back to
and the keys xgrammar cannot honour are refused unless they hold vLLM's default (`_DEFAULT_ONLY`).
Every error is one line naming the flag (or key) and the reason; this module imports nothing heavy, so the CLI can
check the flags before any worker starts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine.errors import json_object_argument

BACKENDS: tuple[str, ...] = ("auto", "xgrammar")
CONFIG_FLAG = "`--structured-outputs-config`"
BACKEND_FLAG = "--guided-decoding-backend"
_XGRAMMAR_ONLY = "structured output uses xgrammar; use auto or xgrammar"
_REASONING = "reasoning-content parsing is not implemented"
# vLLM's keys kvflow cannot honour: the value that is vLLM's default (accepted: it asks for nothing), and why any
# other value is refused. vLLM itself refuses disable_additional_properties=true with a backend other than guidance.
_DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "disable_additional_properties": (False, "it applies to vLLM's guidance backend only; xgrammar never "
                                             "generates properties a JSON schema does not declare"),
    "reasoning_parser": ("", _REASONING),
    "reasoning_parser_plugin": ("", _REASONING),
    "enable_in_reasoning": (False, _REASONING),
}
_BOOLEANS = ("disable_fallback", "disable_any_whitespace")
KEYS: tuple[str, ...] = ("backend", *_BOOLEANS, *_DEFAULT_ONLY)


def _refused(what: str, reason: str) -> ValueError:
    return ValueError(f"{what} is not supported by kvflow ({reason})")


def _check_backend(value: Any, what: str) -> str:
    if not isinstance(value, str) or value not in BACKENDS:
        reason = _XGRAMMAR_ONLY
        if isinstance(value, str) and ":" in value:  # vLLM 0.8's `xgrammar:disable-any-whitespace` options
            reason += f"; backend options are keys of {CONFIG_FLAG}, e.g. '{{\"disable_any_whitespace\": true}}'"
        raise _refused(what, reason)
    return value


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """What the engine's StructuredOutputManager honours (the refused keys never get this far)."""

    backend: str = "auto"  # "auto" or "xgrammar": both compile with xgrammar
    disable_fallback: bool = False  # true always holds: no request ever falls back to another backend
    disable_any_whitespace: bool = False  # JSON grammars without free whitespace, for every request

    def __post_init__(self) -> None:
        _check_backend(self.backend, f"{CONFIG_FLAG} backend {self.backend!r}")
        for name in _BOOLEANS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{CONFIG_FLAG} key {name!r} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def parse(cls, config: StructuredOutputsConfig | dict[str, Any] | str | None,
              guided_decoding_backend: str | None = None) -> StructuredOutputsConfig:
        """The config from `structured_outputs_config` (a dict, its JSON text, a StructuredOutputsConfig or None)
        and `guided_decoding_backend` (None: not given); raises ValueError, one line naming the flag or key."""
        if isinstance(config, StructuredOutputsConfig):
            settings = dataclasses.asdict(config)
            if config.backend == "auto":  # the dataclass default: not a backend the caller chose
                del settings["backend"]
        else:
            settings = cls._settings(config)
        if guided_decoding_backend is not None:
            _check_backend(guided_decoding_backend, f"`{BACKEND_FLAG} {guided_decoding_backend}`")
            given = settings.get("backend")
            if given is not None and given != guided_decoding_backend:
                raise ValueError(f"`{BACKEND_FLAG} {guided_decoding_backend}` and {CONFIG_FLAG} backend {given!r} "
                                 "disagree; give the backend once")
            settings["backend"] = guided_decoding_backend
        return cls(**settings)

    @staticmethod
    def _settings(config: dict[str, Any] | str | None) -> dict[str, Any]:
        """The honoured keys of a dict / JSON config, after refusing the others."""
        if config is None:
            return {}
        config = json_object_argument(config, CONFIG_FLAG, KEYS, keys_are="vLLM's")
        for key, (default, reason) in _DEFAULT_ONLY.items():
            if key in config and not (config[key] == default and type(config[key]) is type(default)):
                raise _refused(f"{CONFIG_FLAG} key {key!r} = {json.dumps(config[key], default=repr)}", reason)
        return {k: v for k, v in config.items() if k not in _DEFAULT_ONLY}
