"""Bounded grammar compilation (issue 27, item 1): the size limits refuse oversized constraints and tools with the
field named, on the router and in the engine alike; grammars compile on the engine's compile threads, so a slow
(hostile) compile never delays another request on the same engine; a compile over `--structured-outputs-timeout-s`
is a refusal, and is never started twice; compiled grammars are cached by content."""

from __future__ import annotations

import asyncio
import dataclasses
import string
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from engine.arg_utils import EngineArgs
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequest
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured.grammar import StructuredOutputManager, StructuredOutputsParams
from engine.structured.limits import DEFAULT_LIMITS, StructuredOutputLimits, max_repeat
from router.config import RouterConfig
from router.errors import BadRequest
from router.openai_protocol import parse_request
from tests.helpers.hostile import nested_any_of


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _parse(body: dict[str, Any], chat: bool = True) -> Any:
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    return parse_request({**base, **body}, chat, RouterConfig(decode=("x",)))


# ---- the limits, on the router -----------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [_tool("f" * 1048576)], "tool_choice": "required"}, "tools[0].function.name", "1 to 64"),
    ({"tools": [_tool("f" * 65)], "tool_choice": "none"}, "tools[0].function.name", "65 characters"),
    ({"tools": [_tool("get.weather")], "tool_choice": "required"}, "tools[0].function.name", "^[a-zA-Z0-9_-]"),
    ({"tools": [_tool(f"f{i}") for i in range(129)], "tool_choice": "required"}, "tools", "at most 128"),
    ({"tools": [_tool("ok"), _tool("deep", _deep(40))], "tool_choice": "required"}, "tools[1].function.parameters",
     "nests deeper"),
    ({"guided_json": nested_any_of(7)}, "guided_json", "more than 10000 values"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(40)}}},
     "response_format", "nests deeper than 64"),
    ({"guided_json": {"type": "string", "maxLength": 1000000}}, "guided_json", "maxLength 1000000"),
    ({"guided_json": {"type": "string", "pattern": "a{0,99999}"}}, "guided_json", "repeats up to 99999"),
    ({"guided_regex": ".{0,1000000}"}, "guided_regex", "repeats up to 1000000"),
    ({"guided_regex": "(a{0,200}){0,200}"}, "guided_regex", "repeats up to 40000"),
    ({"guided_regex": "a" * 20000}, "guided_regex", "20000 characters"),
    ({"structured_outputs": {"grammar": 'root ::= "a"{0,50000}'}}, "structured_outputs", "repeats up to 50000"),
    ({"guided_grammar": "root ::= " + " ".join(['"a"'] * 30000)}, "guided_grammar", "characters"),
    ({"guided_choice": [f"c{i}" for i in range(1001)]}, "guided_choice", "1001 choices"),
])
def test_the_router_refuses_constraints_and_tools_over_the_limits(body: dict[str, Any], param: str,
                                                                   words: str) -> None:
    started = time.perf_counter()
    with pytest.raises(BadRequest) as err:
        _parse(body, chat="tools" in body or "response_format" in body)
    assert err.value.param == param, err.value
    assert words in str(err.value) and param in str(err.value), err.value
    assert time.perf_counter() - started < 1.0  # refused before anything compiles


def test_the_limits_pass_ordinary_constraints() -> None:
    for regex in (r"\d{3}-\d{3}-\d{4}", r"[a-z]{1,64}@[a-z]{1,64}\.(com|org){1}", r"(19|20)\d\d\.", r"\{a{5}\}"):
        assert _parse({"guided_regex": regex}, chat=False).params.structured_outputs.regex == regex
    assert max_repeat(r"(a{2}(b{3}){4}){5}") == 3 * 4 * 5  # the widest nested chain
    assert max_repeat('root ::= "{9999999}" [{}]{3}', quoted=True) == 3  # literals and brackets skipped
    _parse({"tools": [_tool("get_weather-2", _deep(20))], "tool_choice": "required"})


def test_the_engine_applies_the_same_limits() -> None:
    manager = StructuredOutputManager(None, 128, 127)
    for params in (StructuredOutputsParams(regex=".{0,1000000}"), StructuredOutputsParams(json=_deep(40))):
        with pytest.raises(InvalidRequest) as err:
            manager.submit(params)  # refused before any compile thread or tokenizer is needed
        assert err.value.param == "structured_outputs"
    with pytest.raises(ValueError, match="--structured-outputs-timeout-s must be > 0"):
        EngineArgs(model="tiny", structured_outputs_timeout_s=0).structured_outputs()


# ---- the compile threads, the budget and the cache -----------------------------------------------------------
def _raw_vocab(vocab_size: int, eos: int) -> Any:
    import xgrammar as xgr

    pieces = list(string.printable[:95]) + [f"<unused{i}>" for i in range(95, vocab_size)]
    pieces[eos] = "</s>"
    return xgr.TokenizerInfo(pieces, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos])


def _slowed(manager: StructuredOutputManager, pause: Callable[[], Any]) -> list[str]:
    """Make each compile `pause()` first (xgrammar releases the GIL as it compiles: so do sleeps and waits);
    returns the list of constraints compiled."""
    real = manager._compile_now
    compiled: list[str] = []

    def slow(params: StructuredOutputsParams) -> Any:
        compiled.append(params.cache_key())
        pause()
        return real(params)

    manager._compile_now = slow  # type: ignore[method-assign]
    return compiled


