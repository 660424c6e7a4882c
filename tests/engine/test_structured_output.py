"""Structured output and tools: the batch sampler's bitmask (only constrained rows), the parameters and their wire
form, the router's parsing (400s naming the field, tool schemas, tool-call parsers, streamed tool deltas), and a
real `kvflow serve` on SmolLM2 (1 prefill + 1 decode worker): json_schema outputs that parse and validate on the
unified path (a short prompt, prefilled on the decode worker) and on P/D (a long one: the prefill worker samples
the first token under the grammar, the decode worker resumes the matcher), guided choice / regex, tool_choice
required and named (streaming too); the engine-wide --structured-outputs-config (disable_any_whitespace changes
every JSON grammar, and reaches the sampler through LLM(...))."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch

from cluster.auth import TOKEN_ENV
from cluster.wire import sampling_params_from_proto, sampling_params_to_proto
from engine.errors import InvalidRequest
from engine.runner.sampler import GrammarMask, Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.structured.grammar import GuidedDecodingParams, StructuredOutputsParams
from kvflow.launcher import free_port
from router.config import RouterConfig
from router.errors import BadRequest
from router.openai_protocol import parse_request
from router.tool_calls import ToolStream, chat_message, parse_hermes, parse_llama3_json, parse_tools
from tests.helpers.serve import wait_healthy

DISAGG_MIN = 64  # prompts with fewer uncached tokens prefill on the decode worker (unified path)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24}},
                                                "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


# ---- the sampler -----------------------------------------------------------------------------------------------
def test_the_batched_sampler_masks_only_constrained_rows() -> None:
    import xgrammar as xgr

    vocab = 100
    logits = torch.randn(3, vocab)
    original = logits.clone()
    bitmask = xgr.allocate_token_bitmask(3, vocab)
    bitmask.zero_()
    bitmask[1, 0] = (1 << 5) | (1 << 17)  # row 1 may only pick tokens 5 and 17
    bitmask[0].fill_(0)  # rows 0 and 2 hold "nothing allowed" garbage: they are not listed, so never read
    greedy = SamplingParams(temperature=0)
    rows = [SamplingRow(greedy, [1], [], None) for _ in range(3)]
    tokens = Sampler(0, torch.device("cpu")).sample(logits, rows, GrammarMask(bitmask, [1]))
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [5, 17]
    assert tokens[1].item() == (5 if original[1, 5] > original[1, 17] else 17)
    assert tokens[0].item() == original[0].argmax().item() and tokens[2].item() == original[2].argmax().item()
    sampled = Sampler(1, torch.device("cpu")).sample(original.clone(), [SamplingRow(
        SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.2), [5], [17], None)] * 3,
        GrammarMask(bitmask, [1]))
    assert sampled[1].item() in (5, 17)


# ---- parameters and the wire -----------------------------------------------------------------------------------
def test_params_validate_and_travel_on_the_wire() -> None:
    import kvflow
    from kvflow.sampling_params import GuidedDecodingParams as VllmSpelling

    assert GuidedDecodingParams is StructuredOutputsParams is VllmSpelling is kvflow.GuidedDecodingParams
    params = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(json=PERSON))
    assert params.structured_outputs is not None and params.guided_decoding is params.structured_outputs
    for constraint in (StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
                       StructuredOutputsParams(regex=r"\d{3}"), StructuredOutputsParams(choice=["a", "b c"]),
                       StructuredOutputsParams(grammar='root ::= "x"'), StructuredOutputsParams(json_object=True)):
        back = sampling_params_from_proto(sampling_params_to_proto(SamplingParams(structured_outputs=constraint)))
        assert back.structured_outputs is not None
        assert back.structured_outputs.cache_key() == constraint.cache_key()
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())).structured_outputs is None
    for bad in ({}, {"json": PERSON, "regex": "a"}, {"choice": []}, {"json": "{not json"}, {"backend": "outlines",
                                                                                            "regex": "a"},
                {"whitespace_pattern": " ", "regex": "a"}):
        with pytest.raises(InvalidRequest) as err:
            SamplingParams(structured_outputs=bad)
        assert err.value.param == "structured_outputs"


# ---- the engine's config (--structured-outputs-config) -----------------------------------------------------------
def _raw_vocab(vocab_size: int, eos: int) -> Any:
    """An xgrammar TokenizerInfo whose first tokens are the printable ASCII characters (any JSON can be spelled),
    for a model without a tokenizer."""
    import string

    import xgrammar as xgr

    pieces = list(string.printable[:95]) + [f"<unused{i}>" for i in range(95, vocab_size)]
    pieces[eos] = "</s>"
    return xgr.TokenizerInfo(pieces, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos])


def test_disable_any_whitespace_in_the_engine_config_changes_every_json_grammar() -> None:
    import xgrammar as xgr

    from engine.structured.config import StructuredOutputsConfig
    from engine.structured.grammar import StructuredOutputManager

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    info = _raw_vocab(128, 127)

    def accepts(config: StructuredOutputsConfig | None, params: StructuredOutputsParams, text: str) -> bool:
        manager = StructuredOutputManager(None, 128, 127, tokenizer_info=info, config=config)
        return xgr.GrammarMatcher(manager.compile(params)).accept_string(text)

    compact = StructuredOutputsConfig(disable_any_whitespace=True)
    for params in (StructuredOutputsParams(json=schema), StructuredOutputsParams(json_object=True)):
        for spaced in ('{ "a": 1}', '{\n  "a": 1\n}'):
            assert accepts(None, params, spaced)  # the default: free whitespace between tokens
            assert not accepts(compact, params, spaced)  # the config removes it for every request
            assert not accepts(None, dataclasses.replace(params, disable_any_whitespace=True), spaced)  # per request
        assert accepts(compact, params, '{"a": 1}')  # xgrammar's fixed separators remain
    assert not accepts(None, StructuredOutputsParams(json=schema), '{"a": 1, "b": 2}')  # strict: no undeclared keys
    manager = StructuredOutputManager(None, 128, 127, tokenizer_info=info, config=compact)
    manager.compile(StructuredOutputsParams(json=schema))
    manager.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))  # the same grammar
    assert manager.num_compiled == 1
    assert accepts(compact, StructuredOutputsParams(regex="a b"), "a b")  # a regex's own spaces are not "free"


def test_the_llm_engine_samples_under_the_configured_grammar() -> None:
    """LLM(structured_outputs_config=...) reaches the sampler: a random-weight model's greedy output under an enum
    schema is exactly one of its compact spellings, where without the config the same model pads it with
    whitespace."""
    from kvflow import LLM

    schema = {"type": "object", "properties": {"c": {"enum": ["x", "yz"]}}, "required": ["c"]}
    compact = ('{"c": "x"}', '{"c": "yz"}')
    for config in ({"disable_any_whitespace": True}, None):
        with LLM("tiny", max_model_len=64, kv_cache_memory_bytes=8 << 20, guided_decoding_backend="xgrammar",
                 structured_outputs_config=config) as llm:
            engine = llm.llm_engine
            info = _raw_vocab(engine.config.model.arch.vocab_size, engine.eos_token_id)
            engine.structured_output.tokenizer_info = info  # "tiny" has no tokenizer; read at the first compile
            params = SamplingParams(max_tokens=24, temperature=0,
                                    structured_outputs=StructuredOutputsParams(json=schema))
            out = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [9, 8]}], params)
        texts = ["".join(info.decoded_vocab[t].decode() for t in request.outputs[0].token_ids
                         if t != engine.eos_token_id) for request in out]
        if config is not None:
            assert all(text in compact for text in texts), texts
        else:  # the seeded random weights favour a space token, which only the config forbids
            assert all(text not in compact and text.startswith("{ ") for text in texts), texts


# ---- the router's parsing ----------------------------------------------------------------------------------
def _parse(body: dict[str, Any], chat: bool = True, **config: Any) -> Any:
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    return parse_request({**base, **body}, chat, RouterConfig(decode=("x",), **config))


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema.schema"),
    ({"response_format": "text"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"structured_outputs": {"json": PERSON, "regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"tools": [WEATHER]}, "tool_choice"),  # auto without --enable-auto-tool-choice, as vLLM
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
])
def test_bad_constraints_and_tools_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        _parse(body)
    assert err.value.param == param, err.value


def test_constraints_and_tool_schemas_reach_the_sampling_params() -> None:
    parsed = _parse({"response_format": {"type": "json_object"}})
    assert parsed.params.structured_outputs.json_object
    parsed = _parse({"guided_choice": ["yes", "no"]}, chat=False)
    assert list(parsed.params.structured_outputs.choice.choices) == ["yes", "no"]
    parsed = _parse({"structured_outputs": {"regex": "[a-z]+"}}, chat=False)
    assert parsed.params.structured_outputs.regex == "[a-z]+"
    assert not _parse({"response_format": {"type": "text"}}).params.HasField("structured_outputs")
    named = _parse({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert json.loads(named.params.structured_outputs.json) == TIME["function"]["parameters"]
    required = _parse({"tools": [WEATHER, TIME], "tool_choice": "required"})
    schema = json.loads(required.params.structured_outputs.json)
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "Paris"}}], schema)
    auto = _parse({"tools": [WEATHER]}, enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert auto.tools.choice == "auto" and not auto.params.HasField("structured_outputs")
    assert auto.params.skip_special_tokens_false  # <tool_call> is a special token in Hermes vocabularies
    none = _parse({"tools": [WEATHER], "tool_choice": "none"})
    assert none.tools.tools == [WEATHER] and not none.params.HasField("structured_outputs")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        RouterConfig(decode=("x",), enable_auto_tool_choice=True).validate()


def test_tool_call_parsers_and_streamed_deltas() -> None:
    content, calls = parse_hermes('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                  '\n</tool_call>')
    assert content == "Let me check. " and calls[0]["function"] == {"name": "get_weather",
                                                                    "arguments": '{"city": "Oslo"}'}
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>{broken</tool_call>")[1] == []
    content, calls = parse_llama3_json('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", '
                                       '"arguments": {}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert parse_llama3_json("Hello {x}")[1] == []
    auto = parse_tools({"tools": [WEATHER]}, True, "hermes")
    assert auto is not None
    stream = ToolStream(auto)
    pieces = ["Sure", ". <tool", "_call>", '{"name": "get_weather", ', '"arguments": {"city": "Rome"}}', "</tool_call>"]
    deltas = [stream.feed(p) for p in pieces]
    assert "".join(d["content"] for d in deltas if d) == "Sure. "  # "<tool" was held back, then the call
    last, finish = stream.finish("".join(pieces), "stop")
    assert finish == "tool_calls" and last["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    message, finish = chat_message(auto, "just text", "stop")
    assert message == {"role": "assistant", "content": "just text"} and finish == "stop"


# ---- a real server -----------------------------------------------------------------------------------------
class Server:
    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/{path}", json={"model": "smollm2", "temperature": 0, **body}, timeout=300)

    def disaggregated(self) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith('kvflow:requests_total{path="disaggregated"}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("structured") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvflow.cli", "serve", "--model", "smollm2", "--port", str(port), "--grpc-port",
             "0", "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "1024", "--disagg-min-prompt-tokens",
             str(DISAGG_MIN), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--disagg-policy", "static"],  # the P/D path by prompt length (adaptive: all local on one host)
            stdout=out, stderr=subprocess.STDOUT, env=env)
    srv = Server(f"http://127.0.0.1:{port}", log)
    try:
        wait_healthy(process, srv.url, log)
        yield srv
    finally:
        process.terminate()
        process.wait(60)


def _json_schema_request(server: Server, question: str) -> dict[str, Any]:
    response = server.post("chat/completions", {
        "messages": [{"role": "user", "content": question}], "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    jsonschema.validate(value, PERSON)
    return value


def test_json_schema_on_the_unified_and_the_pd_path(server: Server) -> None:
    before = server.disaggregated()
    _json_schema_request(server, "Invent a person.")  # ~40 tokens with the system prompt: prefilled locally
    assert server.disaggregated() == before
    story = " ".join(f"Line {i}: the archive lists travellers, their ages and their home cities." for i in range(6))
    _json_schema_request(server, story + " Pick one traveller and describe them.")  # long: a prefill worker's
    assert server.disaggregated() == before + 1


def test_guided_choice_and_regex(server: Server) -> None:
    choice = server.post("completions", {"prompt": "Is the sky green? Answer:", "max_tokens": 8,
                                         "guided_choice": ["yes", "no", "maybe"]})
    assert choice.status_code == 200, choice.text
    assert choice.json()["choices"][0]["text"] in ("yes", "no", "maybe")
    regex = server.post("completions", {"prompt": "The year the war ended:", "max_tokens": 12,
                                        "structured_outputs": {"regex": r"(19|20)\d\d\."}})
    assert regex.status_code == 200, regex.text
    text = regex.json()["choices"][0]["text"]
    assert len(text) == 5 and text[:2] in ("19", "20") and text[2:4].isdigit() and text[4] == "."
    bad = server.post("completions", {"prompt": "x", "guided_json": {"type": "bogus"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_json"


def test_tool_choice_required_and_named_make_valid_tool_calls(server: Server) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    required = server.post("chat/completions", {"messages": messages, "max_tokens": 60, "tools": [WEATHER, TIME],
                                                "tool_choice": "required"})
    assert required.status_code == 200, required.text
    choice = required.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in choice["message"]["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            tools[call["function"]["name"]]["function"]["parameters"])
    named = {"messages": messages, "max_tokens": 40, "tools": [WEATHER, TIME],
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = server.post("chat/completions", named).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    arguments, names, finish = "", [], None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=300,
                      json={**named, "model": "smollm2", "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                for delta_call in c["delta"].get("tool_calls", []):
                    names.append(delta_call.get("function", {}).get("name"))
                    arguments += delta_call.get("function", {}).get("arguments", "")
                finish = c["finish_reason"] or finish
    assert finish == "tool_calls" and names[0] == "get_weather"
    assert arguments == call["function"]["arguments"]  # greedy: the stream spells the same call
