"""Tokenization and block hashing off the event loop, in a pool of threads (HF fast tokenizers release the GIL).

Threads, not processes: a process pool would pickle tokenizers and prompts across processes. A chat template render
is time-bounded (`render_with_deadline`), so no request can hold a pool thread longer than that.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.core.block_hash import BlockHasher
from engine.errors import InvalidRequest
from engine.processing.tokenizer import apply_chat_template, load_tokenizer

logger = logging.getLogger(__name__)


JINJA_FILENAME = "<template>"  # the code filename of a template compiled from a string (transformers does)


class _RenderTimeout(BaseException):
    """A BaseException, so no `except Exception` inside Jinja or transformers can swallow it mid-render."""


def render_with_deadline(render: Callable[[], str], timeout_s: float) -> str:
    """`render()` (a Jinja chat template), failed with InvalidRequest once it runs past `timeout_s`.

    A thread cannot be interrupted from outside, so the render checks the deadline itself: a trace function on
    this thread sees each function call and each line of the compiled template (plain Python) and raises once time
    is up.
    """
    deadline = time.monotonic() + timeout_s

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _RenderTimeout
        # Line events only inside template code (a loop there may call nothing); every other call is seen on entry.
        return trace if frame.f_code.co_filename == JINJA_FILENAME else None

    previous = sys.gettrace()  # a debugger's or coverage's, restored below
    sys.settrace(trace)
    try:
        return render()
    except _RenderTimeout:
        raise InvalidRequest(f"the chat template took longer than {timeout_s:g} s to render") from None
    finally:
        sys.settrace(previous)


def tokenizer_path_for(model: str, override: str | None) -> str | None:
    """The tokenizer directory for the workers' `model` (None: token ids only)."""
    if override:
        return override
    from engine.models.loader import resolve_model

    try:
        return resolve_model(model).tokenizer_path
    except Exception as exc:  # the router may not have the model's files: text prompts are then refused
        logger.warning("no tokenizer for model %r on the router (%s): only token-id prompts are accepted", model, exc)
        return None


class TokenizerPool:
    def __init__(self, tokenizer_path: str | None, hasher: BlockHasher, size: int = 2) -> None:
        if size < 1:
            raise ValueError(f"--tokenizer-pool-size must be >= 1, got {size}")
        self.tokenizer: Any = load_tokenizer(tokenizer_path)
        self.hasher = hasher
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="tokenize")

    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer on the router; send the prompt as token ids")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    chat_template: str | None, timeout_s: float,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False
                    ) -> tuple[str, list[int]]:
        text = render_with_deadline(
            lambda: apply_chat_template(self.tokenizer, messages, add_generation_prompt, chat_template, tools,
                                        continue_final_message), timeout_s)
        return text, self.encode(text, add_special_tokens=False)  # the template already has them

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer on the router")
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
