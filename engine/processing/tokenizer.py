"""Tokenizer loading and chat templating (local files only: no hub access)."""

from __future__ import annotations

import os
from typing import Any

from engine.errors import InvalidRequest


def load_tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                        continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
    """`tools` (OpenAI function tools) reach the template as vLLM passes them; a template without tool support
    ignores them. `template_kwargs` (vLLM's `chat_template_kwargs`, e.g. enable_thinking) are extra template
    variables."""
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer, so chat is unavailable; send token ids")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidRequest("each message needs a 'role' and 'content'")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, tools=tools,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}))
    except Exception as exc:  # template errors are the caller's input problem
        raise InvalidRequest(f"chat template failed: {str(exc) or type(exc).__name__}") from exc
