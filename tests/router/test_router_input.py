"""The router's input hardening and request bounds (issue #15, sections 2 and 5), against a real router in front of
fake workers (tests/helpers/router_fakes.py): every refusal is a 4xx with OpenAI error JSON naming the field, never a 5xx,
and never an error inside a 200 stream."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from cluster.wire import sampling_kwargs_from_proto, sampling_params_from_proto, sampling_params_to_proto
from engine.sampling_params import SamplingParams
from engine.structured.grammar import StructuredOutputsParams
from kvflow.client import Client
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from tests.helpers.router_fakes import REFUSED_PROMPT, VOCAB_SIZE, FakeWorkers, RouterHarness

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def tight(workers: FakeWorkers) -> Iterator[RouterHarness]:
    """Small limits, and request chat templates trusted."""
    harness = RouterHarness(workers, max_n=4, max_logprobs=2, max_prompts_per_request=3,
                            max_request_body_bytes=4096, request_body_timeout_s=0.5, request_header_timeout_s=1.0,
                            trust_request_chat_template=True, chat_template_timeout_s=1.0)
    yield harness
    harness.close()


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error of a response that must have `status`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    return error


def refused(response: httpx.Response, param: str | None, status: int = 400) -> str:
    error = error_of(response, status)
    assert error["param"] == param, error
    return error["message"]


# ---- the body ----------------------------------------------------------------------------------------------
def test_deeply_nested_bodies_are_400(router: RouterHarness) -> None:
    deep = b'{"prompt": "hi", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "nested" in refused(router.post(COMPLETIONS, content=deep), None)  # past the parser's recursion
    nested: Any = "x"
    for _ in range(40):
        nested = [nested]
    assert "nested" in refused(router.post(COMPLETIONS, {"prompt": "hi", "metadata": nested}), "metadata")


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_standard_json_literals_are_400(router: RouterHarness, literal: bytes) -> None:
    for field in (b"temperature", b"repetition_penalty", b"top_p"):
        body = b'{"prompt": "hi", "' + field + b'": ' + literal + b"}"
        assert "not valid JSON" in refused(router.post(COMPLETIONS, content=body), None)


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, b'{"prompt": "a\\ud800b"}', "prompt"),
    (COMPLETIONS, b'{"prompt": ["ok", "\\udfff"]}', "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    (COMPLETIONS, b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
    (COMPLETIONS, b'{"prompt": "hi", "\\ud800": 1}', "\ud800"),
])
def test_lone_surrogates_are_400(router: RouterHarness, path: str, body: bytes, param: str) -> None:
    assert "surrogate" in refused(router.post(path, content=body), param)
    ok = router.post(COMPLETIONS, content=b'{"prompt": "\\ud83d\\ude00 emoji", "max_tokens": 2}')  # a valid pair
    assert ok.status_code == 200, ok.text


def test_bodies_that_are_not_objects_are_400(router: RouterHarness) -> None:
    for body in (b"{not json", b"[]", b'"prompt"', b"\xff\xfe", b"1" * 5000):
        refused(router.post(COMPLETIONS, content=body), None)


def test_body_size_limit_is_413(tight: RouterHarness) -> None:
    big = {"prompt": "x" * 5000}
    assert "--max-request-body-bytes" in refused(tight.post(COMPLETIONS, big), None, 413)

    def chunks() -> Iterator[bytes]:  # no content-length: counted while it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    refused(tight.http.post(COMPLETIONS, content=chunks()), None, 413)
    assert tight.post(COMPLETIONS, {"prompt": "x" * 1000, "max_tokens": 2}).status_code == 200


def test_slow_body_is_408(tight: RouterHarness) -> None:
    with socket.create_connection(("127.0.0.1", tight.config.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"prompt": "slo')
        start = time.monotonic()
        response = b""
        while b"}}" not in response:
            data = sock.recv(65536)
            if not data:
                break
            response += data
    assert time.monotonic() - start < 5
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), response
    error = json.loads(body)["error"]
    assert error["code"] == 408 and "--request-body-timeout" in error["message"]


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """What the server sent until it closed the connection, and when it closed (seconds from now)."""
    start, response = time.monotonic(), b""
    sock.settimeout(limit_s)
    while data := sock.recv(65536):
        response += data
    return response, time.monotonic() - start


def test_slowloris_headers_are_408_and_closed(tight: RouterHarness) -> None:
    """A client sending one header line at a time, each well within any idle timeout, is cut once the head took
    --request-header-timeout (1 s here; the issue's client was held past 300 s)."""
    with socket.create_connection(("127.0.0.1", tight.config.port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        with contextlib.suppress(OSError):  # the server may close while lines are still being sent
            for index in range(40):
                time.sleep(0.1)
                sock.sendall(b"X-Slow-%d: 1\r\n" % index)
        response, _ = _read_until_closed(sock, 5)
    assert time.monotonic() - start < 3
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), response
    error = json.loads(body)["error"]
    assert error["code"] == 408 and "--request-header-timeout" in error["message"]


def test_silent_connections_are_closed(tight: RouterHarness) -> None:
    with socket.create_connection(("127.0.0.1", tight.config.port), timeout=10) as sock:
        response, waited = _read_until_closed(sock, 5)
    assert response == b"" and waited < 3


def test_header_timeout_spares_prompt_clients(tight: RouterHarness) -> None:
    """Headers sent in pieces within the timeout, then a second request on the same kept-alive connection after a
    pause longer than nothing but under uvicorn's keep-alive: both answered."""
    body = b'{"prompt": "hi", "max_tokens": 2}'
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with httpx.Client(base_url=tight.url, timeout=10) as client:
        assert client.post(COMPLETIONS, content=body).status_code == 200
        time.sleep(1.5)  # idle past the header timeout between requests: uvicorn's keep-alive decides that gap
        assert client.post(COMPLETIONS, content=body).status_code == 200
    with socket.create_connection(("127.0.0.1", tight.config.port), timeout=10) as sock:
        for piece in (request[:20], request[20:60], request[60:]):
            sock.sendall(piece)
            time.sleep(0.2)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def test_framework_errors_are_openai_json(router: RouterHarness) -> None:
    assert error_of(router.http.get("/v1/nothing"), 404)["type"] == "NotFoundError"
    assert error_of(router.http.get(COMPLETIONS), 405)["type"] == "MethodNotAllowedError"
    assert error_of(router.http.delete(CHAT), 405)["param"] is None


# ---- fields ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids", [[-1] + [1] * 20, [10**10] + [1] * 20, [1] * 15 + [-1], [VOCAB_SIZE] * 17,
                                 [-1, 1], [2**32]])
