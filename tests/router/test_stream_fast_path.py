"""The streaming hot path's shortcuts keep the bytes: a token event formatted directly equals the one built from
dicts and json.dumps (completions and chat, any text), and a stream that fell behind sends its queued events
joined in one write, each whole and in order."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from protos.kvflow.v1 import kvflow_pb2 as pb
from router.chunk_stream import ChunkStream
from router.openai_api import _RelayedStream

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


class _Relay:
    def __init__(self, ready: list[bool]) -> None:
        self._ready = ready

    def ready(self) -> bool:
        return self._ready.pop(0)

    def close(self) -> None:
        pass


def test_queued_events_go_out_in_one_write() -> None:
    async def body():  # noqa: ANN202
        for i in range(5):
            yield f"data: {i}\n\n"

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    # after events 0..4: nothing queued, then three queued (1, 2, 3 join 4), nothing
    response = _RelayedStream(body(), _Relay([False, True, True, True, False]), media_type="text/event-stream")
    asyncio.run(response.stream_response(send))
    bodies = [m["body"] for m in sent[1:]]
    assert bodies == [b"data: 0\n\n", b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n", b""]
    assert sent[-1]["more_body"] is False


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
