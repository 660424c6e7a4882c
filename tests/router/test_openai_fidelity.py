"""Streams and endpoints as vLLM's, against the session's real `kvflow serve` (SmolLM2, 1P+1D): the chunk sequence
(role chunk with the first token, finish_reason on the last token's chunk, the usage chunk apart), continuous usage,
stop-token text removal, prompt_logprobs, continue_final_message, /tokenize /detokenize /version, /v1/responses
(SDK and raw events), and 400s naming best_of / suffix."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.serve import API_KEY, Server

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _extra(server: Server, path: str, body: Any, timeout: float = 30) -> httpx.Response:
    """vLLM's /tokenize and /detokenize: behind the API key, as every endpoint that costs work."""
    return httpx.post(f"{server.url}{path}", json=body, headers=HEADERS, timeout=timeout)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def sse(server: Server, path: str, body: dict[str, Any]) -> tuple[float, list[tuple[float, str | None, Any]]]:
    """(request sent at, [(arrival, event name, data)]) of a raw SSE stream; data "[DONE]" stays a string."""
    events: list[tuple[float, str | None, Any]] = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=HEADERS, timeout=120) as response:
        assert response.status_code == 200, response.read()
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                raw = line.removeprefix("data: ")
                events.append((time.perf_counter(), name, raw if raw == "[DONE]" else json.loads(raw)))
                name = None
    return start, events


