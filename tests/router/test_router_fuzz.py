"""Hypothesis drives the router's real OpenAI HTTP front (tests/helpers/router_fakes.py: `serve_router` in front of fake
workers that refuse, as INTERNAL, anything a real worker would refuse) with generated bodies: plausible fields,
boundary values and junk, NaN / Infinity literals and lone surrogates (the bodies are serialized here, not by the
HTTP client), plus raw bytes. Properties: never a 5xx; every 4xx is OpenAI error JSON, and a 400 about a JSON
object names a field; a 200 is a complete response (a stream ends with [DONE] and carries no in-band error)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers.router_fakes import MODEL, VOCAB_SIZE, FakeWorkers, RouterHarness

# 2,300 requests in about 40 s on 2 cores. Not derandomized: each run explores new bodies, and a failure prints the
# falsifying example (and `@reproduce_failure`); no example database is written into the checkout.
FUZZ = settings(max_examples=1000, deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ---- values ------------------------------------------------------------------------------------------------
# A body is a valid base (the prompt or messages, nine times in ten), up to six more fields with valid values, then
# up to two fields with bad ones: boundary values, wrong types, NaN / Infinity, lone surrogates, junk.
text = st.text(max_size=12)
bad_text = st.text(st.characters() | st.characters(categories=["Cs"]), min_size=1, max_size=4)  # lone surrogates
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text | bad_text
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                    max_leaves=6)
token_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40)
bad_token_ids = st.lists(st.integers(0, VOCAB_SIZE - 1) | st.sampled_from([-1, VOCAB_SIZE, 2**32, 10**10]),
                         max_size=40)
bad_number = st.floats() | st.sampled_from([-3, 3, 0, 1e38, 1e39, 10**40, -1e39, 2**31, 2**32, 2**63, -(2**63) - 1])
bad_int = st.integers(-3, 140) | st.sampled_from([2**31, 2**32, 2**63, -(2**63) - 1, 10**30, 1.5, True])


def anything(extra: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return extra | junk


GOOD_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["", MODEL]), "max_tokens": st.integers(1, 64),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "min_p": st.floats(0, 1),
    "top_k": st.integers(-1, 100), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(-(2**63), 2**63 - 1), "min_tokens": st.integers(0, 1),
    "n": st.integers(1, 4), "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans()}),
    "stop": text | st.lists(text, max_size=3), "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "cache_salt": text, "user": text, "response_format": st.just({"type": "text"}),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB_SIZE - 1).map(str), st.floats(-100, 100), max_size=3),
}
BAD_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": anything(st.just("gpt-4")), "max_tokens": anything(bad_int | st.integers(1000, 1100)),
    **{name: anything(bad_number) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                               "frequency_penalty", "repetition_penalty")},
    **{name: anything(bad_int) for name in ("top_k", "seed", "min_tokens", "n", "best_of")},
    "stream_options": anything(st.fixed_dictionaries({"include_usage": junk})),
    "stop": anything(st.lists(bad_text | junk, max_size=3)), "stop_token_ids": anything(bad_token_ids),
    "cache_salt": anything(bad_text), "logit_bias": anything(st.dictionaries(
        st.integers(-1, VOCAB_SIZE + 1).map(str) | bad_text, bad_number | st.floats(-101, 101), max_size=3)),
    "response_format": anything(st.just({"type": "json_object"})), "metadata": junk,
    **{name: junk for name in ("stream", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "user")},
}
GOOD_COMPLETION = {
    **GOOD_SAMPLING, "prompt": st.text(min_size=1, max_size=30) | token_ids | st.lists(
        st.text(min_size=1, max_size=8) | token_ids, min_size=1, max_size=4),
    "logprobs": st.integers(0, 5), "echo": st.booleans(), "suffix": st.sampled_from(["", None]),
}
BAD_COMPLETION = {
    **BAD_SAMPLING, "prompt": anything(bad_text | bad_token_ids | st.lists(bad_text | bad_token_ids, max_size=4)),
    "logprobs": anything(bad_int), "echo": junk, "suffix": anything(text),
}
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
                                optional={"content": text | st.lists(st.fixed_dictionaries(
                                    {"type": st.just("text"), "text": text}), max_size=2), "name": text})
bad_message = message | junk | st.fixed_dictionaries(
    {"role": anything(st.sampled_from(["", "bot", "USER"]))}, optional={"content": anything(bad_text),
                                                                      "name": junk})
GOOD_CHAT = {
    **GOOD_SAMPLING, "messages": st.lists(message, min_size=1, max_size=4),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "max_completion_tokens": st.integers(1, 64),
    "add_generation_prompt": st.booleans(), "tools": st.just([]), "tool_choice": st.just("none"),
}
BAD_CHAT = {
    **BAD_SAMPLING, "messages": anything(st.lists(bad_message, max_size=4)), "logprobs": junk,
    "top_logprobs": anything(bad_int), "max_completion_tokens": anything(bad_int), "add_generation_prompt": junk,
    "tools": anything(st.just([{"type": "function"}])), "tool_choice": anything(st.just("auto")),
    "chat_template": anything(text),
}


def body_of(good: dict[str, st.SearchStrategy[Any]], bad: dict[str, st.SearchStrategy[Any]],
            required: str) -> st.SearchStrategy[dict[str, Any]]:
    head = st.integers(0, 9).flatmap(lambda k: st.just({}) if k == 9 else st.fixed_dictionaries(
        {required: good[required]}))
    goods = st.lists(st.sampled_from(sorted(good)), max_size=6, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: good[name] for name in names}))
    bads = st.lists(st.sampled_from(sorted(bad)), max_size=2, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: bad[name] for name in names}))
    return st.tuples(head, goods, bads).map(lambda parts: {**parts[0], **parts[1], **parts[2]})


# ---- the properties ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router() -> Iterator[RouterHarness]:
    workers = FakeWorkers()
    harness = RouterHarness(workers)
    yield harness
    harness.close()
    workers.close()


def _strict(value: Any) -> bool:
    """No NaN / Infinity anywhere (their JSON literals are refused before any field is read)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_strict(v) for v in value)
    if isinstance(value, dict):
        return all(_strict(v) for v in value.values())
    return True


