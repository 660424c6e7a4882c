"""Bad input raises InvalidRequest with the reason and the engine keeps serving; generation_config; chat."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest
from kvflow import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", max_model_len=64, kv_cache_memory_bytes=8 << 20)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"nonsense": 1}, "unknown"),
    ],
)
def test_bad_sampling_params(kwargs: dict, reason: str) -> None:
    with pytest.raises(InvalidRequest, match=reason):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 2, 512]}, "token ids"),
        ({"prompt_token_ids": [1, -1]}, "token ids"),
        ({"prompt_token_ids": list(range(1, 65))}, "maximum context length"),
        ("text", "no tokenizer"),
        (3.5, "must be a string"),
    ],
)
def test_bad_prompts_keep_engine_serving(llm: LLM, prompt: object, reason: str) -> None:
    with pytest.raises(InvalidRequest, match=reason):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, prompt], SamplingParams(max_tokens=3))  # type: ignore[list-item]
    assert not llm.llm_engine.has_unfinished_requests()  # the good half of the batch was withdrawn
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_max_tokens_defaults_to_the_context_left(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": list(range(1, 60))},
                       SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0))[0].outputs[0]
    assert len(out.token_ids) == 64 - 59 and out.finish_reason == "length"


def test_prompt_of_max_len_minus_one_fits(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": list(range(1, 64))}, SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 1  # max_model_len stops it


def test_unknown_engine_argument() -> None:
    with pytest.raises(TypeError, match="gpu_memory_utilisation"):
        LLM("tiny", gpu_memory_utilisation=0.5)


def test_kv_budget_smaller_than_a_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="max seq len"):
        LLM("tiny", max_model_len=1024, num_gpu_blocks_override=8)


def test_generation_config_defaults(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from engine.models.loader import load_generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "max_new_tokens": 7, "eos_token_id": 2}))
    defaults = load_generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    params = SamplingParams(temperature=0.0).with_defaults(defaults)
    assert params.temperature == 0.0 and params.top_p == 0.9 and params.max_tokens == 7
