"""A parsed OpenAI request made ready for the workers: its model resolved, its prompts tokenized, and each prompt's
sampling parameters with max_tokens checked against the model's context (or filled with the room left).

Invariants of a `PreparedRequest`: the model is one the router serves; every prompt's token ids are in the
vocabulary and fit max_model_len with its max_tokens; logit_bias names only vocabulary ids. So a worker refuses
nothing the router let through, and every refusal here is a `BadRequest` naming its field.

Work is bounded before it starts: a text prompt whose length bound (router.tokenizer_pool) already passes
max_model_len is refused without tokenizing it, and a token-id prompt longer than max_model_len before its ids are
checked. `truncate_prompt_tokens` (vLLM's) keeps a prompt's last k tokens (-1: max_model_len); a text is still
refused by its bound, so it applies to texts of at most max_model_len x (longest token) characters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.errors import InvalidRequest
from protos.kvflow.v1 import kvflow_pb2 as pb
from router.core import Router
from router.errors import BadRequest, ModelNotFound
from router.openai_protocol import ParsedRequest
from router.tokenizer_pool import TokenizerPool


@dataclass(frozen=True)
class Prompt:
    text: str | None  # None: the request gave token ids
    token_ids: list[int]
    params: pb.SamplingParams  # the request's, with this prompt's max_tokens


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    parsed: ParsedRequest
    model: str  # the name the response reports: the request's, or the first served name
    prompts: list[Prompt]
    owner: str  # who may abort it (router/ownership.py)
    created: int = field(default_factory=lambda: int(time.time()))


async def prepare(router: Router, parsed: ParsedRequest, request_id: str, owner: str) -> PreparedRequest:
    model = _served_model(router, parsed.model)
    tokenizers = await router.ensure_tokenizers()
    keep = _kept_tokens(router, parsed.truncate_prompt_tokens)
    texts_and_ids: list[tuple[str | None, list[int], str]] = []  # (text, token ids, the field it came from)
    if parsed.messages is not None:
        texts_and_ids.append(await _chat_prompt(router, tokenizers, parsed))
    for prompt in parsed.prompts:
        texts_and_ids.append(await _completion_prompt(router, tokenizers, prompt, keep))
    if keep is not None:
        texts_and_ids = [await _truncated(tokenizers, text, ids, param, keep, parsed.echo)
                         for text, ids, param in texts_and_ids]
    router.check_token_ids(list(parsed.params.logit_bias), "logit_bias")
    router.check_token_ids(list(parsed.params.allowed_token_ids), "allowed_token_ids")
    prompts = [Prompt(text, ids, router.params_for_prompt(parsed.params, len(ids), param, parsed.max_tokens_param))
               for text, ids, param in texts_and_ids]
    return PreparedRequest(request_id, parsed, model, prompts, owner)


def _served_model(router: Router, asked: str) -> str:
    info = router.model_info  # 503 until a worker answered
    names = router.served_model_names
    model = asked or names[0]
    if model not in names and model != info.model:
        raise ModelNotFound(f"The model `{model}` does not exist. Available: {', '.join(names)}", "model")
    return model


def _kept_tokens(router: Router, truncate: int | None) -> int | None:
    """How many trailing prompt tokens `truncate_prompt_tokens` keeps (None: no truncation)."""
    if truncate is None:
        return None
    limit = router.model_info.max_model_len
    if truncate > limit:
        raise BadRequest(f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len ({limit}). "
                         "Please, select a smaller truncation size.", "truncate_prompt_tokens")
    return limit if truncate < 0 else truncate


async def _truncated(tokenizers: TokenizerPool, text: str | None, ids: list[int], param: str, keep: int,
                     echo: bool) -> tuple[str | None, list[int], str]:
    """The prompt's last `keep` tokens (vLLM truncates on the left); the text echoed is what was kept."""
    if len(ids) <= keep:
        return text, ids, param
    kept = ids[-keep:]
    kept_text = await tokenizers.run(tokenizers.decode, kept) if echo and text is not None else None
    return kept_text, kept, param


async def _chat_prompt(router: Router, tokenizers: TokenizerPool,
                       parsed: ParsedRequest) -> tuple[str | None, list[int], str]:
    try:
        text, ids = await tokenizers.chat(parsed.messages, parsed.add_generation_prompt, parsed.chat_template,
                                          router.config.chat_template_timeout_s,
                                          parsed.tools.tools if parsed.tools is not None else None,
                                          parsed.continue_final_message, parsed.chat_template_kwargs,
                                          router.model_info.max_model_len)
    except InvalidRequest as exc:  # the template failed on these messages (or is the request's own)
        raise BadRequest(str(exc), exc.param or ("chat_template" if parsed.chat_template else "messages")) from exc
    return text, ids, "messages"


async def _completion_prompt(router: Router, tokenizers: TokenizerPool, prompt: str | list[int],
                             keep: int | None) -> tuple[str | None, list[int], str]:
    limit = router.model_info.max_model_len
    if isinstance(prompt, str):
        try:
            note = "" if keep is None else " (truncate_prompt_tokens applies to prompts the router can tokenize: " \
                f"at most {limit * (tokenizers.max_token_chars or 0) - 1} characters)"
            tokenizers.check_length(prompt, limit, "prompt", note)  # before any work: O(1)
            return prompt, await tokenizers.run(tokenizers.encode, prompt), "prompt"
        except InvalidRequest as exc:  # no tokenizer on the router, or surely too long
            raise BadRequest(str(exc), "prompt") from exc
    if keep is not None:
        prompt = prompt[-keep:]
    router.check_prompt(len(prompt), None)  # a long list is refused before its ids are checked
    router.check_token_ids(prompt, "prompt")
    return None, list(prompt), "prompt"
