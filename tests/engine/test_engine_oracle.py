"""Greedy SmolLM2 outputs equal HF transformers on the same dequantized fp32 weights, and stay equal under every
scheduling variation (batching, chunked prefill, prefix hits, preemption by recompute and by swap)."""

from __future__ import annotations

import pytest

from engine.outputs import RequestOutput
from kvflow import LLM, SamplingParams
from tests.helpers.oracle import PROMPTS, SMALL_KV, assert_matches_oracle, hf_greedy

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", dtype="float32", kv_cache_memory_bytes=SMALL_KV, max_model_len=1024)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    outputs = llm.generate(PROMPTS, GREEDY)
    return [o.prompt_token_ids for o in outputs], token_ids(outputs)


def test_greedy_matches_hf_transformers(reference: tuple[list[list[int]], list[list[int]]]) -> None:
    prompts, ours = reference
    assert len(prompts) >= 8
    for prompt_ids, our_ids in zip(prompts, ours, strict=True):
        assert len(our_ids) == MAX_TOKENS
        assert_matches_oracle(prompt_ids, our_ids, hf_greedy(prompt_ids, MAX_TOKENS))


def test_capital_of_france_chat(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def test_one_sequence_at_a_time_equals_batch(reference: tuple[list[list[int]], list[list[int]]]) -> None:
    single = LLM("smollm2", dtype="float32", kv_cache_memory_bytes=SMALL_KV, max_model_len=1024, max_num_seqs=1)
    assert token_ids(single.generate(PROMPTS, GREEDY)) == reference[1]


@pytest.mark.parametrize("budget", [32, 64])
def test_chunked_prefill_equals_batch(reference: tuple[list[list[int]], list[list[int]]], budget: int) -> None:
    chunked = LLM("smollm2", dtype="float32", kv_cache_memory_bytes=SMALL_KV, max_model_len=1024,
                  max_num_batched_tokens=budget, enable_chunked_prefill=True)
    assert token_ids(chunked.generate(PROMPTS, GREEDY)) == reference[1]
    assert chunked.stats.num_steps > MAX_TOKENS  # prompts really were split across steps


def test_prefix_cache_hit_equals_miss(llm: LLM) -> None:
    shared = PROMPTS[7] * 3  # several full blocks
    prompts = [shared + " and then", shared + " but later"]
    before = llm.stats.prefix_cache_hits
    first = token_ids(llm.generate(prompts, GREEDY))
    assert llm.stats.prefix_cache_hits > before  # the second prompt reused the first one's blocks
    hits = llm.stats.prefix_cache_hits
    again = token_ids(llm.generate(prompts, GREEDY))  # now both hit
    assert llm.stats.prefix_cache_hits > hits
    no_cache = LLM("smollm2", dtype="float32", kv_cache_memory_bytes=SMALL_KV, max_model_len=1024,
                   enable_prefix_caching=False)
    assert first == again == token_ids(no_cache.generate(prompts, GREEDY))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(reference: tuple[list[list[int]], list[list[int]]], mode: str) -> None:
    # 24 blocks of 16 tokens cannot hold 10 sequences of ~20-60 tokens: requests get preempted.
    tight = LLM("smollm2", dtype="float32", num_gpu_blocks_override=24, max_model_len=256,
                preemption_mode=mode, swap_space=0.05)
    assert token_ids(tight.generate(PROMPTS, GREEDY)) == reference[1]
    assert tight.stats.num_preemptions > 0
    engine = tight.llm_engine
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks  # nothing leaked
    if mode == "swap":
        assert engine.scheduler.swap_space is not None
        assert engine.scheduler.swap_space.num_free_blocks == engine.scheduler.swap_space.num_blocks