def test_chat_stream_sends_role_with_first_token_and_finish_on_last_token(server: Server) -> None:
    # A long prompt, so prefill takes a while: the role chunk must wait for it, as vLLM's does.
    messages = [{"role": "user", "content": "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 60}]
    start, events = sse(server, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert events[-1][2] == "[DONE]"
    chunks = [(at, data) for at, _, data in events[:-1]]
    (role_at, role), (first_at, first) = chunks[0], chunks[1]
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]
    assert first["choices"][0]["delta"].get("content") and "role" not in first["choices"][0]["delta"]
    # sent together, once the first token exists: not right after the request
    assert first_at - role_at < 0.25 * (role_at - start), (role_at - start, first_at - role_at)
    tokens = [data for _, data in chunks if data["choices"]]
    assert len(tokens) == 1 + 8  # the role chunk, then one chunk per token: no finish-only chunk
    assert all(c["choices"][0]["finish_reason"] is None and "stop_reason" not in c["choices"][0] for c in tokens[:-1])
    last = tokens[-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["delta"]["content"] and last["stop_reason"] is None
    usage = chunks[-1][1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert all("usage" not in data for _, data in chunks[:-1])


def test_completion_stream_chunk_structure_and_continuous_usage(server: Server) -> None:
    _, events = sse(server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [data for _, _, data in events[:-1]]
    tokens = [c for c in chunks if c["choices"]]
    assert len(tokens) == 6
    for n, chunk in enumerate(tokens, start=1):
        choice = chunk["choices"][0]
        assert set(choice) >= {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        assert choice["finish_reason"] == ("length" if n == 6 else None)
        assert chunk["usage"]["completion_tokens"] == n and chunk["usage"]["prompt_tokens"] > 0
        assert chunk["usage"]["total_tokens"] == chunk["usage"]["prompt_tokens"] + n
    assert tokens[-1]["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_continuous_usage_on_chat_and_only_with_include_usage(server: Server) -> None:
    _, events = sse(server, "/v1/chat/completions", {
        "messages": QUESTION, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [data for _, _, data in events[:-1]]
    assert chunks[0]["usage"]["completion_tokens"] == 0  # the role chunk
    assert [c["usage"]["completion_tokens"] for c in chunks[1:-1]] == [1, 2, 3, 4]
    _, events = sse(server, "/v1/chat/completions", {
        "messages": QUESTION, "max_tokens": 2, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in data for _, _, data in events[:-1])


def test_stop_token_ids_text_is_removed_unless_asked(client: openai.OpenAI, server: Server) -> None:
    full = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
    ids = _extra(server, "/tokenize", {"prompt": full.choices[0].text, "add_special_tokens": False}).json()[
        "tokens"]
    stop = ids[2]
    assert stop not in ids[:2]
    expected = _extra(server, "/detokenize", {"tokens": ids[:2]}).json()["prompt"]
    with_stop = _extra(server, "/detokenize", {"tokens": ids[:3]}).json()["prompt"]
    for stream in (False, True):
        result = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0,
                                           stream=stream, extra_body={"stop_token_ids": [stop]})
        choices = [c.choices[0] for c in result if c.choices] if stream else result.choices
        assert "".join(c.text for c in choices) == expected
        assert choices[-1].finish_reason == "stop" and choices[-1].stop_reason == stop  # type: ignore[attr-defined]
    kept = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": True})
    assert kept.choices[0].text == with_stop


def test_prompt_logprobs_in_vllm_shape(server: Server, client: openai.OpenAI) -> None:
    count = _extra(server, "/tokenize", {"prompt": PROMPT}).json()["count"]
    result = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    entries = result.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    assert len(entries) == count and entries[0] is None
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 3  # the prompt's token and the top 2
        for token_id, logprob in entry.items():
            assert int(token_id) >= 0 and logprob["logprob"] <= 0 and logprob["rank"] >= 1
            assert isinstance(logprob["decoded_token"], str)
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=HEADERS, timeout=60, json={
        "messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # 0 alternatives: just the prompt's token
    refused = httpx.post(f"{server.url}/v1/completions", headers=HEADERS, timeout=30, json={
        "prompt": PROMPT, "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_continue_final_message(server: Server, client: openai.OpenAI) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tokenized = _extra(server, "/tokenize", body).json()
    prompt = _extra(server, "/detokenize", {"tokens": tokenized["tokens"]}).json()["prompt"]
    assert prompt.endswith("The capital of France is")  # left open: no end-of-turn after it
    result = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0,
                                            extra_body={"add_generation_prompt": False,
                                                        "continue_final_message": True})
    assert result.choices[0].message.content.strip().startswith("Paris")
    assert result.usage.prompt_tokens == tokenized["count"]
    both = httpx.post(f"{server.url}/v1/chat/completions", headers=HEADERS, timeout=30,
                      json={"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_tokenize_detokenize_version(server: Server, client: openai.OpenAI) -> None:
    out = _extra(server, "/tokenize", {"model": "smollm2", "prompt": PROMPT}).json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 1024 and out["token_strs"] is None
    assert _extra(server, "/detokenize", {"tokens": out["tokens"]}).json() == {
        "prompt": PROMPT}
    chat = _extra(server, "/tokenize", {"messages": QUESTION}).json()
    usage = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    strs = _extra(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert len(strs.json()["token_strs"]) == out["count"]
    version = httpx.get(f"{server.url}/version", timeout=10).json()
    assert set(version) == {"version"} and version["version"]
    bad = _extra(server, "/detokenize", {"tokens": ["a"]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = _extra(server, "/tokenize", {"promt": "x"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_responses_api_non_streaming_and_streaming(server: Server, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16, temperature=0)
    response = client.responses.create(model="smollm2", input="What is the capital of France?",
                                       max_output_tokens=16, temperature=0)
    assert response.status in ("completed", "incomplete") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content and "Paris" in response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    as_messages = client.responses.create(model="smollm2", max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}])
    assert as_messages.output_text == response.output_text
    kinds, deltas, done_text, usage = [], [], None, None
    for event in client.responses.create(model="smollm2", input="What is the capital of France?",
                                         max_output_tokens=16, temperature=0, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.output_text.done":
            done_text = event.text
        elif event.type == "response.completed":
            usage = event.response.usage
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(deltas) == done_text == response.output_text
    assert usage.output_tokens == response.usage.output_tokens
    _, events = sse(server, "/v1/responses", {"input": "Hi", "max_output_tokens": 3, "stream": True})
    assert [data["sequence_number"] for _, _, data in events] == list(range(len(events)))
    assert all(name == data["type"] for _, name, data in events)
    incomplete = client.responses.create(model="smollm2", input="Count to fifty.", max_output_tokens=3)
    assert incomplete.status == "incomplete" and incomplete.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0]"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 1, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "and so on"}, "suffix"),
])
def test_unsupported_fields_get_400_naming_them(server: Server, path: str, body: dict[str, Any],
                                                param: str) -> None:
    response = httpx.post(f"{server.url}{path}", headers=HEADERS, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
