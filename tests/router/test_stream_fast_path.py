"""The streaming hot path's shortcuts keep the bytes: a token event formatted directly equals the one built from
dicts and json.dumps (completions and chat, any text), a choice's final message sends only what was not streamed,
and a stream that fell behind sends its queued events joined in one write, each whole and in order."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from protos.kvflow.v1 import kvflow_pb2 as pb
from router.chunk_stream import ChunkStream

TEXTS = ["", " tok", "Paris", 'quote " and \\ backslash', "new\nline\ttab", "caf\u00e9 \u6771\u4eac \U0001f600", "\x00\x1f"]


def _stream(chat: bool, continuous_usage: bool = False) -> ChunkStream:
    parsed = SimpleNamespace(n=1, include_usage=True, continuous_usage=continuous_usage, logprobs=None, tools=None)
    prepared = SimpleNamespace(parsed=parsed, request_id="abc123", model="the-model", created=1700000000,
                               prompts=[SimpleNamespace()])
    return ChunkStream(SimpleNamespace(tokenizers=None), prepared, chat)  # type: ignore[arg-type]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_token_event_is_the_generic_event(chat: bool, text: str) -> None:
    stream = _stream(chat)
    assert stream._token_event(0, text) == stream._choice_event(0, text, [])
    payload = json.loads(stream._token_event(3, text).removeprefix("data: "))
    assert payload["id"].endswith("abc123") and payload["choices"][0]["index"] == 3


@pytest.mark.parametrize("chat", [False, True])
def test_chunks_take_the_fast_path_only_when_it_applies(chat: bool) -> None:
    stream = _stream(chat)
    token = pb.GenerateResponse(chunk=pb.GenerateChunk(index=0, token_ids=[5], text=" a"))
    last = pb.GenerateResponse(chunk=pb.GenerateChunk(index=0, token_ids=[6], text=" b",
                                                      finish_reason=pb.FINISH_REASON_LENGTH))
    lines = [*stream._on_response(0, token), *stream._on_response(0, last)]
    reference = _stream(chat)
    expected = [reference._choice_event(0, " a", []), reference._choice_event(0, " b", [], "length", None)]
    if chat:
        expected.insert(0, next(reference._role_events()))
    assert lines == expected
    usage = _stream(chat, continuous_usage=True)  # per-chunk usage: the generic path
    assert '"usage"' in list(usage._on_response(0, token))[-1]


def test_the_final_message_sends_only_the_text_not_streamed_yet() -> None:
    """A choice that ends in the complete message (an abort that did not migrate, a detokenizer's held-back tail)
    gets exactly the rest of its text, however many chunks came before."""
    stream = _stream(chat=False)
    pieces = [f" t{i}" for i in range(500)]
    for i, text in enumerate(pieces):
        list(stream._on_response(0, pb.GenerateResponse(chunk=pb.GenerateChunk(index=0, token_ids=[i], text=text))))
    whole = "".join(pieces) + " tail"
    complete = pb.GenerateResponse(complete=pb.GenerateComplete(choices=[pb.CompletionChoice(
        index=0, text=whole, finish_reason=pb.FINISH_REASON_STOP)]))
    (event,) = list(stream._on_response(0, complete))
    assert event == _stream(chat=False)._choice_event(0, " tail", [], "stop", None)
    assert stream._sent_text(0) == "".join(pieces)


def test_queued_responses_go_out_in_one_write_and_no_event_waits() -> None:
    token = pb.GenerateResponse(chunk=pb.GenerateChunk(index=0, token_ids=[5], text=" a"))
    empty = pb.GenerateResponse(chunk=pb.GenerateChunk(index=0))  # carries nothing: no event
    last = pb.GenerateResponse(chunk=pb.GenerateChunk(index=0, token_ids=[6], text=" b",
                                                      finish_reason=pb.FINISH_REASON_LENGTH))
    items = [token, token, empty, token, last]
    queued = [False, True, True, False, True]  # after each item: is the next one already in?

    async def responses():  # noqa: ANN202
        for item in items:
            yield 0, item

    async def main() -> list[str]:
        stream = _stream(chat=False)
        ready = iter(queued)
        return [write async for write in stream.events(responses(), lambda: next(ready))]

    writes = asyncio.run(main())
    reference = _stream(chat=False)
    a, b = reference._choice_event(0, " a", []), reference._choice_event(0, " b", [], "length", None)
    # the empty chunk is queued behind a token, yet nothing waits on it: its neighbour goes out when nothing is in
    assert writes == [a, a + a, b + reference._usage_event() + "data: [DONE]\n\n"]


def test_relay_idles_after_its_timeout_and_not_while_items_flow() -> None:
    from router.lifecycle import IDLE, Relay

    async def source(gaps: list[float]):  # noqa: ANN202
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            yield i

    async def drain(relay: Relay, timeout_s: float) -> list[Any]:
        out = []
        while True:
            try:
                out.append(await relay.next(timeout_s))
            except StopAsyncIteration:
                return out

    async def main() -> None:
        flowing = Relay(source([0.01] * 20), lambda _: None)
        assert await drain(flowing, 0.2) == list(range(20))
        loop = asyncio.get_running_loop()
        start = loop.time()
        silent = Relay(source([0.0, 0.35, 0.0]), lambda _: None)
        got = await drain(silent, 0.1)
        assert got[0] == 0 and got[-2:] == [1, 2] and set(got[1:-2]) == {IDLE} and 2 <= len(got[1:-2]) <= 4, got
        assert loop.time() - start >= 0.35
        for relay in (flowing, silent):
            relay.close()

    asyncio.run(main())
