"""Sampling features on the real model: seeds, stop strings and token ids, n > 1, logprobs, penalties, limits."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.helpers.oracle import PROMPTS, SMALL_KV, hf_next_logprobs


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", dtype="float32", kv_cache_memory_bytes=SMALL_KV, max_model_len=1024)


def test_seeded_sampling_is_reproducible_in_any_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate(PROMPTS[:5], [others, others, seeded, others, others])
    assert batch[2].outputs[0].token_ids != [] and llm.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids == alone
    batch = llm.generate([PROMPTS[3], PROMPTS[0]], [others, seeded])
    assert batch[1].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate(PROMPTS[0], different)[0].outputs[0].token_ids != alone


def test_stop_string_is_excluded_and_reported(llm: LLM) -> None:
    free = llm.generate(PROMPTS[8], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    assert "7" in free.text, free.text  # "1, 2, 3, 4, 5," continues counting
    stop = "7"
    out = llm.generate(PROMPTS[8], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    kept = llm.generate(PROMPTS[8], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop],
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[: free.text.index(stop) + 1]


def test_stop_token_ids_and_length(llm: LLM) -> None:
    free = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    target = free.token_ids[3]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[target]))[0]
    first = free.token_ids.index(target)
    assert out.outputs[0].token_ids == free.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == target
    decode = llm.get_tokenizer().decode  # as vLLM: the stop token's text is left out, unless asked for
    assert out.outputs[0].text == decode(free.token_ids[:first], skip_special_tokens=True)
    kept = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[target],
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == decode(free.token_ids[: first + 1], skip_special_tokens=True)
    at_least = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=first + 2,
                                                       stop_token_ids=[target]))[0].outputs[0]
    assert len(at_least.token_ids) > first + 1


def test_n_samples_share_prompt_blocks(llm: LLM) -> None:
    prompt = PROMPTS[7] * 2
    hits = llm.stats.prefix_cache_hits
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct samples
    prompt_blocks = (len(out.prompt_token_ids) - 1) // 16
    assert llm.stats.prefix_cache_hits - hits >= 2 * prompt_blocks * 16  # siblings reused the first's prompt


def test_logprobs_match_hf(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3,
                                                  prompt_logprobs=2))[0]
    sample = out.outputs[0]
    assert sample.logprobs is not None and len(sample.logprobs) == 4
    context = list(out.prompt_token_ids)
    for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
        reference = hf_next_logprobs(context)
        assert entry[token].rank == 1
        assert math.isclose(entry[token].logprob, reference[token].item(), abs_tol=1e-3)
        top = reference.topk(3)
        assert set(entry) == set(top.indices.tolist())
        context.append(token)
    assert sample.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                          zip(sample.token_ids, sample.logprobs, strict=True)))
    prompt_lp = out.prompt_logprobs
    assert prompt_lp is not None and len(prompt_lp) == len(out.prompt_token_ids) and prompt_lp[0] is None
    ids = out.prompt_token_ids
    second = hf_next_logprobs(ids[:1])
    assert math.isclose(prompt_lp[1][ids[1]].logprob, second[ids[1]].item(), abs_tol=1e-3)


def test_repetition_penalty_changes_greedy_path(llm: LLM) -> None:
    plain = llm.generate(PROMPTS[8], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].token_ids
    penalized = llm.generate(PROMPTS[8], SamplingParams(temperature=0.0, max_tokens=16,
                                                        repetition_penalty=1.5))[0].outputs[0].token_ids
    assert plain != penalized
    assert len(set(penalized)) >= len(set(plain))


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0].token_ids
    top1 = llm.generate(PROMPTS[2], SamplingParams(temperature=0.8, top_k=1, max_tokens=10))[0].outputs[0].token_ids
    assert top1 == greedy


def test_penalties_follow_vllm_semantics() -> None:
    from engine.runner.sampler import SamplingRow, apply_penalties

    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
                      prompt_token_ids=[0], output_token_ids=[1, 1, 2], generator=None)
    out = apply_penalties(logits, [row])[0]
    assert out.tolist() == pytest.approx([1.0, -4.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 0.5])


def test_logit_bias_is_added_before_penalties_and_steers_greedy() -> None:
    from engine.runner.sampler import Sampler, SamplingRow, apply_logit_bias

    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]])
    biased = SamplingRow(SamplingParams(temperature=0.0, logit_bias={1: 5.0, 0: -100}), [0], [], None)
    plain = SamplingRow(SamplingParams(temperature=0.0), [0], [], None)
    out = apply_logit_bias(logits, [biased, plain])
    assert out[0].tolist() == pytest.approx([-98.0, 3.0, 1.0, 0.5]) and out[1].tolist() == logits[1].tolist()
    assert logits[0, 0] == 2.0  # the caller's logits are left alone
    assert Sampler(0, torch.device("cpu")).sample(logits, [biased, plain]).tolist() == [1, 0]
    penalized = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 2.0}), [0], [],
                            None)
    assert Sampler(0, torch.device("cpu")).sample(torch.tensor([[2.0, 2.5]]), [penalized]).tolist() == [1]  # 4/2


def test_logit_bias_validation() -> None:
    from engine.errors import InvalidRequest

    for bad in ({1: 101.0}, {1: float("nan")}, {-1: 1.0}, {"1": 1.0}, {1: True}, [1]):
        with pytest.raises(InvalidRequest) as info:
            SamplingParams(logit_bias=bad)
        assert info.value.param == "logit_bias"
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(temperature=float("inf"))
    assert info.value.param == "temperature"


def test_logit_bias_on_the_real_model(llm: LLM) -> None:
    from engine.errors import InvalidRequest

    free = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    forced = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                     logit_bias={42: 100.0}))[0].outputs[0]
    assert forced.token_ids == [42] * 6 and free.token_ids != forced.token_ids
    banned = llm.generate(PROMPTS[2], SamplingParams(temperature=0.7, seed=3, max_tokens=6, ignore_eos=True,
                                                     logit_bias={t: -100.0 for t in free.token_ids}))[0].outputs[0]
    assert not set(banned.token_ids) & set(free.token_ids)
    with pytest.raises(InvalidRequest) as info:
        llm.generate(PROMPTS[2], SamplingParams(logit_bias={10**6: 1.0}))
    assert info.value.param == "logit_bias"


def test_logit_bias_crosses_the_worker_wire() -> None:
    from cluster.wire import sampling_params_from_proto, sampling_params_to_proto

    params = SamplingParams(temperature=0.5, logit_bias={3: -100.0, 70000: 2.5})
    wire = sampling_params_to_proto(params)
    assert dict(wire.logit_bias) == {3: -100.0, 70000: 2.5}
    assert sampling_params_from_proto(wire).logit_bias == {3: -100.0, 70000: 2.5}
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())).logit_bias is None
