"""Server-side sampling defaults, as vLLM's `--generation-config` and `--override-generation-config`.

- `auto`: the model's generation_config.json; `vllm`: none (vLLM's own defaults); a folder: that folder's
  generation_config.json (the folder must hold one).
- The override (a JSON object in generation_config.json's names: temperature, top_p, top_k, min_p,
  repetition_penalty, max_new_tokens) is merged over those defaults (over nothing with `vllm`).
- Defaults fill only the fields a request did not set; `max_new_tokens` (our `max_tokens`) is also a cap on what a
  request may ask for, as vLLM's (`min` of the request's max_tokens, the room left, and max_new_tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import json_object_argument

# generation_config.json name -> SamplingParams name
NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_generation_config(value: str) -> None:
    if value in ("auto", "vllm"):
        return
    if not (Path(value) / "generation_config.json").is_file():
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json; "
                         f"{value!r} has none")


def parse_override(text: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """The override as a dict (CLI: a JSON object); unknown keys are refused, naming them."""
    if text is None:
        return None
    return json_object_argument(text, "--override-generation-config", NAMES)


def resolve_generation_defaults(generation_config: str, model_path: str | None,
                                override: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling defaults in SamplingParams names."""
    from engine.models.loader import load_generation_defaults  # lazily: torch and transformers

    check_generation_config(generation_config)
    if generation_config == "auto":
        defaults = load_generation_defaults(model_path)
    elif generation_config == "vllm":
        defaults = {}
    else:
        defaults = load_generation_defaults(generation_config)
    for name, value in (parse_override(override) or {}).items():
        defaults[NAMES[name]] = value
    return defaults


def cap_max_tokens(defaults: dict[str, Any], max_tokens: int | None) -> int | None:
    """vLLM: a request's max_tokens never exceeds the generation config's max_new_tokens."""
    cap = defaults.get("max_tokens")
    if cap is None or max_tokens is None:
        return max_tokens
    return min(max_tokens, cap)
