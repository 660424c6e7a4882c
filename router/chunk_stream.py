"""The SSE body of a streaming /v1/completions or /v1/chat/completions response, in vLLM's chunk sequence:

1. (chat) a role chunk per choice, once the first worker response is in (not before prefill);
2. one chunk per worker step that carries tokens, text, logprobs or the end; the last one of a choice carries its
   finish_reason (and stop_reason); text a worker held back until its final message follows in a last chunk;
3. with stream_options.include_usage, a usage chunk (usage on every chunk too with continuous_usage_stats);
4. `data: [DONE]`.

Invariants: every choice finishes exactly once (a chunk's finish, else the final message's); an abort chunk is not
an end, because the router may still migrate the request. At the drain deadline every open choice ends with
finish_reason "abort". A failure after the status line went out is reported in-band as OpenAI error JSON. Silence
becomes SSE keep-alive comments. Chat requests whose output becomes tool calls stream tool-call deltas instead of
content (`router.tool_calls.ToolStream`). Events go out as soon as their worker response is in; those of responses
already queued behind it (a busy router) go out in the same write, so the events and their order never change.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from protos.kvflow.v1 import kvflow_pb2 as pb
from router.core import Router, error_from
from router.errors import ShuttingDown
from router.http import SSE_KEEPALIVE
from router.lifecycle import Idle
from router.openai_output import (
    chat_logprobs,
    completion_id,
    completion_logprobs,
    envelope,
    stop_reason,
    usage_json,
)
from router.openai_protocol import (
    FINISH,
)
from router.prepared import PreparedRequest
from router.tool_calls import ToolStream

DONE = "data: [DONE]\n\n"
MAX_EVENTS_PER_WRITE = 64  # a stream that fell behind sends at most this many queued events in one write


class ChunkStream:
    """The events of one streaming response; `events` consumes the request's (prompt index, worker response)
    items, with `Idle` for silence."""

    def __init__(self, router: Router, prepared: PreparedRequest, chat: bool) -> None:
        self._parsed = prepared.parsed
        self._n = prepared.parsed.n  # choices per prompt: choice index = prompt index * n + sample index
        self._chat = chat
        tokenizers = router.tokenizers
        self._decode = tokenizers.decode_token if tokenizers is not None else str
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._base = envelope(kind, completion_id(prepared.request_id, chat), prepared.model, prepared.created)
        self._head = f'data: {json.dumps(self._base)[:-1]}, "choices": '  # every chunk's start, up to its choices
        self._num_choices = len(prepared.prompts) * self._n
        # per choice, the text streamed so far, in pieces: appending to one string per token copies it each time
        # (quadratic in a long output); joined only at the end, where the whole text is needed
        self._sent_parts: dict[int, list[str]] = {}
        self._num_tokens: dict[int, int] = {}  # per choice, tokens streamed so far (continuous usage)
        self._finished: set[int] = set()
        self._usage_of: dict[int, pb.Usage] = {}  # per prompt, the latest its worker reported (an aborted one's too)
        self._tool_streams: dict[int, ToolStream] = {}  # per choice, when the request's output becomes tool calls
        self._started = False

    async def events(self, responses: AsyncIterator[tuple[int, pb.GenerateResponse] | Idle],
                     ready: Callable[[], bool] | None = None) -> AsyncIterator[str]:
        """The body, a string per write. `ready` (the relay's) says whether the next response is already in: the
        events of responses already in go out together (a stream that fell behind catches up in fewer, larger
        writes), each event whole and in order; no event waits for a response still to come."""
        pending: list[str] = []
        try:
            async for item in responses:
                if isinstance(item, Idle):
                    pending.append(SSE_KEEPALIVE)
                else:
                    pending.extend(self._on_response(*item))
                if pending and (ready is None or not ready() or len(pending) >= MAX_EVENTS_PER_WRITE):
                    yield "".join(pending)
                    pending.clear()
            if self._parsed.include_usage:
                pending.append(self._usage_event())
        except ShuttingDown:  # the drain deadline: every open choice ends as aborted, as an aborted request does
            for index in range(self._num_choices):
                if index not in self._finished:
                    pending.append(self._choice_event(index, "", [], "abort"))
            if self._parsed.include_usage:
                pending.append(self._usage_event())
        except Exception as exc:  # the status line is already sent: report in-band, as vLLM does
            pending.append(self._event_line(error_from(exc).to_openai()))
        pending.append(DONE)
        yield "".join(pending)

    # ---- one worker response ---------------------------------------------------------------------------------
    def _on_response(self, i: int, response: pb.GenerateResponse) -> Iterator[str]:
        kind = response.WhichOneof("response")
        if kind == "chunk" and response.chunk.HasField("usage"):
            self._usage_of[i] = response.chunk.usage
        elif kind == "complete":
            self._usage_of[i] = response.complete.usage
        if self._chat and not self._started:  # as vLLM: once the first output is in, not before prefill
            self._started = True
            yield from self._role_events()
        if kind == "chunk":
            yield from self._on_chunk(i * self._n + response.chunk.index, response.chunk)
        elif kind == "complete":
            for choice in response.complete.choices:
                yield from self._on_final(i * self._n + choice.index, choice)

    def _on_chunk(self, index: int, chunk: pb.GenerateChunk) -> Iterator[str]:
        # The last token's chunk carries the end; an abort may still become a migration, so the complete message
        # reports that one.
        finish = FINISH.get(chunk.finish_reason) if chunk.finish_reason != pb.FINISH_REASON_ABORT else None
        tools = self._tool_stream(index)
        if tools is not None:  # the text becomes tool-call deltas (or content, for `auto` without a call)
            self._record(index, chunk)
            tool_delta = tools.feed(chunk.text)
            if tool_delta is not None or chunk.logprobs:
                yield self._choice_event(index, "", list(chunk.logprobs), tool_delta=tool_delta or {})
            if finish is not None:
                self._finished.add(index)
                tool_delta, finish = tools.finish(self._sent_text(index), finish)
                yield self._choice_event(index, "", [], finish, stop_reason(chunk), tool_delta=tool_delta)
        elif chunk.text or chunk.logprobs or chunk.token_ids or finish:  # as vLLM: one event per step
            self._record(index, chunk)  # text may be "" (no tokenizer)
            if finish is None and not chunk.logprobs and not self._parsed.continuous_usage:
                yield self._token_event(index, chunk.text)
                return
            if finish is not None:
                self._finished.add(index)
            yield self._choice_event(index, chunk.text, list(chunk.logprobs), finish,
                                     stop_reason(chunk) if finish else None)

    def _on_final(self, index: int, choice: pb.CompletionChoice) -> Iterator[str]:
        """A choice's final message: it ends the choice unless a chunk already did, with the text not yet sent."""
        if index in self._finished:
            return
        already = self._sent_text(index)
        rest = choice.text[len(already):] if choice.text.startswith(already) else ""
        self._finished.add(index)
        tools = self._tool_stream(index)
        if tools is not None:
            tool_delta, finish = tools.finish(choice.text, FINISH.get(choice.finish_reason))
            yield self._choice_event(index, "", [], finish, stop_reason(choice), tool_delta=tool_delta)
            return
        yield self._choice_event(index, rest, [], FINISH.get(choice.finish_reason), stop_reason(choice))

    def _record(self, index: int, chunk: pb.GenerateChunk) -> None:
        if chunk.text:
            self._sent_parts.setdefault(index, []).append(chunk.text)
        self._num_tokens[index] = self._num_tokens.get(index, 0) + len(chunk.token_ids)

    def _sent_text(self, index: int) -> str:
        parts = self._sent_parts.get(index)
        if parts is None:
            return ""
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0]

    def _tool_stream(self, index: int) -> ToolStream | None:
        """The choice's tool-call parser, when this chat request's output becomes tool calls."""
        tools = self._parsed.tools
        if not (self._chat and tools is not None and tools.parses):
            return None
        return self._tool_streams.setdefault(index, ToolStream(tools))

    # ---- events ----------------------------------------------------------------------------------------------
    def _event_line(self, payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        """`_event_line({**base, "choices": choices, "usage": usage (when given)})`, with the envelope encoded once
        per stream (the same bytes: json.dumps of a dict is its items' encodings in order)."""
        extra = "" if usage is None else f', "usage": {json.dumps(usage)}'
        return f"{self._head}{json.dumps(choices)}{extra}}}\n\n"

    def _token_event(self, index: int, text: str) -> str:
        """`_choice_event(index, text, [])` of a token that neither ends the choice nor carries logprobs or
        continuous usage: the common event, formatted without building its dicts (the same bytes)."""
        if self._chat:
            return f'{self._head}[{{"index": {index}, "delta": {{"content": {json.dumps(text)}}}, "logprobs": null, ' \
                   f'"finish_reason": null}}]}}\n\n'
        return f'{self._head}[{{"index": {index}, "text": {json.dumps(text)}, "logprobs": null, ' \
               f'"finish_reason": null, "stop_reason": null}}]}}\n\n'

    def _role_events(self) -> Iterator[str]:
        for index in range(self._num_choices):
            role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}
            yield self._event([role], self._choice_usage(index))

    def _choice_event(self, index: int, text: str, logprobs: list[pb.TokenLogprob], finish: str | None = None,
                      stop: str | int | None = None, tool_delta: dict[str, Any] | None = None) -> str:
        return self._event([self._choice(index, text, logprobs, finish, stop, tool_delta)], self._choice_usage(index))

    def _choice(self, index: int, text: str, logprobs: list[pb.TokenLogprob], finish: str | None,
                stop: str | int | None, tool_delta: dict[str, Any] | None) -> dict[str, Any]:
        lp = None
        if self._parsed.logprobs is not None and logprobs:
            lp = chat_logprobs(logprobs, self._decode, self._parsed.logprobs) if self._chat else \
                completion_logprobs(logprobs, self._decode)
        if not self._chat:
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop}
        delta: dict[str, Any] = {"content": text} if text or not finish else {}
        out: dict[str, Any] = {"index": index, "delta": tool_delta if tool_delta is not None else delta,
                               "logprobs": lp, "finish_reason": finish}
        if finish is not None:  # vLLM leaves stop_reason out of chat chunks until the last one
            out["stop_reason"] = stop
        return out

    def _choice_usage(self, index: int) -> dict[str, Any] | None:
        """continuous_usage_stats: this choice's prompt and its completion tokens so far."""
        if not self._parsed.continuous_usage:
            return None
        prompt = self._usage_of.get(index // self._n)
        return usage_json(pb.Usage(prompt_tokens=prompt.prompt_tokens if prompt else 0,
                                   completion_tokens=self._num_tokens.get(index, 0)))

    def _usage_event(self) -> str:
        usage = pb.Usage()
        for part in self._usage_of.values():
            usage.prompt_tokens += part.prompt_tokens
            usage.completion_tokens += part.completion_tokens
            usage.cached_tokens += part.cached_tokens
        return self._event([], usage_json(usage))