def check(response: httpx.Response, body: Any) -> None:
    status = response.status_code
    assert status < 500, response.text
    event(f"HTTP {status}")  # pytest --hypothesis-show-statistics: how often each outcome was reached
    if status == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text, response.text
        else:
            assert response.json()["choices"], response.text
        return
    error = response.json()["error"]
    event(f"param {error['param']}")
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert isinstance(error["message"], str) and error["message"]
    if status == 400 and isinstance(body, dict) and _strict(body):
        assert isinstance(error["param"], str) and error["param"], (error, body)


def post(router: RouterHarness, path: str, body: Any) -> httpx.Response:
    # ensure_ascii: a lone surrogate goes out as "\ud800"; allow_nan: NaN / Infinity go out as literals.
    return router.post(path, content=json.dumps(body, ensure_ascii=True, allow_nan=True).encode())


@FUZZ
@given(body=body_of(GOOD_COMPLETION, BAD_COMPLETION, "prompt"))
def test_fuzz_completions(router: RouterHarness, body: dict[str, Any]) -> None:
    check(post(router, "/v1/completions", body), body)


@FUZZ
@given(body=body_of(GOOD_CHAT, BAD_CHAT, "messages"))
def test_fuzz_chat(router: RouterHarness, body: dict[str, Any]) -> None:
    check(post(router, "/v1/chat/completions", body), body)


@settings(FUZZ, max_examples=300)
@given(raw=st.binary(max_size=64) | junk.map(lambda v: json.dumps(v, allow_nan=True).encode()),
       chat=st.booleans())
def test_fuzz_raw_bodies(router: RouterHarness, raw: bytes, chat: bool) -> None:
    check(router.post("/v1/chat/completions" if chat else "/v1/completions", content=raw), None)