def test_the_cache_hits_on_a_second_identical_schema() -> None:
    manager = StructuredOutputManager(None, 128, 127, tokenizer_info=_raw_vocab(128, 127))
    first = manager.submit(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    again = manager.submit(StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'))
    assert again is first  # the same content, spelled differently
    assert manager.compile(StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}},
                                                         "type": "object"})) is first.result()
    assert manager.num_compiled == 1
    manager.compile(StructuredOutputsParams(regex="[ab]+"))
    assert manager.num_compiled == 2


def test_a_compile_over_the_budget_is_refused_and_never_started_twice() -> None:
    limits = dataclasses.replace(DEFAULT_LIMITS, timeout_s=0.3)
    manager = StructuredOutputManager(None, 128, 127, tokenizer_info=_raw_vocab(128, 127), limits=limits)
    compiled = _slowed(manager, lambda: time.sleep(1.5))
    hostile = StructuredOutputsParams(regex="[ab]+c")
    for _ in range(2):
        started = time.perf_counter()
        with pytest.raises(InvalidRequest, match="did not compile within 0.3 s") as err:
            manager.compile(hostile)
        assert err.value.param == "structured_outputs" and time.perf_counter() - started < 1.0
    assert len(compiled) == 1  # the second request waited on the same compile
    time.sleep(1.5)
    assert manager.compile(hostile) is not None and len(compiled) == 1  # finished late: cached for next time


# ---- on a live engine loop -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    args = EngineArgs(model="tiny", load_format="dummy", max_model_len=64, kv_cache_memory_bytes=8 << 20,
                      structured_outputs_timeout_s=2.5)
    engine = LLMEngine.from_engine_args(args)
    assert engine.structured_output.limits == StructuredOutputLimits(timeout_s=2.5)
    eos = engine.eos_token_id if engine.eos_token_id is not None else 0
    engine.structured_output.tokenizer_info = _raw_vocab(engine.config.model.arch.vocab_size, eos)
    return engine


async def _generate(aengine: AsyncEngine, request_id: str, params: SamplingParams) -> RequestOutput:
    """What the decode worker does: the grammar first (off the loop), then admit, then read the stream."""
    await aengine.ready_grammar(params)
    stream = aengine.open_stream(request_id)
    try:
        await aengine.call(lambda e: e.add_request(request_id, {"prompt_token_ids": [1, 2, 3]}, params, "final"))
        while True:
            item = await stream.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                return item
    finally:
        aengine.close_stream(request_id)


async def _race(engine: LLMEngine, constrained: StructuredOutputsParams) -> tuple[Any, float, float]:
    """A constrained request, and 0.2 s later a plain one: (the constrained one's output or error, when the plain
    one finished, when the constrained one did), in seconds from the start."""
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        started = time.perf_counter()
        slow = asyncio.ensure_future(_generate(aengine, f"c{id(constrained)}", SamplingParams(
            max_tokens=8, temperature=0, structured_outputs=constrained)))
        await asyncio.sleep(0.2)
        await _generate(aengine, f"p{id(constrained)}", SamplingParams(max_tokens=4, temperature=0))
        plain_s = time.perf_counter() - started
        try:
            result: Any = await slow
        except InvalidRequest as exc:
            result = exc
        return result, plain_s, time.perf_counter() - started
    finally:
        await aengine.stop()


def test_a_slow_compile_does_not_delay_another_request(engine: LLMEngine) -> None:
    manager = engine.structured_output
    _slowed(manager, lambda: time.sleep(1.5))
    try:
        output, plain_s, constrained_s = asyncio.run(_race(engine, StructuredOutputsParams(choice=["yes", "no"])))
    finally:
        del manager._compile_now  # the class's own again
    assert plain_s < 1.0, plain_s  # not behind the 1.5 s compile
    assert constrained_s >= 1.5
    text = "".join(manager.tokenizer_info.decoded_vocab[t].decode() for t in output.outputs[0].token_ids
                   if t != engine.eos_token_id)
    assert text in ("yes", "no"), text


def test_another_request_completes_within_2_s_while_a_hostile_one_compiles(engine: LLMEngine) -> None:
    """The regression of issue 27: a compile that would take 20 s (the 1 MiB tool name took 112 s) neither holds
    up the other requests nor its own caller past the budget (2.5 s here)."""
    manager = engine.structured_output
    release = threading.Event()  # ends the "hostile" compile when the test is done
    compiled = _slowed(manager, lambda: release.wait(20))
    try:
        error, plain_s, constrained_s = asyncio.run(_race(engine, StructuredOutputsParams(regex="[xy]{2}z")))
    finally:
        release.set()
        del manager._compile_now
    assert plain_s < 2.0, plain_s
    assert isinstance(error, InvalidRequest), error
    assert error.param == "structured_outputs" and "--structured-outputs-timeout-s" in str(error)
    assert 2.5 <= constrained_s < 4.0, constrained_s
    assert len(compiled) == 1