def test_token_ids_outside_the_vocabulary_are_400(router: RouterHarness, ids: list[int]) -> None:
    assert str(VOCAB_SIZE) in refused(router.post(COMPLETIONS, {"prompt": ids}), "prompt")
    refused(router.post(COMPLETIONS, {"prompt": [[1, 2], ids]}), "prompt")
    refused(router.post(COMPLETIONS, {"prompt": ids, "stream": True}), "prompt")
    assert router.post(COMPLETIONS, {"prompt": [VOCAB_SIZE - 1] * 17, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(("field", "literal"), [
    ("temperature", "1e39"), ("temperature", "1e999"), ("temperature", "-1e39"), ("temperature", "1" + "0" * 400),
    ("repetition_penalty", "1e39"), ("top_p", "1e39"), ("presence_penalty", "-1e300"),
])
def test_sampling_floats_must_be_finite_float32(router: RouterHarness, field: str, literal: str) -> None:
    body = f'{{"prompt": "hi", "{field}": {literal}}}'  # JSON's 1e999 parses to inf
    refused(router.post(COMPLETIONS, content=body.encode()), field)


@pytest.mark.parametrize("role", ["bogus", "", None, 3, "USER", "function"])
def test_unknown_or_empty_chat_roles_are_400(router: RouterHarness, role: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    refused(router.post(CHAT, {"messages": messages}), "messages[1].role")


def test_every_allowed_chat_role_is_accepted(router: RouterHarness) -> None:
    for role in ("system", "user", "assistant", "tool", "developer"):
        messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
        response = router.post(CHAT, {"messages": messages, "max_tokens": 2})
        assert response.status_code == 200, (role, response.text)


def test_stream_options(router: RouterHarness) -> None:
    for value in ("yes", 1, [], {}):
        body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": value}}
        refused(router.post(COMPLETIONS, body), "stream_options.include_usage")
    refused(router.post(COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": True}}), "stream_options")
    refused(router.post(COMPLETIONS, {"prompt": "hi", "stream": True, "stream_options": "x"}), "stream_options")
    ok = router.post(COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "stream": True,
                                   "stream_options": {"include_usage": True}})
    assert ok.status_code == 200 and '"usage"' in ok.text


@pytest.mark.parametrize(("path", "extra", "param"), [
    (COMPLETIONS, {"best_of": 3}, "best_of"),
    (COMPLETIONS, {"best_of": 2, "n": 3}, "best_of"),
    (COMPLETIONS, {"suffix": "tail"}, "suffix"),
    (COMPLETIONS, {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_unimplemented_fields_are_refused_not_ignored(router: RouterHarness, path: str, extra: dict[str, Any],
                                                       param: str) -> None:
    body = {"prompt": "hi"} if path == COMPLETIONS else {"messages": USER}
    assert "not supported yet" in refused(router.post(path, {**body, **extra}), param)


@pytest.mark.parametrize(("path", "extra"), [
    (COMPLETIONS, {"best_of": 2, "n": 2}), (COMPLETIONS, {"suffix": None}), (COMPLETIONS, {"suffix": ""}),
    (CHAT, {"tools": []}), (CHAT, {"tools": None, "tool_choice": "none"}),
    (CHAT, {"response_format": {"type": "text"}}),
])
def test_their_neutral_values_are_accepted(router: RouterHarness, path: str, extra: dict[str, Any]) -> None:
    body = {"prompt": "hi"} if path == COMPLETIONS else {"messages": USER}
    response = router.post(path, {**body, "max_tokens": 2, **extra})
    assert response.status_code == 200, response.text


def test_logit_bias_is_forwarded(router: RouterHarness, workers: FakeWorkers) -> None:
    response = router.post(COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "logit_bias": {"42": 100, "7": -3.5}})
    assert response.status_code == 200, response.text
    assert dict(workers.decode.requests[-1].sampling_params.logit_bias) == {42: 100.0, 7: -3.5}
    response = router.post(CHAT, {"messages": USER, "max_tokens": 2, "logit_bias": {}})
    assert response.status_code == 200 and not workers.decode.requests[-1].sampling_params.logit_bias


@pytest.mark.parametrize("bias", [{"abc": 1}, {"-1": 1}, {"1.5": 1}, {"²": 1}, {"1": 100.5}, {"1": "x"},
                                  {"1": True}, {str(VOCAB_SIZE): 1}, {"9" * 40: 1}, [1], "x",
                                  {str(i): 1 for i in range(1025)}])
def test_bad_logit_bias_is_400(router: RouterHarness, bias: Any) -> None:
    refused(router.post(COMPLETIONS, {"prompt": "hi", "logit_bias": bias}), "logit_bias")


# Each of these named no field before (param: null); the value after the body is the field it must name.
@pytest.mark.parametrize(("path", "extra", "param"), [
    (COMPLETIONS, {"top_p": 1.5}, "top_p"), (COMPLETIONS, {"top_p": 0}, "top_p"),
    (COMPLETIONS, {"temperature": -1}, "temperature"), (COMPLETIONS, {"top_k": -2}, "top_k"),
    (COMPLETIONS, {"top_k": 2**31}, "top_k"), (COMPLETIONS, {"min_p": 2}, "min_p"),
    (COMPLETIONS, {"presence_penalty": 3}, "presence_penalty"),
    (COMPLETIONS, {"frequency_penalty": -3}, "frequency_penalty"),
    (COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens"), (COMPLETIONS, {"max_tokens": 2**32}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 2000}, "max_tokens"), (COMPLETIONS, {"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    (COMPLETIONS, {"min_tokens": -1}, "min_tokens"), (COMPLETIONS, {"min_tokens": 2**32}, "min_tokens"),
    (COMPLETIONS, {"n": 0}, "n"), (COMPLETIONS, {"n": True}, "n"), (COMPLETIONS, {"seed": 2**63}, "seed"),
    (COMPLETIONS, {"seed": -(2**63) - 1}, "seed"), (COMPLETIONS, {"logprobs": -1}, "logprobs"),
    (COMPLETIONS, {"stop": [""], "stop_token_ids": [-1]}, "stop_token_ids"),
    (COMPLETIONS, {"stop_token_ids": [2**32]}, "stop_token_ids"), (COMPLETIONS, {"stop": 3}, "stop"),
    (COMPLETIONS, {"cache_salt": 3}, "cache_salt"), (COMPLETIONS, {"echo": "yes"}, "echo"),
    (COMPLETIONS, {"model": 3}, "model"), (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"), (COMPLETIONS, {"prompt": "hi " * 1100}, "prompt"),
    (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"max_completion_tokens": 2000}, "max_completion_tokens"),
    (CHAT, {"min_tokens": 1020}, "min_tokens"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"), (CHAT, {"logprobs": 1}, "logprobs"),
    (CHAT, {"messages": []}, "messages"), (CHAT, {"messages": ["hi"]}, "messages[0]"),
    (CHAT, {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
    (CHAT, {"add_generation_prompt": "yes"}, "add_generation_prompt"),
    (CHAT, {"model": "gpt-4"}, "model"),
])
def test_every_field_error_names_its_field(router: RouterHarness, path: str, extra: dict[str, Any],
                                           param: str) -> None:
    body = {"prompt": "hi"} if path == COMPLETIONS else {"messages": USER}
    status = 404 if param == "model" and isinstance(extra.get("model"), str) else 400
    refused(router.post(path, {**body, **extra}), param, status)


# ---- bounds ------------------------------------------------------------------------------------------------
def test_n_best_of_and_logprobs_bounds(router: RouterHarness, tight: RouterHarness) -> None:
    refused(router.post(COMPLETIONS, {"prompt": "hi", "n": 129}), "n")
    assert router.post(COMPLETIONS, {"prompt": "hi", "n": 128, "max_tokens": 1}).status_code == 200
    refused(router.post(COMPLETIONS, {"prompt": "hi", "n": 10**6}), "n")
    refused(router.post(COMPLETIONS, {"prompt": "hi", "logprobs": 21}), "logprobs")
    refused(router.post(CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}), "top_logprobs")
    assert router.post(COMPLETIONS, {"prompt": "hi", "logprobs": 20, "max_tokens": 1}).status_code == 200
    assert "[1, 4]" in refused(tight.post(COMPLETIONS, {"prompt": "hi", "n": 5}), "n")
    refused(tight.post(COMPLETIONS, {"prompt": "hi", "n": 5, "best_of": 5}), "n")
    refused(tight.post(COMPLETIONS, {"prompt": "hi", "best_of": 5}), "best_of")
    refused(tight.post(COMPLETIONS, {"prompt": "hi", "logprobs": 3}), "logprobs")
    refused(tight.post(CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 3}), "top_logprobs")
    ok = tight.post(CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 2, "max_tokens": 1, "n": 4})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_prompt_list_bound(tight: RouterHarness) -> None:
    assert "at most 3" in refused(tight.post(COMPLETIONS, {"prompt": ["a", "b", "c", "d"]}), "prompt")
    refused(tight.post(COMPLETIONS, {"prompt": [[1], [2], [3], [4]]}), "prompt")
    ok = tight.post(COMPLETIONS, {"prompt": ["a", "b", [5, 6]], "max_tokens": 2})
    assert ok.status_code == 200 and [c["index"] for c in ok.json()["choices"]] == [0, 1, 2]


# ---- chat templates ----------------------------------------------------------------------------------------
def test_request_chat_template_needs_the_trust_flag(router: RouterHarness, tight: RouterHarness) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    message = refused(router.post(CHAT, {"messages": USER, "chat_template": template}), "chat_template")
    assert "--trust-request-chat-template" in message
    refused(router.post(CHAT, {"messages": USER, "chat_template": 3}), "chat_template")
    assert tight.post(CHAT, {"messages": USER, "chat_template": template, "max_tokens": 2}).status_code == 200
    refused(tight.post(CHAT, {"messages": USER, "chat_template": "{% if %}"}), "chat_template")


def test_chat_template_render_is_time_bounded(tight: RouterHarness) -> None:
    start = time.monotonic()
    responses = [tight.post(CHAT, {"messages": USER, "chat_template": SLOW_TEMPLATE}) for _ in range(3)]
    assert time.monotonic() - start < 10  # three renders of ~forever, each stopped after 1 s
    for response in responses:  # more renders than pool threads: none is stuck
        assert "took longer than 1 s" in refused(response, "chat_template")
    assert tight.post(CHAT, {"messages": USER, "max_tokens": 2}).status_code == 200


HOSTILE_TEMPLATE = "{{ (7 ** 14000000) % 7 }}"  # C-level work: 12.5 s, holding the GIL, in a router thread


def test_c_level_template_is_killed_while_health_answers(tight: RouterHarness) -> None:
    """A request's own template runs in a child process: the event loop answers /health meanwhile, and C-level work
    (which no in-thread deadline can stop) is killed at the deadline with a 400 naming `chat_template`."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tight.post(CHAT, {"messages": USER, "chat_template": template, "max_tokens": 2}).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the renderer is up: what follows times the render
        start = time.monotonic()
        hostile = pool.submit(tight.post, CHAT, {"messages": USER, "chat_template": HOSTILE_TEMPLATE})
        gaps = []
        while not hostile.done():
            asked = time.monotonic()
            assert tight.http.get("/health", timeout=5).status_code == 200
            gaps.append(time.monotonic() - asked)
            time.sleep(0.05)
        response = hostile.result()
    assert time.monotonic() - start < 3  # the 1 s deadline and the kill's grace (the C-level work alone: 12.5 s)
    assert "took longer than 1 s" in refused(response, "chat_template")
    assert len(gaps) > 5 and max(gaps) < 1.0, gaps
    # the child was replaced: renders go on
    assert tight.post(CHAT, {"messages": USER, "chat_template": template, "max_tokens": 2}).status_code == 200


def test_template_memory_bomb_is_400(tight: RouterHarness) -> None:
    message = refused(tight.post(CHAT, {"messages": USER, "chat_template": "{{ 'x' * 10000000000 }}"}),
                      "chat_template")
    assert "MemoryError" in message


def test_render_deadline_unit() -> None:
    from engine.errors import InvalidRequest
    from router.template_deadline import render_with_deadline

    assert render_with_deadline(lambda: "fine", 1.0) == "fine"
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(SLOW_TEMPLATE)
    with pytest.raises(InvalidRequest, match="longer than 0.2 s"):
        render_with_deadline(template.render, 0.2)


# ---- streaming -----------------------------------------------------------------------------------------------
def test_streaming_refusals_come_before_the_stream(router: RouterHarness) -> None:
    """A worker's refusal (here the fake's REFUSED_PROMPT) is a 400, not a 200 stream with an error inside."""
    for path, body in ((COMPLETIONS, {"prompt": REFUSED_PROMPT}), (COMPLETIONS, {"prompt": "hi", "top_p": 2}),
                       (CHAT, {"messages": USER, "max_tokens": 5000})):
        response = router.post(path, {**body, "stream": True})
        assert response.status_code == 400 and "data:" not in response.text, response.text
        error_of(response, 400)
    refused(router.post(COMPLETIONS, {"prompt": REFUSED_PROMPT}), None)  # the worker names no field
    ok = router.post(CHAT, {"messages": USER, "max_tokens": 2, "stream": True, "n": 2})
    assert ok.status_code == 200 and ok.text.endswith("data: [DONE]\n\n") and '"error"' not in ok.text
    events = [json.loads(line[6:]) for line in ok.text.splitlines() if line.startswith("data: {")]
    assert [e["choices"][0]["delta"].get("role") for e in events[:2]] == ["assistant", "assistant"]


# ---- the gRPC front ------------------------------------------------------------------------------------------
def grpc_error(router: RouterHarness, request: pb.GenerateRequest) -> grpc.RpcError:
    with grpc.insecure_channel(router.grpc_address) as channel, pytest.raises(grpc.RpcError) as info:
        list(kvflow_pb2_grpc.GenerationStub(channel).Generate(request, timeout=10))
    return info.value


def test_grpc_undecodable_bytes_are_invalid_argument(router: RouterHarness) -> None:
    with grpc.insecure_channel(router.grpc_address) as channel:
        for method, call in (("Generate", channel.unary_stream), ("Info", channel.unary_unary),
                             ("Abort", channel.unary_unary)):
            with pytest.raises(grpc.RpcError) as info:
                result = call(f"/kvflow.v1.Generation/{method}")(b"\xff\xff\xff\xff", timeout=10)
                list(result) if method == "Generate" else result  # noqa: B018
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.details())
        bad_utf8 = b"\x12\x02\xc3\x28"  # field 2 (text): invalid UTF-8
        with pytest.raises(grpc.RpcError) as info:
            list(channel.unary_stream("/kvflow.v1.Generation/Generate")(bad_utf8, timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info_response = kvflow_pb2_grpc.GenerationStub(channel).Info(pb.InfoRequest(), timeout=10)
        assert info_response.vocab_size == VOCAB_SIZE


@pytest.mark.parametrize(("ids", "params", "needle"), [
    ([VOCAB_SIZE] * 20, pb.SamplingParams(), "token ids"),
    ([1, 2], pb.SamplingParams(n=129), "n must be at most 128"),
    ([1, 2], pb.SamplingParams(logprobs=21), "logprobs"),
    ([1, 2], pb.SamplingParams(temperature=float("inf")), "temperature"),
    ([1, 2], pb.SamplingParams(repetition_penalty=float("nan")), "repetition_penalty"),
    ([1, 2], pb.SamplingParams(logit_bias={VOCAB_SIZE: 1.0}), "logit_bias"),
    ([1, 2], pb.SamplingParams(logit_bias={5: float("inf")}), "logit_bias"),
    ([1, 2], pb.SamplingParams(min_tokens=2000), "min_tokens"),
    ([], pb.SamplingParams(), "empty"),
])
def test_grpc_refusals_are_invalid_argument(router: RouterHarness, ids: list[int], params: pb.SamplingParams,
                                            needle: str) -> None:
    error = grpc_error(router, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling_params=params))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in error.details(), error.details()


def test_grpc_logit_bias_is_forwarded(router: RouterHarness, workers: FakeWorkers) -> None:
    with grpc.insecure_channel(router.grpc_address) as channel:
        request = pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_tokens=2, logit_bias={9: -1.5}))
        responses = list(kvflow_pb2_grpc.GenerationStub(channel).Generate(request, timeout=10))
    assert responses[-1].WhichOneof("response") == "complete"
    assert dict(workers.decode.requests[-1].sampling_params.logit_bias) == {9: -1.5}


# A value unlike the default for every SamplingParams field, within the router's bounds and the fake worker's
# vocabulary; floats that float32 holds exactly. The tests below take the field list from the dataclass, so a field
# added later without a value here fails them.
EVERY_FIELD: dict[str, Any] = dict(
    n=2, temperature=0.25, top_p=0.5, top_k=7, min_p=0.125, presence_penalty=0.5, frequency_penalty=-0.5,
    repetition_penalty=1.25, seed=11, stop=["x", "yz"], stop_token_ids=[5, 9], include_stop_str_in_output=True,
    ignore_eos=True, max_tokens=40, min_tokens=2, logprobs=3, prompt_logprobs=1, skip_special_tokens=False,
    logit_bias={3: -100.0, 70: 2.5},
    structured_outputs=StructuredOutputsParams(json='{"type":"object"}', disable_any_whitespace=True),
    allowed_token_ids=[4, 8], bad_words=["darn it", "heck"])
SAMPLING_FIELDS = sorted(f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_"))


def arrived(workers: FakeWorkers) -> SamplingParams:
    """The sampling parameters of the last request the decode worker got, as the worker reads them."""
    return sampling_params_from_proto(workers.decode.requests[-1].sampling_params)


def test_grpc_front_forwards_every_sampling_field(router: RouterHarness, workers: FakeWorkers) -> None:
    values = {name: EVERY_FIELD[name] for name in SAMPLING_FIELDS}
    with Client(router.grpc_address, max_retries=0) as client:
        assert client.generate([1, 2, 3], **values).choices
    params = arrived(workers)
    for name, value in values.items():
        assert getattr(params, name) == value, name


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_grpc_front_forwards_each_sampling_field_alone(router: RouterHarness, workers: FakeWorkers,
                                                       name: str) -> None:
    sent = sampling_params_to_proto(SamplingParams(**{name: EVERY_FIELD[name]}), explicit_only=True)
    with grpc.insecure_channel(router.grpc_address) as channel:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling_params=sent)
        responses = list(kvflow_pb2_grpc.GenerationStub(channel).Generate(request, timeout=10))
    assert responses[-1].WhichOneof("response") == "complete"
    assert getattr(arrived(workers), name) == EVERY_FIELD[name]
    # Nothing else is set on the way (the router fills max_tokens), so the worker's generation defaults still apply.
    assert set(sampling_kwargs_from_proto(workers.decode.requests[-1].sampling_params)) <= {name, "n", "max_tokens"}


def test_grpc_output_constraints_are_checked(router: RouterHarness) -> None:
    params = pb.SamplingParams(structured_outputs=pb.StructuredOutputs(regex="(unclosed"))
    error = grpc_error(router, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling_params=params))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs" in error.details()
    error = grpc_error(router, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling_params=pb.SamplingParams(
        structured_outputs=pb.StructuredOutputs())))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs" in error.details()


# ---- flags -----------------------------------------------------------------------------------------------------
FLAGS = ["--max-n", "8", "--max-logprobs", "5", "--max-prompts-per-request", "16", "--max-request-body-bytes",
         "1000", "--request-body-timeout", "2.5", "--request-header-timeout", "4", "--trust-request-chat-template", "--chat-template-timeout", "0.5",
         "--chat-template-workers", "2",
         "--max-migrations", "1", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
         "--expose-worker-addresses"]
EXPECTED = {"max_n": 8, "max_logprobs": 5, "max_prompts_per_request": 16, "max_request_body_bytes": 1000,
            "request_body_timeout_s": 2.5, "request_header_timeout_s": 4.0, "trust_request_chat_template": True, "chat_template_timeout_s": 0.5, "chat_template_workers": 2,
            "max_migrations": 1, "enable_auto_tool_choice": True, "tool_call_parser": "llama3_json",
            "expose_worker_addresses": True}


@pytest.mark.parametrize("command", ["router", "serve"])
def test_limit_flags_on_router_and_serve(command: str) -> None:
    from kvflow.commands import router as router_command
    from kvflow.commands import serve as serve_command
    from router.config import RouterConfig

    parser = argparse.ArgumentParser()
    (router_command if command == "router" else serve_command).register(parser.add_subparsers())
    args = parser.parse_args([command, "--decode", "127.0.0.1:1", *FLAGS] if command == "router" else
                             [command, *FLAGS])
    config = RouterConfig(decode=("127.0.0.1:1",), **router_command.request_limit_kwargs(args))
    assert {name: getattr(config, name) for name in EXPECTED} == EXPECTED
    if command == "router":
        assert router_command.config_from_args(args) == config
    defaults = router_command.request_limit_kwargs(parser.parse_args(
        [command, "--decode", "127.0.0.1:1"] if command == "router" else [command]))
    assert defaults == {name: getattr(RouterConfig(), name) for name in EXPECTED}
    assert defaults["max_n"] == 128 and defaults["max_logprobs"] == 20 and not defaults["trust_request_chat_template"]


@pytest.mark.parametrize(("field", "value"), [("max_n", 0), ("max_logprobs", 21), ("max_prompts_per_request", 0),
                                              ("max_request_body_bytes", 0), ("request_body_timeout_s", 0.0),
                                              ("request_header_timeout_s", 0.0),
                                              ("chat_template_timeout_s", -1.0), ("chat_template_workers", 0)])
def test_bad_limit_values_are_refused_at_startup(field: str, value: Any) -> None:
    from router.config import RouterConfig

    with pytest.raises(ValueError, match=field.removesuffix("_s").replace("_", "-")):
        RouterConfig(decode=("127.0.0.1:1",), **{field: value}).validate()
