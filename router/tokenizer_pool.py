"""Tokenization and block hashing off the event loop, in a pool of threads (HF fast tokenizers release the GIL).

Threads, not processes: a process pool would pickle tokenizers and prompts across processes. The model's chat
template renders here, time-bounded between Python lines (`render_with_deadline`); a request's own template
(`--trust-request-chat-template`) renders in a child process killed at the deadline (router/template_sandbox.py),
since C-level work inside it would hold the GIL, and so the event loop, however the thread checks its clock.

Length before work: a text of N characters has at least N / L tokens, L being the longest vocabulary entry in
characters (`max_token_chars`, computed once), so a text whose bound already passes max_model_len is refused
without tokenizing it (`check_length`): tokenizing 20 MB took seconds and gigabytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.core.block_hash import BlockHasher
from engine.errors import InvalidRequest
from engine.processing.tokenizer import apply_chat_template, load_tokenizer
from router.template_deadline import render_with_deadline
from router.template_sandbox import TemplateSandbox

logger = logging.getLogger(__name__)


# Parts of a fast tokenizer's pipeline after which every token still covers at most its own vocabulary entry's
# characters (ByteLevel: one character per byte; Metaspace: "▁" per space). Others may drop or merge text: a
# whitespace-splitting pre-tokenizer, a stripping or composing normalizer, fused unknown tokens.
_KEEPING_NORMALIZERS = frozenset({"Sequence", "Prepend", "NFD", "NFKD", "Lowercase"})
_KEEPING_PRE_TOKENIZERS = frozenset({"Sequence", "ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                                     "UnicodeScripts"})


def _parts(node: Any) -> list[dict[str, Any]]:
    """A pipeline stage's components (a Sequence's members included)."""
    if not isinstance(node, dict):
        return []
    members = node.get("normalizers") or node.get("pretokenizers") or []
    return [node, *(part for member in members for part in _parts(member))]


def _keeps_text(spec: dict[str, Any]) -> bool:
    for part in _parts(spec.get("normalizer")):
        pattern = part.get("pattern") if part.get("type") == "Replace" else None
        shrinks = pattern is not None and not (isinstance(pattern, dict) and "String" in pattern and
                                               len(part.get("content", "")) >= len(pattern["String"]))
        if shrinks or (part.get("type") not in _KEEPING_NORMALIZERS and part.get("type") != "Replace"):
            return False
    for part in _parts(spec.get("pre_tokenizer")):
        if part.get("type") not in _KEEPING_PRE_TOKENIZERS or part.get("behavior") == "Removed":
            return False
    model = spec.get("model") or {}
    return model.get("type") == "BPE" and (not model.get("fuse_unk") or bool(model.get("byte_fallback")))


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token can cover (its longest vocabulary entry), or None when the tokenizer
    may drop or merge text (then no such bound holds, and prompts are tokenized to be measured)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    if not _keeps_text(json.loads(backend.to_str())):
        logger.warning("this tokenizer may drop or merge text: prompt lengths are measured by tokenizing them")
        return None
    return max(map(len, tokenizer.get_vocab()), default=0) or None


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
    def __init__(self, tokenizer_path: str | None, hasher: BlockHasher, size: int = 2,
                 template_workers: int = 1) -> None:
        if size < 1:
            raise ValueError(f"--tokenizer-pool-size must be >= 1, got {size}")
        self.tokenizer: Any = load_tokenizer(tokenizer_path)
        self.max_token_chars = max_token_chars(self.tokenizer) if self.tokenizer is not None else None
        self.hasher = hasher
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="tokenize")
        # Request templates only; its children start at the first one.
        self._sandbox = TemplateSandbox(tokenizer_path, template_workers) if tokenizer_path is not None else None

    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def min_tokens(self, text: str) -> int:
        """A lower bound on `text`'s token count, without tokenizing it (0: none known)."""
        return -(-len(text) // self.max_token_chars) if self.max_token_chars else 0

    def check_length(self, text: str, max_model_len: int, param: str, note: str = "") -> None:
        """Refuse `text` (InvalidRequest naming `param`) when it surely has max_model_len tokens or more. O(1)."""
        bound = self.min_tokens(text)
        if bound >= max_model_len:
            raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens. However, your "
                                 f"prompt has at least {bound} tokens ({len(text)} characters); shorten it.{note}",
                                 param)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer on the router; send the prompt as token ids")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    chat_template: str | None, timeout_s: float,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None, max_model_len: int | None = None,
                    add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """The rendered prompt and its tokens; refused by its length bound before tokenizing (`max_model_len`)."""
        text = render_with_deadline(
            lambda: apply_chat_template(self.tokenizer, messages, add_generation_prompt, chat_template, tools,
                                        continue_final_message, template_kwargs), timeout_s)
        if max_model_len is not None:
            self.check_length(text, max_model_len, "messages")
        return text, self.encode(text, add_special_tokens)  # default off: the template already has them

    async def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, chat_template: str | None,
                   timeout_s: float, tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                   template_kwargs: dict[str, Any] | None = None, max_model_len: int | None = None,
                   add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """`chat_prompt`, with a request's own `chat_template` rendered in the sandbox (never on this process)."""
        if chat_template is None:  # the model's template
            return await self.run(self.chat_prompt, messages, add_generation_prompt, None, timeout_s, tools,
                                  continue_final_message, template_kwargs, max_model_len, add_special_tokens)
        if self._sandbox is None:
            raise InvalidRequest("this model has no tokenizer, so chat is unavailable; send token ids")
        bound = max_model_len * self.max_token_chars if max_model_len and self.max_token_chars else None
        text = await self._sandbox.render({
            "messages": messages, "add_generation_prompt": add_generation_prompt, "chat_template": chat_template,
            "tools": tools, "continue_final_message": continue_final_message, "template_kwargs": template_kwargs,
            "max_chars": bound}, timeout_s)
        if max_model_len is not None:
            self.check_length(text, max_model_len, "messages")
        return text, await self.run(self.encode, text, add_special_tokens)

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
        if self._sandbox is not None:
            self._sandbox.close()
