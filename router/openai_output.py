"""OpenAI response shaping for /v1/completions and /v1/chat/completions: usage, logprobs (completion, chat and
vLLM's prompt_logprobs), stop reasons, ids and the response envelope, from the workers' proto messages."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from protos.kvflow.v1 import kvflow_pb2 as pb

Decode = Callable[[int], str]


def usage_json(usage: pb.Usage) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                           "total_tokens": usage.prompt_tokens + usage.completion_tokens}
    if usage.cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return out


def completion_logprobs(entries: list[pb.TokenLogprob], decode: Decode, offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        token = decode(entry.token_id)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        token_logprobs.append(entry.logprob)
        tops.append({(t.token or decode(t.token_id)): t.logprob for t in entry.top} or None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[pb.TokenLogprob], decode: Decode, top_n: int) -> dict[str, Any]:
    content = []
    for entry in entries:
        token = decode(entry.token_id)
        top = [{"token": (t.token or decode(t.token_id)), "logprob": t.logprob,
                "bytes": list((t.token or decode(t.token_id)).encode())} for t in entry.top][:top_n]
        content.append({"token": token, "logprob": entry.logprob, "bytes": list(token.encode()),
                        "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(entries: list[pb.TokenLogprob], decode: Decode) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}},
    the prompt's own token and the top alternatives."""
    out: list[dict[str, Any] | None] = []
    for i, entry in enumerate(entries):
        if i == 0 and not entry.top and not entry.logprob:
            out.append(None)
            continue
        position = {str(t.token_id): {"logprob": t.logprob, "rank": t.rank,
                                      "decoded_token": t.token or decode(t.token_id)} for t in entry.top}
        position.setdefault(str(entry.token_id), {"logprob": entry.logprob, "rank": entry.rank,
                                                  "decoded_token": decode(entry.token_id)})
        out.append(position)
    return out


def stop_reason(choice: pb.CompletionChoice | pb.GenerateChunk) -> str | int | None:
    kind = choice.WhichOneof("stop_reason")
    return getattr(choice, kind) if kind else None


def completion_id(request_id: str, chat: bool) -> str:
    """OpenAI's (and vLLM's) id of a completion or chat completion made for `request_id`."""
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}
