"""Resuming a request another engine started (what mid-stream migration sends a new decode worker): the prompt
plus the tokens already delivered. Greedy and seeded sampling (with penalties) continue exactly as undisturbed;
resumed tokens are not returned again; bad resumes are refused by field; shared params are never mutated."""

from __future__ import annotations

import random

import pytest

from engine.arg_utils import EngineArgs
from engine.errors import InvalidRequest
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineArgs(model="tiny", kv_cache_memory_bytes=16 << 20, max_model_len=512)
                     .create_engine_config())


def run(engine: LLMEngine, request_id: str) -> tuple[RequestOutput, list[list[int]]]:
    """The finished output and every delta of new token ids seen on the way."""
    deltas = []
    for _ in range(10_000):
        for output in engine.step():
            if output.request_id == request_id:
                deltas.append(list(output.outputs[0].token_ids))
                if output.finished:
                    return output, deltas
    raise AssertionError("request never finished")


@pytest.mark.parametrize("params", [
    dict(temperature=0.0, max_tokens=24),
    dict(temperature=0.9, seed=7, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.5, top_k=50),
    dict(temperature=1.0, seed=123, max_tokens=24, min_p=0.05, presence_penalty=0.4),
])
@pytest.mark.parametrize("cut", [1, 9, 23])
def test_resumed_request_continues_exactly(engine: LLMEngine, params: dict, cut: int) -> None:
    prompt = [random.Random(cut).randrange(3, 500) for _ in range(37)]
    engine.add_request("whole", prompt, SamplingParams(**params), output_kind="delta")
    whole, _ = run(engine, "whole")
    full = list(whole.outputs[0].token_ids)
    engine.add_request("resumed", prompt, SamplingParams(**params), output_kind="delta",
                       resume_output_token_ids=full[:cut])
    resumed, deltas = run(engine, "resumed")
    assert list(resumed.outputs[0].token_ids) == full, "same tokens as an undisturbed run"
    assert deltas[0][:cut] == full[:cut] and len(deltas[0]) > cut  # the first output already holds the prefix
    assert resumed.outputs[0].finish_reason == whole.outputs[0].finish_reason


def test_bad_resumes_are_refused_by_field(engine: LLMEngine) -> None:
    cases = [
        (SamplingParams(max_tokens=4, n=2), [1, 2], "n"),
        (SamplingParams(max_tokens=4), [1, 2, 3, 4], "resume_token_ids"),  # nothing left of max_tokens
        (SamplingParams(max_tokens=4), [10**6], "resume_token_ids"),
        (SamplingParams(max_tokens=4, prompt_logprobs=1), [1], "prompt_logprobs"),
        (SamplingParams(max_tokens=None), [5] * 509, "resume_token_ids"),  # 3 + 509 + 1 > max_model_len 512
    ]
    for params, resumed, param in cases:
        with pytest.raises(InvalidRequest) as caught:
            engine.add_request(f"bad-{param}", [1, 2, 3], params, resume_output_token_ids=resumed)
        assert caught.value.param == param
    assert engine.get_num_unfinished_requests() == 0


def test_shared_params_are_not_mutated(engine: LLMEngine) -> None:
    """One params object for many prompts (as LLM.generate passes it): each gets its own max_tokens."""
    shared = SamplingParams(max_tokens=None, temperature=0.0)
    engine.add_request("long", list(range(3, 400)), shared)
    engine.add_request("short", [3, 4, 5], shared)
    assert shared.max_tokens is None
    assert engine.scheduler.requests["short"].max_tokens == 512 - 3
    engine.abort_request(["long", "short"])
    engine.step()
