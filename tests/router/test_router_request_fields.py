"""Request fields the router used to ignore silently (issues #27 item 8, #28 item 4), against a real router in front
of fake workers (tests/helpers/router_fakes.py): each is honoured or refused with a 400 naming it; unknown fields
are accepted, logged once per name and listed in the `x-kvflow-ignored-fields` header."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from router.http import IGNORED_FIELDS_HEADER, IgnoredFields
from tests.helpers.router_fakes import FakeWorkers, RouterHarness

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
USER = [{"role": "user", "content": "hi"}]
BASE = {COMPLETIONS: {"prompt": "hi", "max_tokens": 1}, CHAT: {"messages": USER, "max_tokens": 1},
        RESPONSES: {"input": "hi", "max_output_tokens": 1}}


@pytest.fixture(scope="module")
def trusting(workers: FakeWorkers) -> Iterator[RouterHarness]:
    harness = RouterHarness(workers, trust_request_chat_template=True)
    yield harness
    harness.close()


def _refused(response: Any, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error
    return error["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, RESPONSES])
@pytest.mark.parametrize(("field", "value", "neutral"), [("priority", 5, 0)])
def test_unimplemented_vllm_fields_are_refused(router: RouterHarness, path: str, field: str, value: Any,
                                               neutral: Any) -> None:
    assert "not supported yet" in _refused(router.post(path, {**BASE[path], field: value}), field)
    response = router.post(path, {**BASE[path], field: neutral})
    assert response.status_code == 200 and IGNORED_FIELDS_HEADER not in response.headers, response.text


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, RESPONSES])
def test_token_masks_reach_the_worker(router: RouterHarness, workers: FakeWorkers, path: str) -> None:
    """allowed_token_ids and bad_words are forwarded (each worker applies them: tests/engine/test_token_masks.py);
    bad values are refused by name before any worker sees them."""
    response = router.post(path, {**BASE[path], "allowed_token_ids": [1, 2], "bad_words": ["darn it"]})
    assert response.status_code == 200 and IGNORED_FIELDS_HEADER not in response.headers, response.text
    sent = workers.decode.requests[-1].sampling_params
    assert list(sent.allowed_token_ids) == [1, 2] and list(sent.bad_words) == ["darn it"]
    for field, bad in (("allowed_token_ids", []), ("allowed_token_ids", [10**9]), ("allowed_token_ids", ["1"]),
                       ("bad_words", [""]), ("bad_words", ["x" * 300]), ("bad_words", "darn")):
        _refused(router.post(path, {**BASE[path], field: bad}), field)


def test_chat_template_kwargs_reach_the_template(trusting: RouterHarness, workers: FakeWorkers) -> None:
    template = {"chat_template": "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"}
    expected = trusting.post("/tokenize", {"prompt": "HELLO hi", "add_special_tokens": False}).json()["tokens"]
    counted = trusting.post("/tokenize", {"messages": USER, **template, "chat_template_kwargs": {"greeting": "HELLO "}})
    assert counted.status_code == 200 and counted.json()["tokens"] == expected, counted.text
    for path in (CHAT, RESPONSES):
        response = trusting.post(path, {**BASE[path], **template, "chat_template_kwargs": {"greeting": "HELLO "}})
        assert response.status_code == 200, response.text
        assert list(workers.decode.requests[-1].token_ids.ids) == expected
    for bad in ({"tokenize": True}, {"add_generation_prompt": False}, {"_x": 1}, {"a-b": 1}, ["x"]):
        _refused(trusting.post(CHAT, {**BASE[CHAT], "chat_template_kwargs": bad}), "chat_template_kwargs")


def test_responses_store_n_and_chat_template(router: RouterHarness) -> None:
    assert "does not store" in _refused(router.post(RESPONSES, {**BASE[RESPONSES], "store": True}), "store")
    _refused(router.post(RESPONSES, {**BASE[RESPONSES], "n": 2}), "n")
    for fine in ({"store": False}, {"n": 1}):
        assert router.post(RESPONSES, {**BASE[RESPONSES], **fine}).status_code == 200
    message = _refused(router.post(RESPONSES, {**BASE[RESPONSES], "chat_template": "{{ 1 }}"}), "chat_template")
    assert "--trust-request-chat-template" in message  # passed to the chat request, which applies the flag


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_json": {"$ref": "https://example.com/schema.json"}}, "guided_json"),
    ({"guided_json": '{"type": "object", "properties": {"a": {"$ref": "http://10.0.0.1/a"}}}'}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "anyOf": [{"$ref": "file:///etc/passwd"}]}}}}, "response_format"),
    ({"structured_outputs": {"json": {"$ref": "other.json#/a"}}}, "structured_outputs"),
])
def test_remote_schema_refs_are_refused(router: RouterHarness, extra: dict[str, Any], param: str) -> None:
    assert "$ref" in _refused(router.post(CHAT, {**BASE[CHAT], **extra}), param)


def test_local_schema_refs_are_accepted(router: RouterHarness) -> None:
    schema = {"$defs": {"a": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}
    assert router.post(CHAT, {**BASE[CHAT], "guided_json": schema}).status_code == 200


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, RESPONSES, "/tokenize"])
def test_unknown_fields_are_accepted_and_listed(router: RouterHarness, path: str) -> None:
    base = BASE.get(path, {"prompt": "hi"})
    response = router.post(path, {**base, "bogus_field_xyz": 1, "zeta, \u00e9": 2})
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_FIELDS_HEADER] == "bogus_field_xyz, zeta\\u002c \\u00e9"
    assert IGNORED_FIELDS_HEADER not in router.post(path, base).headers  # every field read: no header


def test_fields_of_the_other_endpoint_are_ignored(router: RouterHarness) -> None:
    """What one endpoint reads, another may not: chat's add_generation_prompt means nothing to completions."""
    response = router.post(COMPLETIONS, {**BASE[COMPLETIONS], "add_generation_prompt": True})
    assert response.headers[IGNORED_FIELDS_HEADER] == "add_generation_prompt"
    assert IGNORED_FIELDS_HEADER not in router.post(COMPLETIONS, {**BASE[COMPLETIONS], "echo": False}).headers


def test_ignored_fields_are_logged_once_per_name(caplog: pytest.LogCaptureFixture) -> None:
    ignored = IgnoredFields()
    with caplog.at_level(logging.WARNING, logger="router.http"):
        assert ignored.headers([]) == {}
        ignored.headers(["a", "b"])
        ignored.headers(["b"])
        ignored.headers(["b", "c"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "ignored: a, b" in lines[0] and "ignored: c" in lines[1], lines
    many = ignored.headers([f"f{i}" for i in range(100)])[IGNORED_FIELDS_HEADER]
    assert many.endswith(", ...") and many.count(",") == 32
